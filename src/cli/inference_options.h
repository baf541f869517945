#pragma once
// What `moe generate` and `moe serve` share: the model options, the engine's batching options,
// the sampling defaults, and opening the model on every rank of an expert-parallel group.
#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>

#include "infer/generation.h"
#include "infer/inference_model.h"

namespace moe::cli {

struct InferenceArgs {
  std::string model_dir;
  std::string adapter_dir;
  int64_t ep = 0;  // 0: the number of ranks
  ExpertActivations expert_activations = ExpertActivations::Fp32;
  EngineOptions engine;
};

void add_inference_options(CLI::App* cmd, InferenceArgs& args);
// --expert-activations fp32|int8 (also `moe logits`).
void add_expert_activations_option(CLI::App* cmd, ExpertActivations& activations);
void add_sampling_options(CLI::App* cmd, SamplingOptions& sampling);

struct InferenceSession {
  InferenceModel model;
  std::unique_ptr<GenerationEngine> engine;
  int ep_size = 1;
};

// Loads the model on every rank (each rank only its experts under mpirun). On rank 0 returns
// the session; on the other ranks serves their experts to rank 0's forwards until rank 0's
// engine shuts down, then returns nullopt. Prints the model's notes (adapter warnings) on rank 0.
std::optional<InferenceSession> open_inference(const InferenceArgs& args);

}  // namespace moe::cli
