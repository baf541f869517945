#pragma once
// The DeepSeek-V3 family: embedding -> blocks (MLA attention + dense or MoE FFN) -> final norm
// -> untied LM head fused with the loss. Forward and backward are explicit, block by block.
#include <memory>
#include <optional>
#include <vector>

#include "model/attention.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "model/layers.h"
#include "model/latent_kv_cache.h"
#include "model/lm_head_loss.h"
#include "moe/dispatcher.h"
#include "moe/moe_layer.h"

namespace moe {

class Block {
 public:
  Block(const ModelConfig& cfg, int64_t layer, Dispatcher& dispatcher);
  Tensor forward(const Tensor& x, const BatchShape& shape, Pass pass);
  Tensor backward(const Tensor& dy, float aux_grad_scale);
  // Inference with the latent KV cache (MLAttention::forward_cached); nothing is saved.
  Tensor forward_cached(const Tensor& x, std::span<const CachedChunk> chunks,
                        const LatentCacheLayer& cache);
  void collect(ParamList& out);
  bool has_saved() const;

  RMSNorm input_norm, post_attention_norm;
  MLAttention attention;
  std::unique_ptr<SwiGLU> mlp;     // first_k_dense_replace layers
  std::unique_ptr<MoELayer> moe;   // the rest
};

class DeepSeekModel : public CausalLM {
 public:
  explicit DeepSeekModel(const ModelConfig& cfg, std::shared_ptr<Dispatcher> dispatcher = nullptr);

  const ModelConfig& config() const override { return cfg_; }
  // HF key names (model.layers.L.self_attn.q_a_proj.weight, ...).
  const ParamList& params() const override { return params_; }
  ParamList trainable_params() const override;
  void init_weights(uint64_t seed) override;
  void allocate_grads() override;
  void zero_grads() override;

  LossResult forward(const Tensor& tokens, const Tensor& targets, const BatchShape& shape,
                     Pass pass, const LossOptions& options = {}) override;
  void backward() override;
  Tensor logits(const Tensor& tokens, const BatchShape& shape) override;

  // The MLA latent cache (model/latent_kv_cache.h).
  std::unique_ptr<InferenceCache> make_cache(int64_t slots, int64_t max_len) const override;
  Tensor forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                        InferenceCache& cache, bool all_rows = false) override;
  // The same over the latent cache's per-layer views (`cache` has one entry per layer).
  Tensor forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                        std::span<const LatentCacheLayer> cache, bool all_rows = false);
  void reserve_positions(int64_t positions) override;

  void freeze_base() override;
  const ParamList& add_lora(const LoraSettings& settings, uint64_t seed,
                            const std::string& section = "lora") override;
  const ParamList& lora_params() const override { return lora_params_; }
  void drop_lora() override;
  LoraRuntime& lora_runtime() override { return *lora_runtime_; }

  std::vector<MoELayer*> moe_layers() const override;
  void update_router_biases(double rate) override;
  bool has_saved() const override;

 private:
  Tensor hidden_states(const Tensor& tokens, const BatchShape& shape, Pass pass);
  const Param& mxfp4_scales_of(size_t data_index) const;

  ModelConfig cfg_;
  std::shared_ptr<Dispatcher> dispatcher_;
  Embedding embed_;
  std::vector<std::unique_ptr<Block>> blocks_;
  RMSNorm final_norm_;
  LMHeadLoss head_;
  ParamList params_;
  ParamList lora_params_;
  // Behind a pointer: adapters keep its address.
  std::unique_ptr<LoraRuntime> lora_runtime_ = std::make_unique<LoraRuntime>();
  float last_aux_grad_scale_ = 1.0f;
};

}  // namespace moe
