#pragma once
// `moe train` configuration: a TOML file with sections [model] [data] [optimizer] [schedule]
// [checkpoint] [logging] [run] [parallel], each key overridable on the command line as --section.key value.
// Unknown keys and ill-typed or out-of-range values are errors naming the key.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "lora/lora_config.h"
#include "model/config.h"

namespace moe {

struct TrainConfig {
  struct Model {
    // A preset name, a config.json or a model directory (its config only; see `weights`).
    std::string preset = "small";
    // A model directory (Hugging Face layout) whose weights start the run instead of a random
    // initialisation; under expert parallelism each rank reads only its own experts.
    std::string weights;
    // Routed experts: "fp32" (trained), "mxfp4" (frozen, packed 4.25 bits per weight, decoded
    // inside the matmuls; everything else trains), "auto": as the preset's config.json says.
    std::string experts = "auto";
    // Any Hugging Face config.json field, applied on top of the preset (e.g. num_hidden_layers).
    nlohmann::json overrides = nlohmann::json::object();
  } model;
  struct Data {
    std::vector<std::string> path = {"data/kjv.txt"};  // files or directories, relative to cwd
    std::string format = "auto";                       // auto | text | jsonl
    std::string jsonl_field = "text";
    std::string tokenizer = "byte";  // "byte" or a tokenizer.json (`moe tokenizer train`)
    int64_t seq_len = 256;
    int64_t batch_size = 8;     // sequences per micro-batch, over all ranks together
    double val_fraction = 0.01; // tail of the token stream held out for validation
    int64_t val_batches = 0;    // batches per validation (0: the whole split)
    bool shuffle = true;
  } data;
  struct Optimizer {
    double lr = 1e-3;  // peak, reached after warmup
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
    double grad_clip = 1.0;     // global L2 norm; 0 disables clipping
    int64_t grad_accum = 1;     // micro-batches per optimizer step
    double z_loss = 0.0;        // coefficient of mean(logsumexp^2)
    double bias_update_rate = 1e-3;   // aux-loss-free router balancing; 0 disables it
    int64_t max_nonfinite_steps = 5;  // consecutive skipped NaN/Inf steps before the run stops
  } optimizer;
  struct Schedule {
    int64_t steps = 1000;       // optimizer steps
    int64_t warmup_steps = 100; // linear from lr/warmup_steps up to lr
    std::string decay = "cosine";  // cosine | constant
    double min_lr = 1e-4;       // end of the cosine
  } schedule;
  struct Checkpoint {
    int64_t every = 0;      // steps between checkpoints (0: only at the end)
    int64_t keep_last = 2;  // older step_N directories are removed
  } checkpoint;
  struct Logging {
    int64_t log_every = 10;      // plain log lines (when not on a terminal)
    int64_t val_every = 0;       // steps between validations (0: only at the end)
    std::string progress = "auto";  // auto (a live line on a terminal) | bar | lines | none
  } logging;
  struct Run {
    int64_t seed = 1234;
    int64_t threads = 0;  // 0: the global --threads (default all cores)
    std::string out_dir = "runs/train";
  } run;
  // `moe finetune` only (finetune = true): LoRA adapters on a frozen base model (model.weights).
  bool finetune = false;
  struct Lora {
    int64_t r = 8;
    double alpha = 16.0;
    double dropout = 0.0;
    bool rslora = false;
    std::vector<std::string> targets = {"all-linear"};  // PEFT target_modules (suffix match)
    std::string target_regex;   // or one regex over whole module names
    int64_t expert_r = 0;       // routed experts' rank (0: r)
    double expert_alpha = 0.0;  // routed experts' alpha (0: alpha)
  } lora;
  struct Parallel {
    // Expert-parallel size under mpirun: must divide the number of ranks and the routed experts.
    // Each rank holds E / ep experts; the W / ep ranks with the same experts are replicas.
    int64_t ep = 1;
    // Seconds a rank may wait inside one collective before the job is ended as stalled (a rank
    // stopped or hung without dying); 0: wait forever. Only waits are timed, never compute
    // (src/parallel/collective_watchdog.h).
    int64_t collective_timeout = 600;
    // The same while a checkpoint is written, when ranks wait for one rank's disk writes;
    // 0: wait forever.
    int64_t checkpoint_timeout = 3600;
  } parallel;
};

struct ConfigOverride {
  std::string key;  // "section.key"
  std::string value;
};

// Parses --section.key value and --section.key=value pairs; anything else is an error.
std::vector<ConfigOverride> parse_override_args(const std::vector<std::string>& args);

// What the configuration is for: `moe train` rejects a [lora] section, `moe finetune` takes
// one, needs model.weights, freezes the base (no router-bias updates) and reads fine-tuning
// data formats (data/finetune_data.h).
enum class ConfigPurpose { Pretrain, Finetune };

// Defaults, then the TOML text, then the overrides. `source` names the text in errors.
TrainConfig parse_train_config(const std::string& toml_text, const std::string& source,
                               const std::vector<ConfigOverride>& overrides = {},
                               ConfigPurpose purpose = ConfigPurpose::Pretrain);
TrainConfig load_train_config(const std::filesystem::path& file,
                              const std::vector<ConfigOverride>& overrides = {},
                              ConfigPurpose purpose = ConfigPurpose::Pretrain);
// The adapter settings of a fine-tuning configuration.
LoraSettings lora_settings(const TrainConfig& cfg);
// Every key with its resolved value; parse_train_config of it gives back the same config.
std::string train_config_to_toml(const TrainConfig& cfg);

// The preset with the [model] overrides applied, the vocabulary set to `vocab_size` and the
// special token ids to `end_of_text`. Errors name the [model] key.
ModelConfig resolve_train_model(const TrainConfig& cfg, int64_t vocab_size, int64_t end_of_text);

}  // namespace moe
