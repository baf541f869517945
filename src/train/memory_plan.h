#pragma once
// `moe plan`: the tracked memory (MemoryTracker, core/memory.h) a training or LoRA fine-tuning
// run of a configuration will peak at, per category and per rank, without building the model.
//
// How: the static categories are counted from the shapes the model allocates (weights by format:
// fp32 or MXFP4-packed routed experts; gradients and AdamW moments of what trains; adapters,
// their gradients and moments). The step-time categories (activations, routing, scratch) come
// from a replay of one training micro-batch: every tensor the model's forward and backward
// allocate and free (DeepSeekModel: model/*.h; DeepSeekV4Model: model/v4/*.h, its mHC sites,
// compressors, CSA indexer, MTP module and the RoPE tables its first step grows; both: moe/*.h,
// lora/lora_adapter.h: what each layer saves for backward and its backward transients), in the
// engine's order, with the engine's sizes, recorded into a ledger whose per-category peaks are
// what MemoryTracker reports (train/memory_replay.h). Workspace (the kernels' per-thread packing
// buffers, kernels/kernel_scratch.h) is the largest buffer each thread's matmuls ask for, from
// the same replay's matmul shapes.
//
// Everything but the workspace is exact for a single process (tests/test_memory_plan.cpp checks
// real runs of the debug, small, debug-v4 and small-v4 presets: byte for byte today, and the
// total to 5%); the
// workspace is an upper bound (every thread sized for the largest matmul it may run). Under
// expert parallelism the rows a rank's experts compute depend on the routing: the plan assumes
// balanced routing (tokens_per_rank·k rows per MoE layer) unless told a load factor, and is
// exact given the rows (checked under mpirun with a router that sends every token to rank 0).
// The peaks are those of training steps; validation forwards keep far less.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/memory.h"
#include "model/config.h"
#include "train/train_config.h"

namespace moe {

inline constexpr int kMemCategoryCount = static_cast<int>(MemCategory::Count);

struct MemoryPlanLine {
  MemCategory category;
  std::string what;
  int64_t bytes = 0;
};

struct MemoryPlan {
  // The run planned (per rank where it differs).
  bool finetune = false;
  int world_size = 1;
  int64_t ep = 1;
  int64_t batch_per_rank = 0;  // sequences per micro-batch on each rank
  int64_t seq_len = 0;
  int64_t tokens_per_rank = 0;
  int64_t routed_experts = 0, local_experts = 0;
  int64_t expert_rows_per_rank = 0;  // rows the local experts compute per MoE layer
  double expert_load = 1.0;          // those rows over the balanced share (EP > 1)
  int threads = 1;
  std::string expert_format;  // "fp32" | "mxfp4"
  std::string simd;           // kernel target the workspace was sized for
  int64_t lora_r = 0, lora_expert_r = 0;
  int64_t adapter_params = 0;  // on this rank
  int64_t trainable_params = 0;  // base parameters that train (pretraining)

  // Predicted peak bytes of each MemoryTracker category on one rank, and one line saying where
  // it comes from.
  std::array<int64_t, kMemCategoryCount> peak{};
  std::array<std::string, kMemCategoryCount> why;
  // What makes up the static categories (weights by format, adapters, ...).
  std::vector<MemoryPlanLine> lines;

  int64_t operator[](MemCategory c) const { return peak[static_cast<size_t>(c)]; }
  // The sum of the category peaks: MemSnapshot::total_peak, what a run's summary prints.
  int64_t total_peak() const;
};

// The plan of `cfg` (cfg.finetune: LoRA on a frozen base; else pretraining) on model `model`
// (the configuration the trainer builds: resolve_train_model) over `world_size` ranks at
// expert-parallel size cfg.parallel.ep, with `threads` kernel threads per rank (0: this
// process's num_threads()). Errors name the key (batch not divisible by the ranks, ep not
// dividing them or the experts, LoRA targets matching nothing).
// `expert_load` >= 1 plans for a rank whose experts receive that many times their balanced
// share of rows (expert parallelism only: with all experts local the rows are always tokens·k).
MemoryPlan plan_training_memory(const TrainConfig& cfg, const ModelConfig& model,
                                int world_size = 1, int threads = 0, double expert_load = 1.0);

// The model configuration a run of `cfg` would build, without reading any weights or data:
// model.preset if given, else (fine-tuning) the config.json of model.weights; the vocabulary
// of a pretraining run comes from data.tokenizer (byte: 264 ids; a tokenizer.json, if it
// exists; else the preset's). `note` (optional) receives a line about any guess made.
ModelConfig resolve_plan_model(const TrainConfig& cfg, std::string* note = nullptr);

// A table: one row per category (bytes, share of the total, explanation), the total, and the
// composition of the static categories; "per rank" when the plan spans several ranks.
std::string format_memory_plan(const MemoryPlan& plan, const std::string& title);

}  // namespace moe
