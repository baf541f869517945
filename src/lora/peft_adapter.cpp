#include "lora/peft_adapter.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/documents.h"
#include "io/hf_config.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "parallel/communicator.h"
#include "parallel/ep_training.h"

namespace moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

json peft_adapter_config(const LoraSettings& s, const std::string& base_model) {
  json targets;
  if (!s.target_regex.empty()) targets = s.target_regex;
  else if (s.targets == std::vector<std::string>{"all-linear"}) targets = "all-linear";
  else targets = s.targets;
  json rank_pattern = json::object(), alpha_pattern = json::object();
  if (s.expert_r > 0 && s.expert_r != s.r) rank_pattern[kExpertRankPattern] = s.expert_r;
  if (s.expert_alpha > 0 && s.expert_alpha != s.alpha) alpha_pattern[kExpertRankPattern] = s.expert_alpha;
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base_model},
          {"r", s.r},
          {"lora_alpha", s.alpha},
          {"lora_dropout", s.dropout},
          {"use_rslora", s.rslora},
          {"target_modules", targets},
          {"rank_pattern", rank_pattern},
          {"alpha_pattern", alpha_pattern},
          {"bias", "none"},
          {"fan_in_fan_out", false},
          {"init_lora_weights", true},
          {"inference_mode", true},
          {"use_dora", false},
          {"modules_to_save", nullptr},
          {"layers_to_transform", nullptr},
          {"layers_pattern", nullptr},
          {"revision", nullptr},
          {"library", "moe"}};
}

namespace {

template <typename T>
T field(const json& j, const char* key, T fallback, const std::string& source, const char* want) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    fail("{}: field '{}': expected {}, got {}", source, key, want, j[key].dump());
  }
}

// A PEFT feature the engine does not implement, present with a non-default value.
void reject_unless(const json& j, const char* key, const json& allowed, const std::string& source,
                   const char* what) {
  if (!j.contains(key) || j[key].is_null() || j[key] == allowed) return;
  if (j[key].is_array() && j[key].empty()) return;
  if (j[key].is_object() && j[key].empty()) return;
  fail("{}: field '{}' = {}: {} is not supported by moe", source, key, j[key].dump(), what);
}

// The routed experts' rank or alpha from rank_pattern / alpha_pattern (only the pattern moe
// writes is understood).
double expert_pattern(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return 0;
  MOE_CHECK(j[key].is_object(), "{}: field '{}': expected an object", source, key);
  double v = 0;
  for (const auto& [pattern, value] : j[key].items()) {
    MOE_CHECK(pattern == kExpertRankPattern && value.is_number(),
              "{}: field '{}': only {{\"{}\": number}} (the routed experts' own value) is "
              "supported, got \"{}\": {}", source, key, kExpertRankPattern, pattern, value.dump());
    v = value.get<double>();
  }
  return v;
}

}  // namespace

LoraSettings lora_settings_from_peft(const json& j, const std::string& source) {
  MOE_CHECK(j.is_object(), "{}: expected a JSON object", source);
  const std::string type = field<std::string>(j, "peft_type", "LORA", source, "a string");
  MOE_CHECK(type == "LORA", "{}: field 'peft_type': expected \"LORA\", got \"{}\"", source, type);
  reject_unless(j, "use_dora", false, source, "DoRA");
  reject_unless(j, "bias", "none", source, "training biases");
  reject_unless(j, "fan_in_fan_out", false, source, "fan_in_fan_out (Conv1D layers)");
  reject_unless(j, "modules_to_save", nullptr, source, "full fine-tuning of extra modules");
  reject_unless(j, "layers_to_transform", nullptr, source, "layer selection");
  reject_unless(j, "layer_replication", nullptr, source, "layer replication");
  reject_unless(j, "use_qalora", false, source, "QA-LoRA");
  reject_unless(j, "target_parameters", nullptr, source,
                "the fused-experts ParamWrapper layout (target_parameters)");
  reject_unless(j, "lora_bias", false, source, "a bias on lora_B (lora_bias)");
  reject_unless(j, "trainable_token_indices", nullptr, source, "trainable token embeddings");
  reject_unless(j, "exclude_modules", nullptr, source, "exclude_modules");
  LoraSettings s;
  s.r = field<int64_t>(j, "r", 8, source, "an integer");
  s.alpha = field<double>(j, "lora_alpha", 8.0, source, "a number");
  s.dropout = field<double>(j, "lora_dropout", 0.0, source, "a number");
  s.rslora = field<bool>(j, "use_rslora", false, source, "true or false");
  MOE_CHECK(j.contains("target_modules") && !j["target_modules"].is_null(),
            "{}: field 'target_modules' is missing", source);
  const json& t = j["target_modules"];
  if (t.is_string()) {
    const std::string v = t.get<std::string>();
    if (v == "all-linear") s.targets = {v};
    else s.targets.clear(), s.target_regex = v;
  } else {
    s.targets = field<std::vector<std::string>>(j, "target_modules", {}, source,
                                                "a list of module names or a regex string");
  }
  s.expert_r = static_cast<int64_t>(expert_pattern(j, "rank_pattern", source));
  s.expert_alpha = expert_pattern(j, "alpha_pattern", source);
  s.validate(source);
  return s;
}

LoraSettings read_peft_adapter_config(const fs::path& dir) {
  const fs::path file = dir / kAdapterConfigFile;
  MOE_CHECK(fs::is_regular_file(file), "{}: not a PEFT adapter directory (no {})", dir.string(),
            kAdapterConfigFile);
  const json j = json::parse(read_whole_file(file), nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(!j.is_discarded(), "{}: not valid JSON", file.string());
  return lora_settings_from_peft(j, file.string());
}

bool is_peft_adapter_dir(const fs::path& dir) {
  return fs::is_regular_file(dir / kAdapterConfigFile);
}

namespace {

const SafetensorsMetadata kPeftMetadata{{"format", "pt"}};

std::vector<std::pair<std::string, Tensor>> tensors_of(const ParamList& ps, bool experts) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Param* p : ps)
    if (is_routed_expert_param(p->name) == experts) out.emplace_back(p->name, p->value);
  return out;
}

fs::path part_file(const fs::path& dir, int part) {
  return dir / fmt::format(".adapter-part-{:05d}.safetensors", part);
}

}  // namespace

void save_peft_adapter(const fs::path& dir, const CausalLM& model, const LoraSettings& s,
                       const std::string& base_model, const AdapterWriters& w) {
  Communicator* world = w.world && w.world->size() > 1 ? w.world : nullptr;
  const bool main = world == nullptr || world->rank() == 0;
  const ParamList& ps = model.lora_params();
  if (main) fs::create_directories(dir);
  if (world) world->barrier();
  if (world == nullptr || w.ep_size == 1) {
    if (main) {
      auto all = tensors_of(ps, false);
      for (auto& t : tensors_of(ps, true)) all.push_back(std::move(t));
      write_safetensors(dir / kAdapterWeightsFile, all, kPeftMetadata);
    }
  } else {
    if (main) write_safetensors(part_file(dir, 0), tensors_of(ps, false));
    if (w.writes_experts) write_safetensors(part_file(dir, w.ep_rank + 1), tensors_of(ps, true));
    world->barrier();
    if (main) {
      std::vector<std::pair<std::string, Tensor>> all;
      for (int part = 0; part <= w.ep_size; ++part) {
        const SafetensorsReader r(part_file(dir, part));
        for (const SafetensorsEntry& e : r.entries())
          all.emplace_back(e.name, r.read(e.name, DType::F32, MemCategory::Scratch));
      }
      write_safetensors(dir / kAdapterWeightsFile, all, kPeftMetadata);
      for (int part = 0; part <= w.ep_size; ++part) fs::remove(part_file(dir, part));
    }
  }
  if (main) {
    write_file_atomic(dir / kAdapterConfigFile, peft_adapter_config(s, base_model).dump(2) + "\n");
    fsync_directory(dir);
  }
  if (world) world->barrier();
}

void load_peft_adapter_weights(const fs::path& dir, const ParamList& ps) {
  const fs::path file = dir / kAdapterWeightsFile;
  MOE_CHECK(fs::is_regular_file(file), "{}: no {} (a PEFT adapter directory holds it next to {})",
            dir.string(), kAdapterWeightsFile, kAdapterConfigFile);
  const SafetensorsReader r(file);
  // Tensors of other kinds (lora_B biases, token embeddings, DoRA magnitudes) would change the
  // model; loading without them would be silently wrong.
  for (const SafetensorsEntry& e : r.entries())
    MOE_CHECK(e.name.ends_with(".lora_A.weight") || e.name.ends_with(".lora_B.weight"),
              "{}: tensor '{}' is not a LoRA matrix (…lora_A.weight / …lora_B.weight); moe "
              "supports plain LoRA adapters only", file.string(), e.name);
  for (Param* p : ps) {
    MOE_CHECK(r.contains(p->name), "{}: no tensor '{}' (the adapter's config targets that module)",
              file.string(), p->name);
    const SafetensorsEntry& e = r.entry(p->name);
    MOE_CHECK(e.shape == p->value.shape() && (e.dtype == "F32" || e.dtype == "BF16"),
              "{}: '{}' is {} {}, expected F32 or BF16 {}", file.string(), p->name, e.dtype,
              shape_str(e.shape), shape_str(p->value.shape()));
    r.read_into(p->name, p->value);
  }
}

void apply_peft_adapter(const fs::path& dir, CausalLM& model) {
  const LoraSettings s = read_peft_adapter_config(dir);
  model.add_lora(s, 0, (dir / kAdapterConfigFile).string());
  load_peft_adapter_weights(dir, model.lora_params());
}

uint64_t base_model_fingerprint(const fs::path& dir) {
  const fs::path config = dir / kHfConfigFile;
  MOE_CHECK(fs::is_regular_file(config), "{}: not a model directory (no {})", dir.string(),
            kHfConfigFile);
  uint64_t h = fnv1a(read_whole_file(config).c_str());
  const SafetensorsSet weights(dir);
  for (const std::string& name : weights.names()) {
    const SafetensorsReader& r = weights.reader_for(name);
    const SafetensorsEntry& e = r.entry(name);
    h = fnv1a((name + ":" + e.dtype + ":" + shape_str(e.shape) + ";").c_str(), h);
    // Sampled bytes (start, middle, end) tell two trainings of one architecture apart without
    // reading a 671B model twice.
    const int64_t n = e.nbytes(), w = std::min<int64_t>(n, 256);
    std::vector<unsigned char> bytes(static_cast<size_t>(w));
    for (const int64_t at : {int64_t{0}, (n - w) / 2, n - w}) {
      if (w == 0) break;
      r.read_bytes(e, at, w, bytes.data());
      for (unsigned char b : bytes) h = (h ^ b) * 0x100000001b3ull;
    }
  }
  return h;
}

std::string base_model_reference(const fs::path& dir, uint64_t fingerprint) {
  const json j = {{"path", fs::absolute(dir).lexically_normal().string()},
                  {"fingerprint", fmt::format("{:#018x}", fingerprint)}};
  return j.dump(2) + "\n";
}

void check_base_model(const fs::path& checkpoint_dir, const fs::path& model_dir,
                      uint64_t fingerprint) {
  const fs::path file = checkpoint_dir / kBaseModelFile;
  MOE_CHECK(fs::is_regular_file(file), "{}: not an adapter checkpoint (no {})",
            checkpoint_dir.string(), kBaseModelFile);
  const json saved = json::parse(read_whole_file(file), nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(saved.is_object() && saved.contains("fingerprint") && saved["fingerprint"].is_string(),
            "{}: malformed (expected \"path\" and \"fingerprint\")", file.string());
  const std::string want = saved["fingerprint"].get<std::string>();
  const std::string got = fmt::format("{:#018x}", fingerprint);
  MOE_CHECK(want == got,
            "{}: the adapter was trained on the base model {} (fingerprint {}); model.weights = "
            "{} is a different model (fingerprint {}: its config.json or tensors differ)",
            checkpoint_dir.string(), saved.value("path", std::string("?")), want,
            model_dir.string(), got);
}

}  // namespace moe
