#include "train/checkpoint_state.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"
#include "parallel/communicator.h"
#include "parallel/ep_training.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kStepPrefix = "step_";
// Hidden names: never mistaken for checkpoints, and cleaned up by the next save.
constexpr const char* kTempPrefix = ".tmp-step_";
constexpr const char* kOldPrefix = ".old-step_";

std::string hex(uint64_t v) { return fmt::format("{:#018x}", v); }

uint64_t parse_hex(const json& j, const std::string& what, const fs::path& file) {
  MOE_CHECK(j.is_string(), "{}: '{}' must be a hex string", file.string(), what);
  const std::string s = j.get<std::string>();
  uint64_t v = 0;
  const char* begin = s.data() + (s.rfind("0x", 0) == 0 ? 2 : 0);
  auto [ptr, ec] = std::from_chars(begin, s.data() + s.size(), v, 16);
  MOE_CHECK(ec == std::errc() && ptr == s.data() + s.size(), "{}: '{}' is not a hex number: {}",
            file.string(), what, s);
  return v;
}

// step_<digits> -> N; anything else -> nullopt.
std::optional<int64_t> step_of(const std::string& name) {
  const std::string prefix = kStepPrefix;
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return std::nullopt;
  int64_t v = 0;
  const char* end = name.data() + name.size();
  auto [ptr, ec] = std::from_chars(name.data() + prefix.size(), end, v);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return v;
}

void remove_leftovers(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kTempPrefix, 0) == 0 || name.rfind(kOldPrefix, 0) == 0) fs::remove_all(e.path());
  }
}

enum class Part { All, NonExperts, Experts };

bool in_part(const Param& p, Part part) {
  return part == Part::All || (part == Part::Experts) == is_routed_expert_param(p.name);
}

ParamList params_of(const ParamList& params, Part part) {
  ParamList out;
  for (Param* p : params)
    if (in_part(*p, part)) out.push_back(p);
  return out;
}

std::string expert_optimizer_file(int shard, int shards) {
  return fmt::format("optimizer-experts-{:05d}-of-{:05d}.safetensors", shard + 1, shards);
}

void write_optimizer(const fs::path& file, const AdamW& opt, Part part = Part::All) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  const ParamList& params = opt.params();
  for (size_t i = 0; i < params.size(); ++i)
    if (in_part(*params[i], part))
      tensors.emplace_back("exp_avg." + params[i]->name, opt.first_moments()[i]);
  for (size_t i = 0; i < params.size(); ++i)
    if (in_part(*params[i], part))
      tensors.emplace_back("exp_avg_sq." + params[i]->name, opt.second_moments()[i]);
  const AdamWConfig& c = opt.config();
  write_safetensors(file, tensors,
                    {{"format", "moe-adamw"},
                     {"step", std::to_string(opt.steps())},
                     {"beta1", fmt::format("{}", c.beta1)},
                     {"beta2", fmt::format("{}", c.beta2)},
                     {"eps", fmt::format("{}", c.eps)},
                     {"weight_decay", fmt::format("{}", c.weight_decay)}});
}

json state_to_json(const TrainerState& s) {
  return {{"format", "moe-trainer-state"},
          {"version", 1},
          {"step", s.step},
          {"tokens_seen", s.tokens_seen},
          {"nonfinite_streak", s.nonfinite_streak},
          {"data",
           {{"epoch", s.data.epoch},
            {"index", s.data.index},
            {"fingerprint", hex(s.data_fingerprint)}}},
          {"rng", {{"seed", s.data_seed}, {"shuffle_state", hex(s.shuffle_rng_state)}}},
          {"tokenizer", s.tokenizer},
          {"config", s.config_toml}};
}

}  // namespace

void write_optimizer_files(const fs::path& dir, const AdamW& optimizer,
                           const CheckpointWriters& writers) {
  Communicator* world = writers.world && writers.world->size() > 1 ? writers.world : nullptr;
  const bool main = world == nullptr || world->rank() == 0;
  if (world == nullptr || writers.ep_size == 1) {
    if (main) write_optimizer(dir / kOptimizerStateFile, optimizer);
    return;
  }
  if (main) write_optimizer(dir / kOptimizerStateFile, optimizer, Part::NonExperts);
  if (writers.writes_experts)
    write_optimizer(dir / expert_optimizer_file(writers.ep_rank, writers.ep_size), optimizer,
                    Part::Experts);
}

fs::path save_checkpoint(const fs::path& checkpoints_dir, const ModelConfig& model_config,
                         const ParamList& params, const AdamW& optimizer,
                         const TrainerState& state, int64_t keep_last,
                         const CheckpointFileHook& hook,
                         const std::vector<std::pair<std::string, std::string>>& extra_files,
                         const CheckpointWriters& writers) {
  Communicator* world = writers.world && writers.world->size() > 1 ? writers.world : nullptr;
  const bool main = world == nullptr || world->rank() == 0;
  const bool sharded = world != nullptr && writers.ep_size > 1;
  return save_checkpoint_dir(
      checkpoints_dir, state, keep_last, hook, extra_files, writers, [&](const fs::path& tmp) {
        // Training state must resume bit for bit, so the weights are always written in float32.
        if (!sharded) {
          if (main) {
            save_model(tmp, model_config, params, DType::F32);
            if (hook) hook("model.safetensors");
          }
        } else {
          const int64_t shards = writers.ep_size + 1;
          if (main) save_model_shard(tmp, 1, shards, params_of(params, Part::NonExperts));
          if (writers.writes_experts)
            save_model_shard(tmp, writers.ep_rank + 2, shards, params_of(params, Part::Experts));
        }
        write_optimizer_files(tmp, optimizer, writers);
        if (main && hook) hook(kOptimizerStateFile);
        if (sharded) {
          world->barrier();
          if (main) {
            finish_sharded_model(tmp, model_config, writers.ep_size + 1);
            if (hook) hook("model.safetensors.index.json");
          }
        }
      });
}

fs::path save_checkpoint_dir(const fs::path& checkpoints_dir, const TrainerState& state,
                             int64_t keep_last, const CheckpointFileHook& hook,
                             const std::vector<std::pair<std::string, std::string>>& extra_files,
                             const CheckpointWriters& writers, const CheckpointPayload& payload) {
  Communicator* world = writers.world && writers.world->size() > 1 ? writers.world : nullptr;
  const bool main = world == nullptr || world->rank() == 0;
  // Every rank needs the temporary directory's name: rank 0's pid.
  int64_t pid = main ? static_cast<int64_t>(getpid()) : 0;
  if (world) world->all_reduce_sum(&pid, 1);
  const std::string step_name = kStepPrefix + std::to_string(state.step);
  const fs::path tmp = checkpoints_dir / fmt::format("{}{}.{}", kTempPrefix, state.step, pid);
  if (main) {
    fs::create_directories(checkpoints_dir);
    remove_leftovers(checkpoints_dir);
    fs::create_directory(tmp);
  }
  if (world) world->barrier();
  try {
    payload(tmp);
    if (world) world->barrier();
    if (main) {
      for (const auto& [name, contents] : extra_files) {
        write_file_atomic(tmp / name, contents);
        if (hook) hook(name);
      }
      // Last: its presence is what marks a checkpoint complete.
      write_file_atomic(tmp / kTrainerStateFile, state_to_json(state).dump(2) + "\n");
      if (hook) hook(kTrainerStateFile);
      fsync_directory(tmp);
    }
  } catch (...) {
    // A failed write (disk full, file size limit) should not leave a checkpoint-sized
    // directory on a disk that is likely full; a killed one is removed by the next save.
    std::error_code ignored;
    if (main) fs::remove_all(tmp, ignored);
    throw;
  }

  fs::path final_dir = checkpoints_dir / step_name;
  if (main) {
    // Re-saving a step (a resumed run finishing where it started): rename cannot replace a
    // non-empty directory, so the two are swapped in one step (the old copy then carries the
    // temporary name, which the next save removes); a kill at any moment leaves one complete
    // step_N. File systems without RENAME_EXCHANGE move the old copy aside first.
    const fs::path old = checkpoints_dir / (kOldPrefix + std::to_string(state.step));
    if (!fs::exists(final_dir)) {
      fs::rename(tmp, final_dir);
    } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(checkpoints_dir);
      fs::remove_all(tmp);
    } else {
      fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
    }
    fsync_directory(checkpoints_dir);
    fs::remove_all(old);

    const auto all = list_checkpoints(checkpoints_dir);
    const int64_t excess = static_cast<int64_t>(all.size()) - keep_last;
    for (int64_t i = 0; i < excess; ++i)
      if (all[static_cast<size_t>(i)].second != final_dir)
        fs::remove_all(all[static_cast<size_t>(i)].second);
  }
  // No rank goes on (to read or write checkpoints) before this one is in place.
  if (world) world->barrier();
  return final_dir;
}

std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& checkpoints_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(checkpoints_dir)) {
    const auto step = step_of(e.path().filename().string());
    if (step && fs::is_regular_file(e.path() / kTrainerStateFile)) out.emplace_back(*step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<fs::path> latest_checkpoint(const fs::path& checkpoints_dir) {
  const auto all = list_checkpoints(checkpoints_dir);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

TrainerState read_trainer_state(const fs::path& dir) {
  const fs::path file = dir / kTrainerStateFile;
  std::ifstream in(file, std::ios::binary);
  MOE_CHECK(in.good(), "{}: not a checkpoint (no {})", dir.string(), kTrainerStateFile);
  std::stringstream text;
  text << in.rdbuf();
  const json j = json::parse(text.str(), json_depth_limit<json>(file.string()), /*allow_exceptions=*/false);
  MOE_CHECK(j.is_object() && j.value("format", "") == "moe-trainer-state",
            "{}: not a moe trainer state", file.string());
  TrainerState s;
  try {
    s.step = j.at("step").get<int64_t>();
    s.tokens_seen = j.at("tokens_seen").get<int64_t>();
    s.nonfinite_streak = j.at("nonfinite_streak").get<int64_t>();
    s.data.epoch = j.at("data").at("epoch").get<int64_t>();
    s.data.index = j.at("data").at("index").get<int64_t>();
    s.data_fingerprint = parse_hex(j.at("data").at("fingerprint"), "data.fingerprint", file);
    s.data_seed = j.at("rng").at("seed").get<uint64_t>();
    s.shuffle_rng_state = parse_hex(j.at("rng").at("shuffle_state"), "rng.shuffle_state", file);
    s.tokenizer = j.at("tokenizer").get<std::string>();
    s.config_toml = j.at("config").get<std::string>();
  } catch (const json::exception& e) {
    fail("{}: malformed trainer state: {}", file.string(), e.what());
  }
  return s;
}

void load_optimizer_state(const fs::path& dir, AdamW& opt) {
  const SafetensorsReader reader(dir / kOptimizerStateFile);
  // Expert shards of an expert-parallel run; only headers are read until a moment is needed.
  std::vector<std::unique_ptr<SafetensorsReader>> expert_files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("optimizer-experts-", 0) == 0 && name.ends_with(".safetensors"))
      expert_files.push_back(std::make_unique<SafetensorsReader>(e.path()));
  }
  auto holder = [&](const std::string& name) -> const SafetensorsReader& {
    if (reader.contains(name)) return reader;
    for (const auto& r : expert_files)
      if (r->contains(name)) return *r;
    fail("{}: no optimizer state '{}' in {} or an optimizer-experts-*.safetensors file",
         dir.string(), name, kOptimizerStateFile);
  };
  const ParamList& params = opt.params();
  for (size_t i = 0; i < params.size(); ++i) {
    for (const auto& [prefix, t] : {std::pair{"exp_avg.", opt.first_moments()[i]},
                                    std::pair{"exp_avg_sq.", opt.second_moments()[i]}}) {
      const std::string name = prefix + params[i]->name;
      const SafetensorsReader& r = holder(name);
      const SafetensorsEntry& e = r.entry(name);
      MOE_CHECK(e.shape == t.shape() && e.dtype == "F32",
                "{}: '{}' is {} {}, the optimizer expects F32 {}", r.path().string(), name,
                e.dtype, shape_str(e.shape), shape_str(t.shape()));
      r.read_into(name, t);
    }
  }
  const auto it = reader.metadata().find("step");
  MOE_CHECK(it != reader.metadata().end(), "{}: no 'step' in the metadata", reader.path().string());
  int64_t step = 0;
  const std::string& s = it->second;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), step);
  MOE_CHECK(ec == std::errc() && ptr == s.data() + s.size() && step >= 0,
            "{}: metadata 'step' is not a count: {}", reader.path().string(), s);
  opt.set_steps(step);
}

}  // namespace moe
