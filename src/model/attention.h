#pragma once
// Multi-head latent attention (DeepSeek-V2/V3), forward and backward side by side (the layer
// convention of model/layers.h). Rows are sequence-major (row = b * seq + s); every sequence
// attends causally within itself, a row's position is s.
//
// The latent stages are kept as separate tensors so the inference path can cache exactly what
// the spec asks for: kv_a_layernorm(c_kv) [T, kv_lora_rank] and RoPE(k_pe) [T, rope] per token.
#include <memory>
#include <span>
#include <string>

#include "model/config.h"
#include "model/inference_cache.h"
#include "model/layers.h"
#include "model/param.h"
#include "model/rope.h"

namespace moe {

// One layer of the latent KV cache (model/latent_kv_cache.h): per sequence slot, max_len rows of
// kv_a_layernorm(c_kv) [kv_lora_rank] and RoPE(k_pe) [qk_rope_head_dim], slot-major.
struct LatentCacheLayer {
  float* latent = nullptr;  // [slots, max_len, kv_lora_rank]
  float* k_rope = nullptr;  // [slots, max_len, qk_rope_head_dim]
  int64_t max_len = 0;
};

class MLAttention {
 public:
  // prefix like "model.layers.3.self_attn."; parameters use the HF keys:
  // q_proj.weight (q_lora_rank == 0) or q_a_proj.weight, q_a_layernorm.weight, q_b_proj.weight;
  // kv_a_proj_with_mqa.weight, kv_a_layernorm.weight, kv_b_proj.weight, o_proj.weight.
  void init(const std::string& prefix, const ModelConfig& cfg);
  // Layers of one model may share one table (it only depends on the config); init gives each
  // layer its own until the model builder hands them a common one.
  void share_rope(std::shared_ptr<RopeTable> table) { rope_ = std::move(table); }
  const std::shared_ptr<RopeTable>& rope() const { return rope_; }

  // save_input = SaveInput::No: x is not kept (neither here nor by the query linear); the
  // caller rebuilds it bitwise and hands it to backward(dy, x).
  Tensor forward(const Tensor& x /*[T, hidden]*/, const BatchShape& shape, Pass pass,
                 SaveInput save_input = SaveInput::Yes);
  Tensor backward(const Tensor& dy);  // -> dx [T, hidden]
  // Inference with the latent cache: x [T, hidden] holds the chunks' new tokens; their
  // normalised c_kv and rotated k_pe are written to the cache, and each token attends to its
  // sequence's cached rows [0, position]. Per chunk, the cheaper of two exact forms runs (the
  // choice depends only on the chunk's own length and position, so a sequence gets the same
  // bits whatever is batched with it):
  //   absorbed (decode, short chunks): q_nope·W_kv_b folded into the latent space, scores and
  //     the value sum over the cached latents directly, W_kv_b's value rows applied last;
  //   expanded (long prefill chunks): k_nope and v rebuilt for the whole prefix through
  //     kv_b_proj, then the training forward's blocked causal attention.
  // Nothing is saved for backward. A LoRA adapter on kv_b_proj is folded in unmerged.
  Tensor forward_cached(const Tensor& x, std::span<const CachedChunk> chunks,
                        const LatentCacheLayer& cache);
  // Whether forward_cached runs the absorbed form for `count` new tokens after `past` cached.
  bool absorbed_for(int64_t count, int64_t past) const;
  Tensor backward(const Tensor& dy, const Tensor& x);
  void collect(ParamList& out);
  bool has_saved() const { return saved_stats_.defined(); }

  // Linears and norms; kv_a_proj_with_mqa is a bare Param because its output is produced
  // directly as the two separate tensors c_kv and k_pe (two GEMMs on its row blocks).
  Linear q_proj, q_a_proj, q_b_proj;
  RMSNorm q_a_layernorm;
  Param kv_a_proj;
  // kv_a_proj_with_mqa's LoRA adapter, applied to both row blocks of its output.
  std::unique_ptr<LoraAdapter> kv_a_lora;
  RMSNorm kv_a_layernorm;
  Linear kv_b_proj, o_proj;

  int64_t hidden = 0, heads = 0, q_lora_rank = 0, kv_lora_rank = 0;
  int64_t nope = 0, rope_dim = 0, v_dim = 0;
  float softmax_scale = 1.0f;

 private:
  int64_t qk_dim() const { return nope + rope_dim; }
  // RoPE'd [T, H*(nope+rope)]; the first linear saves x only when save_input says so.
  Tensor query(const Tensor& x, const Tensor& positions, Pass pass, SaveInput save_input);
  Tensor query_backward(const Tensor& dq, const Tensor& x);  // dx from the query path
  // c_kv [T, kv_lora_rank] (before its norm) and RoPE(k_pe) [T, rope] from x, adapter included.
  void latent_kv(const Tensor& x, const Tensor& positions, Tensor& c_kv, Tensor& k_pe) const;
  void attention_core(const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Tensor& out,
                      const Tensor& stats, const BatchShape& shape) const;
  void cached_expanded(const Tensor& q, const CachedChunk& chunk, int64_t row0,
                       const LatentCacheLayer& cache, const Tensor& out);
  void cached_absorbed(const Tensor& q, std::span<const CachedChunk> chunks,
                       std::span<const int64_t> rows0, const LatentCacheLayer& cache,
                       const Tensor& out) const;

  std::shared_ptr<RopeTable> rope_;

  // Saved by a Train forward (besides what the linears and norms keep for themselves).
  // Not saved, because backward rebuilds them bitwise from what is:
  //   P [B, H, S, S]  flash-style, per query block from q, k and the row stats below: one more
  //                   q·kᵀ GEMM (~1% of a small-model step) instead of H·S floats per token,
  //                   the largest activation of a training step.
  //   kv_a_layernorm(c_kv) and kv [T, H, nope+v]: the norm from its saved input (elementwise),
  //                   then kv_b_proj (one T x kv_lora_rank x H·(nope+v) GEMM, ~1%), instead of
  //                   kv_lora_rank + H·(nope+v) floats per token.
  // q stays saved: rebuilding it (q_proj, or q_b_proj after q_a_layernorm, plus RoPE) would
  // cost ~2-2.5% of a step for H·(nope+rope) floats per token (measured on `small`).
  BatchShape saved_shape_;
  Tensor saved_x_;          // input of kv_a_proj (shared with the query linear), SaveInput::Yes
  Tensor saved_positions_;  // I32 [T]
  Tensor saved_q_;          // [T, H, nope+rope], q_pe rotated
  Tensor saved_k_pe_;       // [T, rope], rotated
  Tensor saved_stats_;      // [B, H, S, 2]: per query row, the score max and 1/Σexp(s − max)
};

}  // namespace moe
