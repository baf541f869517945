#pragma once
// DeepSeek-V4's inference cache (SPEC §6.5, §6.6): what cached decoding needs of every layer and
// sequence slot, so a new token costs O(window + entries) per layer and nothing is recomputed:
//
//   window     the shared KV rows (kv_norm + RoPE, key and value at once) of the last
//              `sliding_window` positions, a ring: position p sits in row p mod window_rows;
//   entries    (ratio > 0) every completed compressed entry, [max_len / ratio, head_dim];
//   (both as the attention reads them: after the simulated FP8 of
//   quantization_simulation "reference", whose fp32 values the cache keeps rather than the
//   FP8 bytes, so cached logits stay those of a full recompute)
//   state      (ratio > 0) the compressor's per-token projections c = wkv·x and z = wgate·x of
//              the latest positions, a ring of ratio (HCA) or 2·ratio (CSA: a window also pools
//              the previous window's tokens) rows, from which the next entry is pooled once its
//              window completes;
//   indexer    (ratio 4) the same entries and state for the lightning indexer's own compressor
//              (its keys, index_head_dim wide).
//
// Why a ring and not every position: DeepSeek-V4-Flash keeps 43 layers x 512 floats of KV per
// token (88 KB), where the window ring is 128 rows per layer, 11 MB per sequence whatever its
// length; the compressed entries are what grows, 13.8 KB per token (fp32, as the V3 latent
// cache, so cached decoding computes the training forward's bits). The compressor state rings
// cost another 12 MB per sequence (the HCA layers' 128 rows of c and z).
//
// Rings have min(length, max_len) rows, so a short cache (an expert-parallel rank's one
// position) takes almost nothing. Everything is preallocated and zero-filled (every page
// resident from the start), charged to MemCategory::KvCache.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/inference_cache.h"

namespace moe {

// One compressor's part of the cache, for every slot (V4Compressor::forward_cached).
struct V4CompressorCache {
  float* entries = nullptr;     // [slots, max_entries, head_dim]
  float* kv_state = nullptr;    // [slots, state_rows, features]: c of position p in row p mod state_rows
  float* gate_state = nullptr;  // [slots, state_rows, features]: z, likewise
  int64_t max_entries = 0, state_rows = 0;
};

// One layer's part of the cache, for every slot.
struct V4LayerCache {
  int64_t ratio = 0;       // the layer's compress ratio (0: sliding window only)
  float* window = nullptr;  // [slots, window_rows, head_dim]: position p in row p mod window_rows
  int64_t window_rows = 0;
  V4CompressorCache compressor;  // ratio > 0
  V4CompressorCache indexer;     // ratio == 4
};

class V4KvCache : public InferenceCache {
 public:
  V4KvCache(const ModelConfig& cfg, int64_t slots, int64_t max_len);

  // What a cache of `slots` x `max_len` takes, exactly (bytes() of the one built).
  static int64_t bytes_for(const ModelConfig& cfg, int64_t slots, int64_t max_len);
  // For `moe info`: what grows with the sequence (the compressed entries, fp32, all layers:
  // head_dim / ratio floats per token, plus index_head_dim / 4 per CSA layer), and what a
  // sequence takes whatever its length (the window and compressor-state rings) once max_len
  // reaches sliding_window and every layer's ring length.
  static double entry_bytes_per_token(const ModelConfig& cfg);
  static int64_t ring_bytes_per_sequence(const ModelConfig& cfg);

  int64_t bytes() const override;
  // One view per layer, in layer order (DeepSeekV4Model::forward_cached); MTP has none.
  const std::vector<V4LayerCache>& layers() const { return layers_; }
  // Whether this cache was laid out for `cfg`'s layers (a cache of another V4 model is refused).
  bool fits(const ModelConfig& cfg) const;

 private:
  std::vector<Tensor> buffers_;
  std::vector<V4LayerCache> layers_;
  int64_t head_dim_ = 0, index_head_dim_ = 0, window_ = 0;
};

// Each chunk's first row in the forward's input (chunks follow each other in row order), after
// checking that they hold `rows` tokens in all; `who` names the caller in the error.
std::vector<int64_t> chunk_first_rows(std::span<const CachedChunk> chunks, int64_t rows,
                                      const std::string& who);

}  // namespace moe
