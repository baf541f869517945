#pragma once
// What a model keeps per sequence between cached inference forwards (src/infer), behind one
// interface so the generation engine serves every model family: DeepSeek-V3's MLA latents
// (model/latent_kv_cache.h), DeepSeek-V4's window, compressed entries and compressor state
// (model/v4/v4_cache.h). A cache is preallocated for `slots` sequences of up to `max_len`
// positions each and charged to MemCategory::KvCache, so serving never allocates cache memory
// per request and its size is known up front. The model that made a cache (CausalLM::make_cache)
// is the only one that reads or writes its contents.
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"

namespace moe {

// `count` new tokens of the sequence in cache slot `slot`, at positions [past, past + count):
// the next `count` rows of a cached forward's input (chunks follow each other in row order).
struct CachedChunk {
  int64_t slot = 0;
  int64_t past = 0;
  int64_t count = 0;
};

// The rows of a cached forward's activations x [T, ...] that end a non-empty chunk (the rows
// whose logits are sampled), in chunk order, as a new Activations tensor [chunks', ...].
Tensor last_rows_of_chunks(const Tensor& x, std::span<const CachedChunk> chunks);

class InferenceCache {
 public:
  InferenceCache(int64_t slots, int64_t max_len);
  virtual ~InferenceCache() = default;
  InferenceCache(const InferenceCache&) = delete;
  InferenceCache& operator=(const InferenceCache&) = delete;

  int64_t slots() const { return slots_; }
  int64_t max_len() const { return max_len_; }
  virtual int64_t bytes() const = 0;

  // A free slot (the lowest), or -1 when all are taken. A slot's rows are overwritten by the
  // next sequence, never cleared: a sequence only reads the rows it wrote.
  int64_t acquire();
  void release(int64_t slot);
  int64_t free_slots() const;

 private:
  int64_t slots_ = 0, max_len_ = 0;
  std::vector<bool> taken_;
};

}  // namespace moe
