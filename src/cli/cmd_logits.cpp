// `moe logits`: the engine's fp32 logits for given token ids, so any external reference can be
// compared against it; --adapter adds a LoRA adapter (PEFT layout) unmerged, as `moe sample`, and
// --expert-activations int8 runs MXFP4 experts as `moe generate` can.
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/inference_options.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "io/token_file.h"
#include "lora/merge.h"
#include "model/causal_lm.h"

namespace moe::cli {

namespace {

struct LogitsArgs {
  std::string model_dir, tokens_file, out_file, adapter_dir;
  ExpertActivations expert_activations = ExpertActivations::Fp32;
};

void run_logits(const LogitsArgs& a) {
  ModelConfig cfg = read_hf_config(a.model_dir);
  if (!a.adapter_dir.empty()) {
    // The experts in the format the adapter was trained with (lora/merge.h).
    std::string note;
    cfg = config_for_adapter(cfg, a.adapter_dir, &note);
    if (!note.empty()) fmt::print(stderr, "{}\n", note);
  }
  check_expert_activations(cfg, a.expert_activations, a.model_dir);
  const TokenBatch batch = read_token_file(a.tokens_file);
  const std::unique_ptr<CausalLM> built = make_causal_lm(cfg);
  CausalLM& model = *built;
  model.set_expert_activations(a.expert_activations);
  load_weights(a.model_dir, model.params());
  if (!a.adapter_dir.empty()) {
    const AttachedAdapter adapter = attach_peft_adapter(a.adapter_dir, a.model_dir, model);
    if (!adapter.base_mismatch.empty())
      fmt::print(stderr, "warning: {}\n", adapter.base_mismatch);
  }
  Tensor logits = model.logits(batch.tokens, batch.shape)
                      .view({batch.shape.batch, batch.shape.seq, cfg.vocab_size});
  write_safetensors(a.out_file, {{"logits", logits}}, {{"format", "pt"}});
  fmt::print("wrote logits [{}, {}, {}] to {}\n", batch.shape.batch, batch.shape.seq,
             cfg.vocab_size, a.out_file);
}

}  // namespace

void add_logits_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "write the fp32 logits of a model for token ids");
  auto args = std::make_shared<LogitsArgs>();
  cmd->add_option("--model", args->model_dir, "model directory (config.json + safetensors)")
      ->required();
  cmd->add_option("--adapter", args->adapter_dir,
                  "LoRA adapter directory in PEFT layout (adapter_config.json + "
                  "adapter_model.safetensors), applied unmerged on top of --model");
  add_expert_activations_option(cmd, args->expert_activations);
  cmd->add_option("--tokens", args->tokens_file,
                  "text file: one sequence per line, token ids separated by spaces")
      ->required();
  cmd->add_option("--out", args->out_file, "output .safetensors (tensor 'logits' [batch, seq, vocab])")
      ->required();
  cmd->callback([args] { run_logits(*args); });
}

}  // namespace moe::cli
