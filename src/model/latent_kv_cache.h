#pragma once
// The MLA latent KV cache (SPEC §1 "MLA", issue 12): per layer and token only what DeepSeek's
// reference caches, kv_a_layernorm(c_kv) [kv_lora_rank] and RoPE(k_pe) [qk_rope_head_dim], in
// fp32 so cached decoding computes the same numbers as a full recompute.
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/attention.h"
#include "model/config.h"
#include "model/inference_cache.h"

namespace moe {

class LatentKvCache : public InferenceCache {
 public:
  LatentKvCache(const ModelConfig& cfg, int64_t slots, int64_t max_len);

  // Bytes one token takes over all layers (what `moe info` prints).
  static int64_t bytes_per_token(const ModelConfig& cfg);

  int64_t bytes() const override;
  // One view per layer, in layer order (DeepSeekModel::forward_cached).
  const std::vector<LatentCacheLayer>& layers() const { return views_; }

 private:
  std::vector<Tensor> latent_, k_rope_;
  std::vector<LatentCacheLayer> views_;
};

}  // namespace moe
