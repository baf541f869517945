#pragma once
// Continuous batching over the latent KV cache (issue 12): requests arrive at any time, each
// step() runs one cached forward over every active sequence (prompt chunks and single decode
// tokens side by side), samples the sequences that reached their next token, and streams text to
// each request's sink. A sequence's bits never depend on what it is batched with: every matmul
// row is independent of the others (kernels/gemm.h), prompts are cut into chunks at fixed
// offsets (multiples of prefill_chunk), and each request samples from its own generator.
//
// Threads: submit() and cancel() may be called from any thread; step() from one thread only
// (the one that owns MPI under expert parallelism), which is also where sinks are called. Sinks
// must be quick and must not block.
//
// Expert parallelism: with an EP group of N ranks, rank 0 runs the engine and the other ranks
// run serve_experts(); before each forward rank 0 tells them to join it (one all-reduce of one
// integer), so every MoE layer's dispatch/combine is one collective over the group, ranks
// without rows taking part with zero rows. shutdown() releases them.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/tokenizer.h"
#include "infer/sampling.h"
#include "infer/text_stream.h"
#include "model/causal_lm.h"
#include "parallel/communicator.h"

namespace moe {

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids, BOS and chat template already applied
  int64_t max_tokens = 256;
  SamplingOptions sampling;
  uint64_t seed = 0;
  std::vector<std::string> stop;  // stop strings: generation ends before them
  // Ids that end generation (end of text, end of turn); their text is not emitted.
  std::vector<int32_t> stop_ids;
};

// "stop": a stop id or string; "length": max_tokens or the context is full; "cancelled".
enum class FinishReason { Stop, Length, Cancelled };
const char* finish_reason_name(FinishReason reason);

struct GenerationUpdate {
  int64_t request = 0;
  std::string text;  // text released since the last update (complete UTF-8, may be empty)
  bool finished = false;
  FinishReason reason = FinishReason::Stop;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // With the final update: every generated id, a stop id excluded (what the text decodes).
  std::vector<int32_t> completion_ids;
};
using UpdateSink = std::function<void(const GenerationUpdate&)>;

struct EngineOptions {
  int64_t max_sequences = 8;     // KV-cache slots: sequences decoded together
  int64_t context = 0;           // positions per sequence, prompt included (0: default_context)
  int64_t prefill_chunk = 256;   // prompt tokens one sequence processes per step
  int64_t max_step_tokens = 512; // rows of one forward (>= prefill_chunk + max_sequences - 1)
  int64_t max_queued = 64;       // waiting requests beyond which submit() refuses
};

// The context a sequence gets unless told otherwise: the model's max_position_embeddings, at
// most 4,096 (a released DeepSeek-V3 would otherwise preallocate 160K positions per slot).
int64_t default_context(const ModelConfig& cfg);

struct EngineStats {
  int64_t prompt_tokens = 0, generated_tokens = 0, steps = 0, requests_finished = 0;
  // A step's time is split between prompt and generation in proportion to its rows of each.
  double prompt_seconds = 0, generate_seconds = 0;
};

class GenerationEngine {
 public:
  // The model must outlive the engine. `ep_group`: the expert-parallel group this rank (0)
  // leads, or null for one process.
  GenerationEngine(CausalLM& model, const Tokenizer& tokenizer, EngineOptions options,
                   std::shared_ptr<Communicator> ep_group = nullptr);
  ~GenerationEngine();

  // Queues a request; returns its id, or -1 when max_queued requests are already waiting.
  // moe::Error for an empty prompt, a prompt that leaves no room in the context, max_tokens < 1
  // or invalid sampling options.
  int64_t submit(GenerationRequest request, UpdateSink sink);
  // The request ends at the next step with FinishReason::Cancelled (a no-op once finished).
  void cancel(int64_t id);

  // One forward over every active sequence, after admitting waiting requests into free slots.
  // Returns false when there was nothing to run.
  bool step();
  // Steps until no request is waiting or active.
  void run_until_idle();
  // Blocks until a request or cancellation arrives, or the timeout passes.
  void wait_for_work(std::chrono::milliseconds timeout);
  bool idle() const;
  int64_t active() const;
  int64_t queued() const;

  // Under expert parallelism: tells the other ranks to stop serving (idempotent).
  void shutdown();

  const EngineOptions& options() const { return options_; }
  EngineStats stats() const;
  const InferenceCache& cache() const { return *cache_; }

 private:
  struct Sequence;
  void drain_incoming();
  void finish(Sequence& s, FinishReason reason, std::string text);

  CausalLM& model_;
  const Tokenizer& tokenizer_;
  EngineOptions options_;
  std::shared_ptr<Communicator> ep_group_;
  std::unique_ptr<InferenceCache> cache_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Sequence>> incoming_;
  std::vector<int64_t> cancels_;
  int64_t next_id_ = 1;

  std::deque<std::unique_ptr<Sequence>> waiting_;  // engine thread only
  std::vector<std::unique_ptr<Sequence>> active_;
  EngineStats stats_;
  bool shut_down_ = false;
  bool in_forward_ = false;  // a forward started and has not returned (it threw)
};

// The loop of an expert-parallel rank other than 0: joins every forward rank 0 runs (with no rows
// of its own) until rank 0's engine shuts down. `after_forward(n)` runs after the n-th forward
// (tests take memory readings there).
void serve_experts(CausalLM& model, Communicator& ep_group,
                   const std::function<void(int64_t)>& after_forward = {});

}  // namespace moe
