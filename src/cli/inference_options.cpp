#include "cli/inference_options.h"

#include <fmt/format.h>

#include <string>

#include "core/error.h"
#include "io/hf_config.h"
#include "parallel/ep_training.h"

namespace moe::cli {

void add_inference_options(CLI::App* cmd, InferenceArgs& a) {
  cmd->add_option("--model", a.model_dir,
                  "model directory: a checkpoint (runs/X/checkpoints/step_N) or a released "
                  "model (config.json + safetensors + tokenizer.json)")
      ->required();
  cmd->add_option("--adapter", a.adapter_dir,
                  "LoRA adapter directory in PEFT layout (a `moe finetune` checkpoint), applied "
                  "unmerged on top of --model; the tokenizer still comes from --model");
  cmd->add_option("--ep", a.ep, "expert-parallel size under mpirun (0: the number of ranks); "
                  "rank 0 runs the requests, every rank holds 1/ep of the routed experts")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  add_expert_activations_option(cmd, a.expert_activations);
  cmd->add_option("--slots", a.engine.max_sequences,
                  "sequences decoded together (KV-cache slots, preallocated)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--context", a.engine.context,
                  "tokens per sequence, prompt included (0: max_position_embeddings, at most 4096)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--prefill-chunk", a.engine.prefill_chunk,
                  "prompt tokens per sequence per forward")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--step-tokens", a.engine.max_step_tokens,
                  "most token rows in one forward (prompt chunks + decode tokens)")
      ->check(CLI::PositiveNumber)->capture_default_str();
}

void add_expert_activations_option(CLI::App* cmd, ExpertActivations& activations) {
  cmd->add_option_function<std::string>(
         "--expert-activations",
         [&activations](const std::string& name) {
           activations = name == "int8" ? ExpertActivations::Int8 : ExpertActivations::Fp32;
         },
         "routed experts' forward: fp32 (the exact product) or int8 (MXFP4 experts only: "
         "activations rounded to int8 per 32 elements, at most half a step each; faster decode, "
         "error bound in README \"Frozen MXFP4 experts\")")
      ->check(CLI::IsMember({"fp32", "int8"}))
      ->default_str("fp32");
}

void add_sampling_options(CLI::App* cmd, SamplingOptions& s) {
  cmd->add_option("--temperature", s.temperature, "0 = greedy")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--top-k", s.top_k, "sample among the k likeliest tokens (0 = all)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--top-p", s.top_p, "nucleus sampling mass")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  cmd->add_option("--min-p", s.min_p,
                  "drop tokens less likely than min-p times the likeliest (0 = off)")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  cmd->add_option("--repetition-penalty", s.repetition_penalty,
                  "divide positive logits (multiply negative ones) of tokens already in the "
                  "text by this (1 = off)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--presence-penalty", s.presence_penalty,
                  "subtract from the logit of every token already in the text (OpenAI's)")
      ->check(CLI::Range(-2.0, 2.0))->capture_default_str();
  cmd->add_option("--frequency-penalty", s.frequency_penalty,
                  "subtract this times a token's count in the text from its logit (OpenAI's)")
      ->check(CLI::Range(-2.0, 2.0))->capture_default_str();
}

std::optional<InferenceSession> open_inference(const InferenceArgs& a) {
  std::shared_ptr<Communicator> world = make_world_communicator();
  const int64_t ep = a.ep > 0 ? a.ep : world->size();
  MOE_CHECK(ep == world->size(),
            "--ep {}: serving splits one model over all {} ranks (--ep must equal the number of "
            "ranks)", ep, world->size());
  // The expert count decides whether the split is possible: read it before loading anything.
  const ModelConfig cfg = read_hf_config(a.model_dir);
  const ExpertParallelGroups groups =
      make_expert_parallel_groups(world, ep, cfg.n_routed_experts, "--ep");
  InferenceModel m = load_inference_model(a.model_dir, a.adapter_dir, make_dispatcher(groups),
                                          a.expert_activations);
  if (world->rank() != 0) {
    serve_experts(*m.model, *groups.ep_group);
    return std::nullopt;
  }
  for (const std::string& note : m.notes) fmt::print(stderr, "{}\n", note);
  InferenceSession s;
  s.ep_size = static_cast<int>(ep);
  s.engine = std::make_unique<GenerationEngine>(*m.model, *m.tokenizer, a.engine,
                                                groups.ep_group);
  s.model = std::move(m);
  return s;
}

}  // namespace moe::cli
