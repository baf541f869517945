#include "train/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/vector_math.h"

namespace moe {

AdamW::AdamW(ParamList params, const AdamWConfig& cfg) : params_(std::move(params)), cfg_(cfg) {
  for (Param* p : params_) {
    const MemCategory c = optimizer_category_of(p->value.category());
    m_.push_back(Tensor::zeros(p->value.shape(), DType::F32, c));
    v_.push_back(Tensor::zeros(p->value.shape(), DType::F32, c));
  }
}

void AdamW::step(double lr, float grad_scale, GradsAfterStep after) {
  ++step_;
  AdamWRowParams row;
  row.grad_scale = grad_scale;
  row.beta1 = static_cast<float>(cfg_.beta1);
  row.beta2 = static_cast<float>(cfg_.beta2);
  row.one_minus_beta1 = static_cast<float>(1.0 - cfg_.beta1);
  row.one_minus_beta2 = static_cast<float>(1.0 - cfg_.beta2);
  row.step_size = static_cast<float>(lr / (1.0 - std::pow(cfg_.beta1, static_cast<double>(step_))));
  row.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(cfg_.beta2, static_cast<double>(step_))));
  row.eps = static_cast<float>(cfg_.eps);
  row.zero_grad = after == GradsAfterStep::Zeroed;
  const float decay = static_cast<float>(1.0 - lr * cfg_.weight_decay);
  // One loop over every chunk of every parameter: a loop per parameter (hundreds a step) left
  // the threads waiting at each one's end. Each value's update is its own, so the cut changes
  // no bits. Chunks of 32,768 values: 18.4-19.6 ms a `small` step against 19.3-20.7 with 8,192
  // (three alternated pairs, docs/PERF.md session 34).
  struct Chunk {
    size_t param;
    int64_t lo, n;
  };
  constexpr int64_t kChunk = 32768;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i]->grad.defined()) continue;
    const int64_t n = params_[i]->value.numel();
    for (int64_t lo = 0; lo < n; lo += kChunk) chunks.push_back({i, lo, std::min(kChunk, n - lo)});
  }
  parallel_for_dynamic(0, static_cast<int64_t>(chunks.size()), [&](int64_t c) {
    const Chunk& q = chunks[static_cast<size_t>(c)];
    Param* p = params_[q.param];
    AdamWRowParams r = row;
    r.decay = p->weight_decay ? decay : 1.0f;
    adamw_row(p->w() + q.lo, p->g() + q.lo, m_[q.param].f32() + q.lo, v_[q.param].f32() + q.lo,
              q.n, r);
  });
}

double grad_sum_squares(const ParamList& params) {
  // Fixed chunks of each gradient, summed in order: the bits depend on neither the thread count
  // nor the SIMD target. One loop over every chunk of every gradient: a loop per parameter
  // left the threads waiting at hundreds of loop ends a step.
  constexpr int64_t kChunk = int64_t{1} << 16;
  const std::vector<GradPiece> pieces = gradient_pieces(params, kChunk);
  // Work items of kSquareRows pieces, read together (see sums_of_squares); the partial sums are
  // each piece's own.
  const int64_t count = static_cast<int64_t>(pieces.size());
  std::vector<double> partial(static_cast<size_t>(count + kSquareRows), 0.0);
  parallel_for_dynamic(0, (count + kSquareRows - 1) / kSquareRows, [&](int64_t item) {
    const float* at[kSquareRows];
    int64_t n[kSquareRows];
    for (int r = 0; r < kSquareRows; ++r) {
      const int64_t c = item * kSquareRows + r;
      at[r] = c < count ? pieces[static_cast<size_t>(c)].at : nullptr;
      n[r] = c < count ? pieces[static_cast<size_t>(c)].n : 0;
    }
    sums_of_squares(at, n, partial.data() + item * kSquareRows);
  });
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

double grad_norm(const ParamList& params) { return std::sqrt(grad_sum_squares(params)); }

float clip_coefficient(double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

double clip_grad_norm(const ParamList& params, double max_norm) {
  const double norm = grad_norm(params);
  const float c = clip_coefficient(norm, max_norm);
  if (c < 1.0f) {
    for (Param* p : params) {
      if (!p->grad.defined()) continue;
      float* g = p->g();
      const int64_t n = p->grad.numel();
      parallel_for(0, (n + 4095) / 4096, [&](int64_t k) {
        const int64_t hi = std::min(n, (k + 1) * 4096);
        for (int64_t j = k * 4096; j < hi; ++j) g[j] *= c;
      });
    }
  }
  return norm;
}

}  // namespace moe
