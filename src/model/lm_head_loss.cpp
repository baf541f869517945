#include "model/lm_head_loss.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm.h"
#include "kernels/vector_math.h"

namespace moe {

void LMHeadLoss::init(const std::string& name, int64_t d, int64_t v) {
  dim = d;
  vocab = v;
  weight.init(name, {vocab, dim}, /*decay=*/true);
}

int64_t LMHeadLoss::chunk_rows(int64_t v, int64_t d) {
  // Every chunk packs the head's weight again (twice in training), a cost the chunk's rows
  // share, so the chunk is as tall as its memory allows: its logits may take 16 MiB or a
  // quarter of the head's own weight bytes, whichever is more.
  const int64_t budget_floats = std::max<int64_t>(int64_t{1} << 22, v * d / 4);
  return std::clamp<int64_t>(budget_floats / std::max<int64_t>(v, 1), 16, 1024);
}

int64_t LMHeadLoss::bytes_saved(int64_t tokens, int64_t v, int64_t d, bool training) {
  const int64_t full = tokens * v * 4, chunk = std::min(tokens, chunk_rows(v, d)) * v * 4;
  return (full - chunk) * (training ? 2 : 1);
}

Tensor LMHeadLoss::logits(const Tensor& h) const {
  const int64_t T = h.dim(0);
  Tensor out = Tensor::empty({T, vocab}, DType::F32, MemCategory::Activations);
  linear_forward(h.f32(), weight.w(), out.f32(), T, dim, vocab);
  return out;
}

LossResult LMHeadLoss::forward(const Tensor& h, const Tensor& targets, Pass pass, double z_coef,
                               float grad_scale) {
  MOE_CHECK(h.ndim() == 2 && h.dim(1) == dim, "{}: expected hidden [T, {}], got {}", weight.name,
            dim, shape_str(h.shape()));
  const int64_t T = h.dim(0);
  MOE_CHECK(targets.numel() == T, "{}: {} targets for {} tokens", weight.name, targets.numel(), T);
  const int32_t* tgt = targets.i32();
  int64_t counted = 0;
  for (int64_t t = 0; t < T; ++t) {
    MOE_CHECK(tgt[t] == kIgnoreIndex || (tgt[t] >= 0 && tgt[t] < vocab),
              "target id {} at position {} is outside the vocabulary [0, {})", tgt[t], t, vocab);
    counted += tgt[t] != kIgnoreIndex;
  }
  const bool train = needs_backward(pass);
  Tensor dh;
  if (train) dh = Tensor::zeros({T, dim}, DType::F32, MemCategory::Activations);
  LossResult result;
  result.tokens = counted;
  if (counted == 0) {
    if (train) saved_dh_ = dh;
    return result;
  }
  const double inv_count = 1.0 / static_cast<double>(counted);
  const int64_t rows = chunk_rows(vocab, dim);
  Tensor chunk = Tensor::empty({std::min(rows, T), vocab}, DType::F32, MemCategory::Scratch);
  std::vector<double> nll(static_cast<size_t>(T)), lse(static_cast<size_t>(T));
  for (int64_t c0 = 0; c0 < T; c0 += rows) {
    const int64_t n = std::min(rows, T - c0);
    float* z = chunk.f32();
    linear_forward(h.f32() + c0 * dim, weight.w(), z, n, dim, vocab);
    parallel_for(0, n, [&](int64_t r) {
      const int64_t t = c0 + r;
      float* zr = z + r * vocab;
      if (tgt[t] == kIgnoreIndex) {
        nll[t] = lse[t] = 0;
        if (train) std::fill(zr, zr + vocab, 0.0f);
        return;
      }
      const float target_logit = zr[tgt[t]];
      const float mx = row_max(zr, vocab);
      const double sum = exp_shift_sum(zr, vocab, mx);  // zr now holds exp(z - max)
      const double l = mx + std::log(sum);
      lse[t] = l;
      nll[t] = l - target_logit;
      if (!train) return;
      // d/dz of (CE + z_coef*lse^2), both averaged over counted tokens.
      const double scale = grad_scale * inv_count * (1.0 + 2.0 * z_coef * l);
      scale_row(zr, vocab, static_cast<float>(scale / sum));
      zr[tgt[t]] -= static_cast<float>(grad_scale * inv_count);
    });
    if (train) {
      linear_backward_input(z, weight.w(), dh.f32() + c0 * dim, n, dim, vocab, false);
      if (weight.grad.defined())
        linear_backward_weight(z, h.f32() + c0 * dim, weight.g(), n, dim, vocab);
    }
  }
  double ce = 0, zl = 0;
  for (int64_t t = 0; t < T; ++t) {
    ce += nll[t];
    zl += lse[t] * lse[t];
  }
  result.ce = ce * inv_count;
  result.z_loss = z_coef * zl * inv_count;
  if (train) saved_dh_ = dh;
  return result;
}

Tensor LMHeadLoss::backward() {
  MOE_CHECK(saved_dh_.defined(), "{}: backward without a training forward", weight.name);
  Tensor dh = saved_dh_;
  saved_dh_.reset();
  return dh;
}

}  // namespace moe
