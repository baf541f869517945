#include "train/adamw.h"

#include <cmath>

#include "core/parallel.h"

namespace moe {

AdamW::AdamW(ParamList params, const AdamWConfig& cfg) : params_(std::move(params)), cfg_(cfg) {
  for (Param* p : params_) {
    m_.push_back(Tensor::zeros(p->value.shape(), DType::F32, MemCategory::Optimizer));
    v_.push_back(Tensor::zeros(p->value.shape(), DType::F32, MemCategory::Optimizer));
  }
}

void AdamW::step(double lr) {
  ++step_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(step_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(cfg_.beta2, static_cast<double>(step_)));
  const float b1 = static_cast<float>(cfg_.beta1), b2 = static_cast<float>(cfg_.beta2);
  const float step_size = static_cast<float>(lr / bc1);
  const float eps = static_cast<float>(cfg_.eps);
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    if (!p->grad.defined()) continue;
    const float decay = p->weight_decay ? static_cast<float>(1.0 - lr * cfg_.weight_decay) : 1.0f;
    float* w = p->w();
    const float* g = p->g();
    float* m = m_[i].f32();
    float* v = v_[i].f32();
    const int64_t n = p->value.numel();
    const int64_t chunks = (n + 4095) / 4096;
    parallel_for(0, chunks, [&](int64_t c) {
      const int64_t hi = std::min(n, (c + 1) * 4096);
      for (int64_t j = c * 4096; j < hi; ++j) {
        w[j] *= decay;
        m[j] = m[j] * b1 + g[j] * (1.0f - b1);
        v[j] = v[j] * b2 + g[j] * g[j] * (1.0f - b2);
        const float denom = std::sqrt(v[j]) / static_cast<float>(bc2_sqrt) + eps;
        w[j] -= step_size * (m[j] / denom);
      }
    });
  }
}

double grad_norm(const ParamList& params) {
  double total = 0;
  for (Param* p : params) {
    if (!p->grad.defined()) continue;
    const float* g = p->g();
    const int64_t n = p->grad.numel();
    const int64_t chunks = (n + kReduceChunk * 64 - 1) / (kReduceChunk * 64);
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    parallel_for(0, chunks, [&](int64_t c) {
      const int64_t lo = c * kReduceChunk * 64, hi = std::min(n, lo + kReduceChunk * 64);
      double s = 0;
      for (int64_t j = lo; j < hi; ++j) s += static_cast<double>(g[j]) * g[j];
      partial[static_cast<size_t>(c)] = s;
    });
    for (double s : partial) total += s;
  }
  return std::sqrt(total);
}

double clip_grad_norm(const ParamList& params, double max_norm) {
  const double norm = grad_norm(params);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    const float c = static_cast<float>(coef);
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

bool grads_finite(const ParamList& params) {
  for (Param* p : params) {
    if (!p->grad.defined()) continue;
    const float* g = p->g();
    for (int64_t j = 0; j < p->grad.numel(); ++j)
      if (!std::isfinite(g[j])) return false;
  }
  return true;
}

}  // namespace moe
