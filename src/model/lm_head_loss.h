#pragma once
// LM head fused with cross-entropy. Logits are produced chunk by chunk of tokens, so the full
// [tokens x vocab] matrix never exists; in a training pass the chunk's gradient (dh and dW) is
// formed right away, because the loss is the end of the graph and nothing else needs logits.
#include "model/param.h"

namespace moe {

constexpr int32_t kIgnoreIndex = -100;

struct LossResult {
  double ce = 0;        // mean cross-entropy over counted tokens
  double z_loss = 0;    // z_coef * mean(logsumexp^2)
  double aux = 0;       // sequence-wise balance loss (filled by the model)
  int64_t tokens = 0;   // counted (target != -100) tokens
  // DeepSeek-V4's multi-token prediction (filled by the V4 model when it has MTP layers): the
  // MTP head's mean cross-entropy and its weight in the objective; 0 otherwise.
  double mtp_ce = 0;
  double mtp_weight = 0;
  double total() const { return ce + z_loss + aux + mtp_weight * mtp_ce; }
};

class LMHeadLoss {
 public:
  void init(const std::string& name, int64_t dim, int64_t vocab);
  void collect(ParamList& out) { out.push_back(&weight); }

  // h [T, dim] (already final-normed), targets I32 [T]. In Pass::Train the head's weight grad
  // is accumulated now (scaled by grad_scale) and dh is kept for backward().
  LossResult forward(const Tensor& h, const Tensor& targets, Pass pass, double z_coef = 0.0,
                     float grad_scale = 1.0f);
  Tensor backward();
  // Full logits [T, vocab] for inference and `moe logits`.
  Tensor logits(const Tensor& h) const;
  bool has_saved() const { return saved_dh_.defined(); }

  // Token rows per chunk for a head of this shape: up to 1,024, within 16 MiB of logits or a
  // quarter of the head's weight bytes (the matmuls of a short chunk spend their time packing
  // the weight: 16 rows ran 3.7x slower than 1,024 at dim 2048).
  static int64_t chunk_rows(int64_t vocab, int64_t dim);
  // Bytes a materialised [T, vocab] fp32 logits (+ its gradient when training) would take
  // beyond one chunk: what the chunking saves.
  static int64_t bytes_saved(int64_t tokens, int64_t vocab, int64_t dim, bool training);

  Param weight;
  int64_t dim = 0, vocab = 0;

 private:
  Tensor saved_dh_;
};

}  // namespace moe
