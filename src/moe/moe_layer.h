#pragma once
// The DeepSeek MoE FFN: router -> dispatch -> grouped SwiGLU experts -> combine, plus the
// shared experts (SPEC §2 "MoE layer", §3). Dropless: every (token, slot) is computed.
//
// Forward per routed row r (token t, slot j, weight w = weights[t, j]):
//   g, u = x_t·W_gateᵀ, x_t·W_upᵀ;  h = silu(g)·u;  o_r = W_down·(w·h)
// (with swiglu_limit L > 0, DeepSeek-V4: h = silu(min(g, L))·clamp(u, -L, L), in the routed and
// the shared experts alike; the saved g and u are the unclamped values, which is what tells
// backward where the clamp was active)
//   y_t = Σ_j o_{row(t,j)} (j ascending, fp32) + Shared(x_t)
// The routing weight scales h before the down projection (mathematically the reference's
// w·Expert(x)); the dispatcher then stays a pure permutation + sum whose backward is its own
// transpose, and dw = <dh_scaled, h> is a dot over the expert width that needs no saved
// expert output.
//
// Saved for backward (Train only): x (unless the caller rebuilds it: SaveInput::No), router scores/ids/weights, g and u, the per-row weights,
// the aux-loss f, and the dispatch Handle (MemCategory::Routing). Not saved: h (recomputed from
// g and u), and, when the dispatcher can (Dispatcher::can_regather_rows), the dispatched rows: backward re-gathers them from x
// through the Handle (one row copy instead of k·dim floats per token held all step); other
// dispatchers keep them for trainable experts, and re-fetch them (one more exchange) for
// routed-expert LoRA adapters on frozen experts. Backward releases all of it.
#include <memory>
#include <string>
#include <vector>

#include "lora/lora_adapter.h"
#include "model/config.h"
#include "model/layers.h"
#include "model/param.h"
#include "moe/dispatcher.h"
#include "moe/expert_weights.h"
#include "moe/router.h"

namespace moe {

class Mxfp4ExpertWeights;

class MoELayer {
 public:
  // prefix like "model.layers.3.mlp."; keys gate.weight [E, dim], gate.e_score_correction_bias
  // [E] (not trainable, no decay: moved by update_bias only), experts.M.{gate,up,down}_proj.weight
  // for the dispatcher's local experts, shared_experts.{...}.weight when n_shared_experts > 0.
  // selection = Hash (DeepSeek-V4's first num_hash_layers layers): the experts of a token come
  // from the table gate.tid2eid [vocab_size, k] (a frozen Param holding integer ids in fp32, no
  // gradient, no decay), there is no bias (gate.e_score_correction_bias is neither used nor
  // collected), and forward needs the rows' token ids.
  // keys = FfnKeys::V4: DeepSeek-V4's released names instead (prefix like "layers.3.ffn."):
  // gate.bias for the correction bias, experts.M.w{1,3,2}.weight and shared_experts.w{1,3,2}
  // .weight for gate / up / down.
  void init(const std::string& prefix, const ModelConfig& cfg, Dispatcher& dispatcher,
            ExpertSelection selection = ExpertSelection::TopK, FfnKeys keys = FfnKeys::Hf);
  // x [T, dim] with T = shape.tokens().
  // save_input = SaveInput::No: x is kept neither here nor by the shared experts; the caller
  // rebuilds it bitwise and hands it to backward(dy, x, ...).
  Tensor forward(const Tensor& x, const BatchShape& shape, Pass pass,
                 SaveInput save_input = SaveInput::Yes);
  // The same with the token id of every row (I32 [T]), which a hash layer routes by (a top-k
  // layer ignores them). Backward does not need them: the routing it differentiates is saved.
  Tensor forward(const Tensor& x, const Tensor& token_ids, const BatchShape& shape, Pass pass,
                 SaveInput save_input = SaveInput::Yes);
  // aux_grad_scale = d(total loss)/d(aux loss) (1 normally; 1/n for gradient accumulation).
  Tensor backward(const Tensor& dy, float aux_grad_scale = 1.0f);
  Tensor backward(const Tensor& dy, const Tensor& x, float aux_grad_scale);
  void collect(ParamList& out);
  // Router and shared grads as usual; expert grads as views of one contiguous buffer.
  void allocate_grads();
  // Sequence-wise aux loss of the last Train forward (0 when aux_loss_alpha == 0).
  double aux_loss() const { return aux_loss_; }
  // Tokens per expert (global ids), summed over Train forwards since the last update_bias.
  const std::vector<int64_t>& expert_counts() const { return counts_; }
  // For expert parallelism: the caller replaces the counts with their sum over all ranks
  // (sum_router_counts, src/parallel/ep_training.h) before update_bias. Size stays E.
  std::vector<int64_t>& expert_counts_mutable() { return counts_; }
  // bias += rate·sign(mean - count), re-centred to a zero-mean update; then resets the counts.
  // A hash layer has no bias: only the counts are reset.
  void update_bias(double rate);
  bool has_saved() const;

  const RouterConfig& router_config() const { return router_; }
  ExpertSelection selection() const { return selection_; }
  float swiglu_limit() const { return swiglu_limit_; }
  ExpertRange local_experts() const { return local_; }
  ExpertWeights& experts() { return *experts_; }
  // The fp32 expert store, or the MXFP4 one (ModelConfig::expert_format); the other is null.
  DenseExpertWeights* dense_experts() { return dense_; }
  Mxfp4ExpertWeights* mxfp4_experts() { return packed_; }
  SwiGLU* shared_experts() { return shared_.get(); }

  // Inference over MXFP4 experts may quantize the routed experts' activations to int8
  // (expert_activations.h). Int8 on fp32 experts is an error naming the layer; with Int8 set, a
  // Train forward is an error, so nothing a backward reads ever comes from the int8 kernel.
  void set_expert_activations(ExpertActivations activations);
  ExpertActivations expert_activations() const { return expert_activations_; }

  // LoRA on the routed experts: one grouped adapter per projection (null where not adapted),
  // run beside the base grouped matmuls (fp32 or the fused MXFP4 decode).
  struct ExpertLora {
    std::unique_ptr<GroupedLoraAdapter> gate, up, down;
    bool any() const { return gate || up || down; }
  };
  ExpertLora& expert_lora() { return lora_; }
  // Where the adapters' dropout finds each token's global index (set by the model).
  void set_lora_runtime(const LoraRuntime* runtime) { lora_runtime_ = runtime; }

  Param gate_weight;  // [E, dim]
  Param gate_bias;    // [E]
  Param tid2eid;      // [vocab, k], hash layers only (undefined otherwise)

 private:
  struct Saved {
    Tensor x;
    Routing routing;
    Tensor rows, g, u, row_weights;
    SeqAux aux;
    bool has_aux = false;
    Handle handle;
    BatchShape shape;
    Tensor row_keys;  // I32 [R] global token index per row, for LoRA dropout only
  };
  // Each expert-major row's global token index, when an expert adapter draws dropout masks.
  Tensor lora_row_keys(const Handle& handle, int64_t T) const;

  RouterConfig router_;
  ExpertSelection selection_ = ExpertSelection::TopK;
  float swiglu_limit_ = 0.0f;
  int64_t dim_ = 0, hidden_ = 0;
  double aux_alpha_ = 0.0;
  ExpertRange local_;
  Dispatcher* dispatcher_ = nullptr;
  std::unique_ptr<ExpertWeights> experts_;
  DenseExpertWeights* dense_ = nullptr;
  Mxfp4ExpertWeights* packed_ = nullptr;
  ExpertActivations expert_activations_ = ExpertActivations::Fp32;
  std::unique_ptr<SwiGLU> shared_;
  ExpertLora lora_;
  const LoraRuntime* lora_runtime_ = nullptr;
  std::vector<int64_t> counts_;
  double aux_loss_ = 0.0;
  Saved saved_;
};

}  // namespace moe
