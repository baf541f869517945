#include "train/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "kernels/vector_math.h"

namespace moe {

AdamW::AdamW(ParamList params, const AdamWConfig& cfg) : params_(std::move(params)), cfg_(cfg) {
  // Pieces of 4,096 values: small enough that a forward waiting for one layer's parameters
  // waits for little more than them, large enough that handing them out costs nothing.
  constexpr int64_t kChunk = 4096;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param* p = params_[i];
    const MemCategory c = optimizer_category_of(p->value.category());
    m_.push_back(Tensor::zeros(p->value.shape(), DType::F32, c));
    v_.push_back(Tensor::zeros(p->value.shape(), DType::F32, c));
    first_chunk_.push_back(static_cast<int64_t>(chunks_.size()));
    index_of_.emplace(p, i);
    const int64_t n = p->value.numel();
    for (int64_t lo = 0; lo < n; lo += kChunk)
      chunks_.push_back({static_cast<int32_t>(i), lo, std::min(kChunk, n - lo)});
  }
  first_chunk_.push_back(static_cast<int64_t>(chunks_.size()));
  chunk_done_ = std::make_unique<std::atomic<int64_t>[]>(chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) chunk_done_[c].store(0, std::memory_order_relaxed);
  decay_.resize(params_.size());
}

AdamW::~AdamW() {
  try {
    finish();
  } catch (...) {
    // Only a bug can throw here, and a destructor must not: the update's effects are moot now.
  }
}

void AdamW::prepare(double lr, float grad_scale) {
  finish();
  ++step_;
  ++generation_;
  row_.grad_scale = grad_scale;
  row_.beta1 = static_cast<float>(cfg_.beta1);
  row_.beta2 = static_cast<float>(cfg_.beta2);
  row_.one_minus_beta1 = static_cast<float>(1.0 - cfg_.beta1);
  row_.one_minus_beta2 = static_cast<float>(1.0 - cfg_.beta2);
  row_.step_size = static_cast<float>(lr / (1.0 - std::pow(cfg_.beta1, static_cast<double>(step_))));
  row_.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(cfg_.beta2, static_cast<double>(step_))));
  row_.eps = static_cast<float>(cfg_.eps);
  for (size_t i = 0; i < params_.size(); ++i)
    decay_[i] = params_[i]->weight_decay ? static_cast<float>(1.0 - lr * cfg_.weight_decay) : 1.0f;
}

void AdamW::run_chunk(int64_t c) {
  const Chunk& k = chunks_[static_cast<size_t>(c)];
  const Param* p = params_[static_cast<size_t>(k.param)];
  if (p->grad.defined()) {
    AdamWRowParams row = row_;
    row.decay = decay_[static_cast<size_t>(k.param)];
    float* g = p->g() + k.offset;
    adamw_row(p->w() + k.offset, g, m_[static_cast<size_t>(k.param)].f32() + k.offset,
              v_[static_cast<size_t>(k.param)].f32() + k.offset, k.n, row);
    if (zero_grads_) std::memset(g, 0, sizeof(float) * static_cast<size_t>(k.n));
  }
  chunk_done_[static_cast<size_t>(c)].store(generation_, std::memory_order_release);
}

void AdamW::step(double lr, float grad_scale) {
  prepare(lr, grad_scale);
  zero_grads_ = false;
  parallel_for(0, static_cast<int64_t>(chunks_.size()), [&](int64_t c) { run_chunk(c); });
}

void AdamW::start_step(double lr, float grad_scale) {
  prepare(lr, grad_scale);
  zero_grads_ = true;
  running_ = true;
  start_background_loop(0, static_cast<int64_t>(chunks_.size()), runner_);
}

void AdamW::finish() {
  if (!running_) return;
  running_ = false;
  finish_background_loop();
}

void AdamW::wait_for(const ParamList& params) {
  if (!running_) return;
  for (const Param* p : params) {
    const auto it = index_of_.find(p);
    if (it == index_of_.end()) continue;
    for (int64_t c = first_chunk_[it->second]; c < first_chunk_[it->second + 1]; ++c)
      while (chunk_done_[static_cast<size_t>(c)].load(std::memory_order_acquire) != generation_)
        if (!help_background_loop()) std::this_thread::yield();  // a worker has its last chunks
  }
}

double grad_sum_squares(const ParamList& params) {
  // Fixed chunks of each gradient, summed in order: the bits depend on neither the thread count
  // nor the SIMD target. One loop over every chunk of every gradient: a loop per parameter
  // left the threads waiting at hundreds of loop ends a step.
  constexpr int64_t kChunk = int64_t{1} << 16;
  struct Piece {
    const float* at;
    int64_t n;
  };
  std::vector<Piece> pieces;
  for (const Param* p : params) {
    if (!p->grad.defined()) continue;
    const int64_t n = p->grad.numel();
    for (int64_t i = 0; i < n; i += kChunk) pieces.push_back({p->g() + i, std::min(kChunk, n - i)});
  }
  std::vector<double> partial(pieces.size(), 0.0);
  parallel_for_dynamic(0, static_cast<int64_t>(pieces.size()), [&](int64_t c) {
    const Piece& q = pieces[static_cast<size_t>(c)];
    partial[static_cast<size_t>(c)] = sum_of_squares(q.at, q.n);
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
