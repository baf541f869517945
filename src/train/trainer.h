#pragma once
// The pretraining loop: data -> micro-batches -> forward/backward -> clip -> router-bias
// balancing -> AdamW, with validation, checkpoints, metrics and bitwise-exact resume.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/checkpoint_state.h"
#include "train/train_config.h"

namespace moe {

class Communicator;
class CausalLM;

// Test seams; all optional.
struct TrainHooks {
  // Before the forward of step `step` (0-based), e.g. to poison a weight.
  std::function<void(int64_t step, CausalLM& model)> before_step;
  // Asked after step `steps_done` finished (metrics and checkpoint written); true ends the run
  // there, like an interruption.
  std::function<bool(int64_t steps_done)> stop_after;
  CheckpointFileHook checkpoint_file;
};

struct TrainResult {
  int64_t first_step = 0;         // steps done before this run (a resume's starting point)
  int64_t steps_done = 0;         // after this run
  int64_t skipped = 0;            // non-finite steps skipped in this run
  std::vector<double> losses;     // training loss of each step this run took
  double final_train_loss = 0;    // mean over the last few steps
  double final_val_loss = 0;      // NaN without a validation split
  double unigram_entropy = 0;     // of the training tokens, nats
  int64_t tokens_seen = 0;        // over the whole run, resumes included
  double seconds = 0;             // this process
  std::filesystem::path last_checkpoint;
  bool stopped_early = false;
  bool interrupted = false;       // by Ctrl-C / SIGTERM (after a checkpoint of the last step)
};

struct TrainRequest {
  TrainConfig config;
  // Resume from this checkpoint directory (nullopt: a fresh run, which refuses an out dir that
  // already holds checkpoints).
  std::optional<std::filesystem::path> resume_from;
  TrainHooks hooks;
  // The ranks training together (every rank calls train() with the same request); nullptr: this
  // process alone. parallel.ep splits them into expert-parallel groups. Rank 0 prints, writes
  // the metrics and the report; checkpoints are written by several ranks (see
  // CheckpointWriters), so the ranks must share the file system.
  std::shared_ptr<Communicator> world;
};

TrainResult train(const TrainRequest& request);

}  // namespace moe
