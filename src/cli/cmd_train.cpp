// `moe train`: pretrain a model from a TOML configuration (see configs/small.toml), and
// `moe finetune`: LoRA-fine-tune a frozen base model (see configs/finetune-small.toml); any key
// overridable as --section.key value.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <optional>

#include "cli/commands.h"
#include "core/error.h"
#include "parallel/communicator.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"

namespace moe::cli {

namespace {

namespace fs = std::filesystem;

struct TrainArgs {
  ConfigPurpose purpose = ConfigPurpose::Pretrain;
  std::string config_file;
  int64_t ep = 0;  // 0: not given
  int64_t collective_timeout = -1;  // -1: not given
  std::string resume;  // "" with resume_given: the latest checkpoint of the out dir
  bool resume_given = false;
};

// A checkpoint directory, or a run directory whose latest checkpoint is meant.
fs::path resolve_checkpoint(const fs::path& path) {
  if (fs::is_regular_file(path / kTrainerStateFile)) return path;
  for (const fs::path& dir : {path / "checkpoints", path}) {
    if (auto latest = latest_checkpoint(dir)) return *latest;
  }
  fail("--resume {}: neither a checkpoint (no {}) nor a run directory with checkpoints",
       path.string(), kTrainerStateFile);
}

void run_train(const TrainArgs& a, const std::vector<std::string>& extras) {
  std::vector<ConfigOverride> overrides = parse_override_args(extras);
  if (a.ep > 0) overrides.push_back({"parallel.ep", std::to_string(a.ep)});
  if (a.collective_timeout >= 0)
    overrides.push_back({"parallel.collective_timeout", std::to_string(a.collective_timeout)});
  const bool ep_given = std::any_of(overrides.begin(), overrides.end(),
                                    [](const ConfigOverride& o) { return o.key == "parallel.ep"; });
  TrainRequest req;
  // Under mpirun every rank runs this same command; alone, a one-rank world without MPI.
  req.world = make_world_communicator();
  if (a.resume_given && !a.resume.empty()) {
    req.resume_from = resolve_checkpoint(a.resume);
    // Without --config the run continues under the configuration it was saved with.
    req.config = a.config_file.empty()
                     ? parse_train_config(read_trainer_state(*req.resume_from).config_toml,
                                          (*req.resume_from / kTrainerStateFile).string(), overrides,
                                          a.purpose)
                     : load_train_config(a.config_file, overrides, a.purpose);
    // Checkpoints resume at any number of ranks; the saved EP size may not divide the new one.
    // Unless --ep says otherwise, keep as much of it as the new world allows.
    if (a.config_file.empty() && !ep_given) {
      const int64_t saved = req.config.parallel.ep, w = req.world->size();
      req.config.parallel.ep = std::gcd(saved, w);
      if (req.config.parallel.ep != saved && req.world->rank() == 0)
        fmt::print(stderr, "note: the run was saved at expert-parallel size {}; on {} rank{} it "
                   "continues at {} (give --ep to choose)\n", saved, w, w == 1 ? "" : "s",
                   req.config.parallel.ep);
    }
  } else {
    MOE_CHECK(!a.config_file.empty(), "--config is required (or --resume PATH to continue a run "
              "under its saved configuration)");
    req.config = load_train_config(a.config_file, overrides, a.purpose);
    if (a.resume_given) {
      const fs::path ckpts = fs::path(req.config.run.out_dir) / "checkpoints";
      const auto latest = latest_checkpoint(ckpts);
      MOE_CHECK(latest.has_value(), "--resume: {} holds no checkpoint to resume from",
                ckpts.string());
      req.resume_from = *latest;
    }
  }
  const TrainResult result = train(req);
  // 130 = killed by SIGINT, by shell convention: scripts see the run did not finish.
  if (result.interrupted) {
    // Under mpirun the launcher reports one status for the job (after SIGTERM, its own), so
    // every rank says how it ended.
    if (req.world->size() > 1)
      fmt::print(stderr, "rank {}: interrupted after step {}; checkpoint {}; exit 130\n",
                 req.world->rank(), result.steps_done, result.last_checkpoint.string());
    throw CLI::RuntimeError(130);
  }
}

void add_run_options(CLI::App* cmd, const std::shared_ptr<TrainArgs>& args, const char* example) {
  cmd->add_option("--config", args->config_file, example);
  cmd->add_option("--resume", args->resume,
                  "continue a run: a checkpoint directory, a run directory, or nothing for the "
                  "latest checkpoint in run.out_dir")
      ->expected(0, 1);
  cmd->add_option("--ep", args->ep,
                  "expert-parallel size under mpirun (same as --parallel.ep): must divide the "
                  "number of ranks and of routed experts")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--collective-timeout", args->collective_timeout,
                  "under mpirun, seconds a rank may wait in one collective before the job is "
                  "ended as stalled (same as --parallel.collective_timeout; default 600, 0: never)")
      ->check(CLI::NonNegativeNumber);
  cmd->allow_extras();
  cmd->callback([args, cmd] {
    args->resume_given = cmd->count("--resume") > 0;
    run_train(*args, cmd->remaining());
  });
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train", "pretrain a model from a TOML config; override any key with --section.key value");
  auto args = std::make_shared<TrainArgs>();
  add_run_options(cmd, args, "TOML training configuration (e.g. configs/small.toml)");
  cmd->footer(
      "Config overrides: --section.key value (or --section.key=value), e.g. --optimizer.lr 3e-4 "
      "--schedule.steps 200 --model.num_hidden_layers 4. Sections: model, data, optimizer, "
      "schedule, checkpoint, logging, run, parallel. Expert parallelism: mpirun -np 4 moe train "
      "--config c.toml --ep 2 (data.batch_size counts the sequences of all ranks together).");
}

void add_finetune_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "finetune", "LoRA-fine-tune a frozen model (model.weights) from a TOML config with a [lora] "
                  "section; override any key with --section.key value");
  auto args = std::make_shared<TrainArgs>();
  args->purpose = ConfigPurpose::Finetune;
  add_run_options(cmd, args, "TOML fine-tuning configuration (e.g. configs/finetune-small.toml)");
  cmd->footer(
      "The base model (model.weights, fp32/bf16 or with MXFP4 routed experts) stays frozen; "
      "adapters train and every checkpoint is a PEFT adapter directory (adapter_config.json + "
      "adapter_model.safetensors) usable with --adapter. Data: text, JSONL {\"prompt\", "
      "\"completion\"} or chat JSONL {\"messages\": [...]}, loss on completions / assistant "
      "turns only. Sections: model, data, optimizer, schedule, checkpoint, logging, run, "
      "parallel, lora.");
}

}  // namespace moe::cli
