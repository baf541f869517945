#pragma once
// DeepSeek router math (SPEC §2 "MoE layer", steps 2-6) on precomputed fp32 logits, plus the
// sequence-wise auxiliary loss. The gate GEMM itself lives in the MoE layer.
//
// Conventions (shared with tests/reference/deepseek_ref.py):
//  * selection = scores + e_score_correction_bias, used for choosing only;
//  * group-limited routing keeps the best topk_group groups (ties -> lower group id) and masks
//    the other groups out entirely (DeepSeek's -inf, not HF's 0.0, which could pick a masked
//    expert over an allowed one whose biased score is negative);
//  * the k ids of a token are ordered by descending selection score, ties -> lower expert id;
//    combine sums the slots in that order;
//  * weights = unbiased scores at the chosen ids, optionally normalised, times the scale;
//  * no gradient flows through the selection.
#include <cstdint>

#include "core/tensor.h"
#include "model/config.h"
#include "model/param.h"

namespace moe {

enum class Scoring { Sigmoid, Softmax };
enum class GroupRule { None, SumTop2, Max };  // greedy | noaux_tc | group_limited_greedy

struct RouterConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  GroupRule group_rule = GroupRule::None;
  Scoring scoring = Scoring::Sigmoid;
  bool norm_topk_prob = true;
  float scale = 1.0f;

  // Checks the MoE fields of `cfg` and raises moe::Error naming the first bad one.
  static RouterConfig from(const ModelConfig& cfg);
};

struct Routing {
  Tensor ids;      // I32 [T, k]
  Tensor weights;  // F32 [T, k], what multiplies each expert's output
  Tensor scores;   // F32 [T, E], unbiased sigmoid/softmax scores
};

// logits F32 [T, E]; bias [E] (may be null = zeros). Outputs are charged to Activations.
Routing route(const RouterConfig& cfg, const Tensor& logits, const float* bias);

// Sequence-wise auxiliary loss over B = shape.batch sequences of S = shape.seq tokens:
// f_{b,i} = E/(K·S)·#{(t,k) in b routed to i}, P_{b,i} = mean_t s'_{t,i} with s' the scores
// normalised per token (softmax scores are used as they are); loss = alpha·mean_b Σ_i f·P.
struct SeqAux {
  Tensor f;  // F32 [B, E], a constant for backward
  double loss = 0.0;
};
SeqAux seq_aux_loss(const RouterConfig& cfg, const Routing& routing, const BatchShape& shape,
                    double alpha);

// d logits [T, E] from d weights [T, k] and, when aux is non-null, from aux_scale·d(aux loss).
// aux_scale already includes the caller's d(total)/d(aux).
Tensor route_backward(const RouterConfig& cfg, const Routing& routing, const Tensor& d_weights,
                      const SeqAux* aux, const BatchShape& shape, double alpha, double aux_scale);

}  // namespace moe
