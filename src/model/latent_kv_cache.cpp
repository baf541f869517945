#include "model/latent_kv_cache.h"

#include "core/error.h"

namespace moe {

int64_t LatentKvCache::bytes_per_token(const ModelConfig& cfg) {
  return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) *
         static_cast<int64_t>(sizeof(float));
}

LatentKvCache::LatentKvCache(const ModelConfig& cfg, int64_t slots, int64_t max_len)
    : InferenceCache(slots, max_len) {
  // Refuse sizes whose byte count would overflow before asking the allocator for them.
  const int64_t per_token = bytes_per_token(cfg);
  MOE_CHECK(per_token > 0 && slots <= (int64_t{1} << 40) / max_len / per_token,
            "KV cache: {} sequences x {} tokens x {} bytes per token is too large", slots,
            max_len, per_token);
  const int64_t rows = slots * max_len;
  // Zeroed, so every page is resident from the start: the cache's memory is taken when the
  // engine starts, not page by page as sequences grow (which would look like a leak in RSS).
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    latent_.push_back(Tensor::zeros({rows, cfg.kv_lora_rank}, DType::F32, MemCategory::KvCache));
    k_rope_.push_back(
        Tensor::zeros({rows, cfg.qk_rope_head_dim}, DType::F32, MemCategory::KvCache));
    views_.push_back({latent_.back().f32(), k_rope_.back().f32(), max_len});
  }
}

int64_t LatentKvCache::bytes() const {
  int64_t b = 0;
  for (const Tensor& t : latent_) b += t.nbytes();
  for (const Tensor& t : k_rope_) b += t.nbytes();
  return b;
}

}  // namespace moe
