// `moe plan`: the memory a `moe train` or `moe finetune` run of a configuration will peak at,
// per MemoryTracker category and per rank, before anything is allocated (train/memory_plan.h).
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "cli/commands.h"
#include "core/error.h"
#include "train/memory_plan.h"
#include "train/train_config.h"

namespace moe::cli {

namespace {

struct PlanArgs {
  std::string config_file;
  bool finetune = false;
  int ranks = 1;
  int64_t ep = 0;  // 0: not given
  std::string model;
  double expert_load = 1.0;
  bool json = false;
};

bool has_override(const std::vector<ConfigOverride>& o, const std::string& key) {
  for (const ConfigOverride& c : o)
    if (c.key == key) return true;
  return false;
}

// The [section] key of the TOML file, if set (for deciding what the plan is of before the
// configuration is parsed for real, which reports any error).
bool toml_has(const std::string& file, const std::string& section, const std::string& key) {
  try {
    const toml::table root = toml::parse_file(file);
    const toml::node_view<const toml::node> s = root[section];
    if (!s.is_table()) return false;
    return key.empty() || static_cast<bool>(s[key]);
  } catch (const toml::parse_error&) {
    return false;  // load_train_config reports it with its position
  }
}

// V4: how many of the main layers attend compressed entries, "21 CSA (top-512) + 20 HCA".
std::string describe_compressed_layers(const ModelConfig& mc) {
  int64_t csa = 0, hca = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l) {
    const int64_t r = mc.compress_ratio(l);
    csa += r == 4;
    hca += r > 0 && r != 4;
  }
  return fmt::format("{} CSA (top-{}) + {} HCA", csa, mc.index_topk, hca);
}

void run_plan(const PlanArgs& a, const std::vector<std::string>& extras) {
  MOE_CHECK(!a.config_file.empty(), "--config is required (a `moe train` or `moe finetune` TOML "
            "configuration; /dev/null for the defaults)");
  std::vector<ConfigOverride> overrides = parse_override_args(extras);
  if (!a.model.empty()) overrides.push_back({"model.preset", a.model});
  if (a.ep > 0) overrides.push_back({"parallel.ep", std::to_string(a.ep)});
  // A [lora] section (or a --lora.* key) makes it a fine-tuning configuration.
  bool finetune = a.finetune || toml_has(a.config_file, "lora", "");
  for (const ConfigOverride& o : overrides) finetune |= o.key.rfind("lora.", 0) == 0;
  // Planning needs no base weights: a preset stands in for them.
  if (finetune && !a.model.empty() && !has_override(overrides, "model.weights") &&
      !toml_has(a.config_file, "model", "weights"))
    overrides.push_back({"model.weights", a.model});
  const TrainConfig cfg = load_train_config(
      a.config_file, overrides, finetune ? ConfigPurpose::Finetune : ConfigPurpose::Pretrain);
  std::string note;
  const ModelConfig mc = resolve_plan_model(cfg, &note);
  const MemoryPlan plan = plan_training_memory(cfg, mc, a.ranks, 0, a.expert_load);

  const std::string model_name =
      !cfg.model.preset.empty() ? cfg.model.preset : cfg.model.weights;
  if (a.json) {
    nlohmann::json peak = nlohmann::json::object(), why = nlohmann::json::object();
    for (int c = 0; c < kMemCategoryCount; ++c) {
      const char* name = mem_category_name(static_cast<MemCategory>(c));
      peak[name] = plan.peak[static_cast<size_t>(c)];
      why[name] = plan.why[static_cast<size_t>(c)];
    }
    const nlohmann::json out = {{"model", model_name},
                                {"finetune", plan.finetune},
                                {"ranks", plan.world_size},
                                {"ep", plan.ep},
                                {"batch_per_rank", plan.batch_per_rank},
                                {"seq_len", plan.seq_len},
                                {"tokens_per_rank", plan.tokens_per_rank},
                                {"local_experts", plan.local_experts},
                                {"expert_rows_per_rank", plan.expert_rows_per_rank},
                                {"threads", plan.threads},
                                {"simd", plan.simd},
                                {"peak", peak},
                                {"total_peak", plan.total_peak()},
                                {"why", why}};
    fmt::print("{}\n", out.dump(2));
    return;
  }
  if (!note.empty()) fmt::print("note: {}\n", note);
  const std::string attention =
      mc.is_v4() ? fmt::format("attention heads {} x {}, window {}, compressed layers: {}, hc_mult "
                               "{}{}",
                               mc.num_attention_heads, mc.head_dim, mc.sliding_window,
                               describe_compressed_layers(mc), mc.hc_mult,
                               mc.num_nextn_predict_layers > 0 ? ", MTP" : "")
                 : fmt::format("MLA heads {}, q_lora_rank {}, kv_lora_rank {}",
                               mc.num_attention_heads, mc.q_lora_rank, mc.kv_lora_rank);
  const std::string title = fmt::format(
      "memory plan{}: {} ({} layers, hidden {}, vocab {}, {} routed experts top-{}, {})",
      plan.world_size > 1 ? " per rank" : "", model_name, mc.num_hidden_layers, mc.hidden_size,
      mc.vocab_size, mc.n_routed_experts, mc.num_experts_per_tok, attention);
  fmt::print("{}", format_memory_plan(plan, title));
  if (plan.ep > 1)
    fmt::print("routing assumed balanced: each rank's experts compute {} rows per MoE layer "
               "(--expert-load {:.2f}); a skewed router moves the MoE activations with it\n",
               plan.expert_rows_per_rank, plan.expert_load);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan", "predict the peak tracked memory of a `moe train` / `moe finetune` run of a TOML "
              "config, per category and per rank, without allocating it");
  auto args = std::make_shared<PlanArgs>();
  cmd->add_option("--config", args->config_file,
                  "TOML training or fine-tuning configuration (e.g. configs/finetune-small.toml; "
                  "/dev/null for the defaults)");
  cmd->add_flag("--finetune", args->finetune,
                "plan a LoRA fine-tune (implied by a [lora] section or a --lora.* key)");
  cmd->add_option("--ranks", args->ranks,
                  "ranks training together (mpirun -np W): each takes batch_size / W sequences")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--ep", args->ep,
                  "expert-parallel size (same as --parallel.ep): each rank holds E / ep experts")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--model", args->model,
                  "plan for this model instead of the config's: a preset (e.g. "
                  "deepseek-v3-671b), a config.json or a model directory (same as "
                  "--model.preset; a fine-tune needs no base weights then)");
  cmd->add_option("--expert-load", args->expert_load,
                  "under expert parallelism, plan for a rank whose experts receive this many "
                  "times their balanced share of rows (default 1: balanced routing)")
      ->check(CLI::Range(1.0, 1e6));
  cmd->add_flag("--json", args->json, "print the plan as JSON");
  cmd->allow_extras();
  cmd->callback([args, cmd] { run_plan(*args, cmd->remaining()); });
  cmd->footer(
      "Config overrides as for train/finetune: --section.key value, e.g. --data.batch_size 1 "
      "--data.seq_len 4096 --lora.r 8 --model.experts mxfp4. The workspace row is sized for the "
      "global --threads (given before `plan`). Example: moe --threads 32 plan --config "
      "configs/finetune-small.toml --model deepseek-v3-671b --model.experts mxfp4 "
      "--data.batch_size 8 --data.seq_len 4096 --ranks 8 --ep 8. Categories are MemoryTracker's "
      "(the `memory` records of metrics.jsonl and the run summary); the total is the sum of "
      "their peaks.");
}

}  // namespace moe::cli
