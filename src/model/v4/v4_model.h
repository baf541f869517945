#pragma once
// The DeepSeek-V4 model (SPEC §6, model_type "deepseek_v4"), forward and backward, block by
// block, with the released checkpoint's key names:
//
//   X = expand(embed(tokens)) to hc_mult streams                         [T, n, D]
//   per layer L (V4Block):
//     u = hc_attn.pre(X);  x = attn_norm(u)
//     ratio > 0: entries = compressor(x);  ratio 4 (CSA): picks = indexer(x, q_norm(wq_a x))
//     X = hc_attn.post(attention(x, entries, picks), X)
//     u = hc_ffn.pre(X);   X = hc_ffn.post(MoE(ffn_norm(u)), X)   (hash routing by the token ids
//                                                                 for L < num_hash_layers)
//   logits = head(norm(hc_head(X)))                                      (LMHeadLoss, fused CE)
//   MTP (num_nextn_predict_layers = 1, SPEC §6.8): ids = tokens shifted left by one per sequence
//     (0 in the last slot), Xm_i = e_proj(enorm(embed(ids))) + h_proj(hnorm(X_i)) over the main
//     model's final streams, one more block (compress_ratios[num_hidden_layers]; top-k routed
//     with gate.bias, as num_hash_layers <= num_hidden_layers), mtp.0.hc_head, mtp.0.norm, the
//     shared head; targets shifted the same way (-100 in the last slot).
//     loss = CE + mtp_loss_scale · CE_mtp (LossOptions; 0.1 = Automodel's default for depth 1).
//
// ModelConfig::quantization_simulation "reference" adds DeepSeek's reference forward's simulated
// FP8 / FP4 (model/v4/simulated_precision.h) at its sites in the attention, compressors and
// indexer, in training and cached inference alike; "none" (the default) is HF's / Automodel's V4.
//
// Gradients flow as the PyTorch reference's autograd does (tests/reference/deepseek_v4_ref.py):
// the compressors get theirs through the attention's d_entries; the indexer gets none (its picks
// are integers; its parameters are frozen: no gradient, no optimizer state); the embedding and
// the head collect both the main and the MTP contributions.
//
// Memory (MemCategory::Activations unless said): a block keeps what its parts document (the hc
// sites keep X by reference and their mixes; the norms keep their inputs, whose outputs the
// attention, compressor and MoE rebuild in backward instead of saving: SaveInput::No); the
// entries and picks live in the attention's saved state until its backward; routing state in
// MemCategory::Routing as in V3. Eval and Inference forwards keep nothing; backward() releases
// everything.
//
// Determinism: every part computes each value on one thread in a fixed order, and the model adds
// contributions in a fixed order (MTP first, then the main path), so the bits are the same for
// any thread count and SIMD target.
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layers.h"
#include "model/lm_head_loss.h"
#include "model/causal_lm.h"
#include "model/rope.h"
#include "model/v4/compressor.h"
#include "model/v4/hyper_connections.h"
#include "model/v4/indexer.h"
#include "model/v4/v4_attention.h"
#include "moe/dispatcher.h"
#include "moe/moe_layer.h"

namespace moe {

// The RoPE flavours of a V4 model (SPEC §6.5), one table each, shared by every layer using it:
// sliding-window layers rotate with rope_theta and no YaRN, compressed layers (their attention,
// compressor and indexer) with compress_rope_theta and YaRN always on, no mscale.
struct V4RopeTables {
  std::shared_ptr<RopeTable> window, compressed;
  static RopeParams window_params(const ModelConfig& cfg);
  static RopeParams compressed_params(const ModelConfig& cfg);
};

class V4Block {
 public:
  // prefix "layers.L." or "mtp.0."; `layer` indexes compress_ratios and decides hash routing
  // (layer < num_hash_layers).
  V4Block(const ModelConfig& cfg, int64_t layer, const std::string& prefix, Dispatcher& dispatcher,
          const V4RopeTables& ropes);
  // X [T, n, D] -> X' [T, n, D]; token_ids I32 [T] are what a hash layer routes by.
  Tensor forward(const Tensor& X, const Tensor& token_ids, const BatchShape& shape, Pass pass);
  // dX' -> dX; aux_grad_scale as MoELayer::backward.
  Tensor backward(const Tensor& dX, float aux_grad_scale);
  // Checkpoint order: hc_attn_{fn,base,scale}, attn_norm, attn.* (compressor, indexer), then
  // hc_ffn_*, ffn_norm, ffn.* (the order the forward uses them).
  void collect(ParamList& out);
  bool has_saved() const;

  int64_t ratio = 0;  // 0 sliding window only, 4 CSA, other HCA
  HyperConnectionSite hc_attn, hc_ffn;
  RMSNorm attn_norm, ffn_norm;
  V4Attention attn;
  std::unique_ptr<V4Compressor> compressor;  // ratio > 0
  std::unique_ptr<V4Indexer> indexer;        // ratio == 4
  MoELayer ffn;

 private:
  BatchShape saved_shape_;
};

class DeepSeekV4Model : public CausalLM {
 public:
  explicit DeepSeekV4Model(const ModelConfig& cfg,
                           std::shared_ptr<Dispatcher> dispatcher = nullptr);

  const ModelConfig& config() const override { return cfg_; }
  // Every parameter, in checkpoint order, with the released key names: embed.weight, the layers,
  // hc_head_{fn,base,scale}, norm.weight, head.weight, then mtp.0.{enorm,hnorm,e_proj,h_proj},
  // the MTP block, mtp.0.hc_head_*, mtp.0.norm. The hash tables (ffn.gate.tid2eid) and the
  // indexers are parameters that never train (trainable = false).
  const ParamList& params() const override { return params_; }
  ParamList trainable_params() const override;
  // Deterministic initialisation, each tensor drawn from a stream keyed by (seed, name); see
  // v4_model.cpp for the rule of each kind (the mHC parameters included).
  void init_weights(uint64_t seed) override;
  void allocate_grads() override;
  void zero_grads() override;

  // tokens, targets: I32 [batch*seq]. Pass::Train keeps what backward() needs. With MTP the
  // result's total() includes options.mtp_loss_scale · mtp_ce (Train and Eval alike).
  LossResult forward(const Tensor& tokens, const Tensor& targets, const BatchShape& shape,
                     Pass pass, const LossOptions& options = {}) override;
  void backward() override;
  Tensor logits(const Tensor& tokens, const BatchShape& shape) override {
    return logits(tokens, shape, nullptr);
  }
  // With `mtp_logits` and an MTP layer also the MTP head's [batch*seq, vocab] (row t predicts
  // token t + 2).
  Tensor logits(const Tensor& tokens, const BatchShape& shape, Tensor* mtp_logits);

  // Cached inference (v4_cached.cpp, model/v4/v4_cache.h).
  std::unique_ptr<InferenceCache> make_cache(int64_t slots, int64_t max_len) const override;
  Tensor forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                        InferenceCache& cache, bool all_rows = false) override;
  // Grows the RoPE tables to `positions` now.
  void reserve_positions(int64_t positions) override;

  // No base parameter trains (no gradient, no optimizer state; router biases stay put).
  void freeze_base() override;
  // LoRA over V4 (v4_lora.cpp): targets are the PEFT module names of Hugging Face's
  // deepseek_v4 model (SPEC §8.5).
  const ParamList& add_lora(const LoraSettings& settings, uint64_t seed,
                            const std::string& section = "lora") override;
  const ParamList& lora_params() const override { return lora_params_; }
  void drop_lora() override;
  LoraRuntime& lora_runtime() override { return *lora_runtime_; }

  std::vector<MoELayer*> moe_layers() const override;
  // Aux-loss-free balancing: call between backward and the optimizer step.
  void update_router_biases(double rate) override;
  bool has_saved() const override;

  bool has_mtp() const { return mtp_ != nullptr; }
  const std::vector<std::unique_ptr<V4Block>>& blocks() const { return blocks_; }
  V4Block* mtp_block() const { return mtp_ ? mtp_->block.get() : nullptr; }

 private:
  // The MTP module of depth 1 (keys mtp.0.*); its embedding shares the model's embed.weight
  // (value and gradient), refreshed before every use.
  struct Mtp {
    RMSNorm enorm, hnorm, norm;
    Linear e_proj, h_proj;
    std::unique_ptr<V4Block> block;
    HyperHead hc_head;
    Embedding embed;
  };

  // The final 4-stream state after the last block [T, n, D].
  Tensor streams(const Tensor& tokens, const BatchShape& shape, Pass pass);
  // The MTP block's output state from the main model's final state X.
  Tensor mtp_streams(const Tensor& X, const Tensor& ids, const BatchShape& shape, Pass pass);
  // dX of the main model's final state through the MTP input (and the embedding's gradient).
  Tensor mtp_backward(const Tensor& dXm);
  const Param& mxfp4_scales_of(size_t data_index) const;

  ModelConfig cfg_;
  std::shared_ptr<Dispatcher> dispatcher_;
  V4RopeTables ropes_;
  Embedding embed_;
  std::vector<std::unique_ptr<V4Block>> blocks_;
  HyperHead hc_head_;
  RMSNorm norm_;
  LMHeadLoss head_;
  std::unique_ptr<Mtp> mtp_;
  ParamList params_;
  ParamList lora_params_;
  // Behind a pointer: adapters keep its address.
  std::unique_ptr<LoraRuntime> lora_runtime_ = std::make_unique<LoraRuntime>();
  // From a Train forward to backward: the gradients of the normed hidden states the head saw
  // (main and MTP), which the fused head + loss forms in the forward.
  Tensor d_head_in_, d_mtp_head_in_;
  float last_aux_grad_scale_ = 1.0f;
};

// MTP inputs of depth 1 (SPEC §6.8), per sequence of `shape`: v shifted left by one with `fill`
// in the last slot (token ids: 0, targets: -100). I32 [T] (MemCategory::Activations).
Tensor shift_left(const Tensor& v, const BatchShape& shape, int32_t fill);

}  // namespace moe
