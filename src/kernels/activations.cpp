#include "kernels/activations.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "kernels/vector_math.h"

namespace moe {

namespace {
constexpr int64_t kElemChunk = 4096;

template <typename F>
void for_chunks(int64_t n, F&& body) {
  const int64_t chunks = (n + kElemChunk - 1) / kElemChunk;
  parallel_for(0, chunks, [&](int64_t c) {
    const int64_t lo = c * kElemChunk, hi = std::min(n, lo + kElemChunk);
    body(lo, hi);
  });
}

}  // namespace

void swiglu_forward(const float* g, const float* u, float* h, int64_t n) {
  for_chunks(n, [&](int64_t lo, int64_t hi) { swiglu_row(g + lo, u + lo, h + lo, hi - lo); });
}

void swiglu_backward(const float* g, const float* u, const float* dh, float* dg, float* du,
                     int64_t n) {
  for_chunks(n, [&](int64_t lo, int64_t hi) {
    swiglu_backward_row(g + lo, u + lo, dh + lo, dg + lo, du + lo, hi - lo);
  });
}

void swiglu_row(const float* g, const float* u, float* h, int64_t n, float limit) {
  if (limit > 0.0f)
    clamped_swiglu_row(g, u, h, n, limit);
  else
    swiglu_row(g, u, h, n);
}

void swiglu_backward_row(const float* g, const float* u, const float* dh, float* dg, float* du,
                         int64_t n, float limit) {
  if (limit > 0.0f)
    clamped_swiglu_backward_row(g, u, dh, dg, du, n, limit);
  else
    swiglu_backward_row(g, u, dh, dg, du, n);
}

void swiglu_forward(const float* g, const float* u, float* h, int64_t n, float limit) {
  for_chunks(n, [&](int64_t lo, int64_t hi) { swiglu_row(g + lo, u + lo, h + lo, hi - lo, limit); });
}

void swiglu_backward(const float* g, const float* u, const float* dh, float* dg, float* du,
                     int64_t n, float limit) {
  for_chunks(n, [&](int64_t lo, int64_t hi) {
    swiglu_backward_row(g + lo, u + lo, dh + lo, dg + lo, du + lo, hi - lo, limit);
  });
}

void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows,
                     int64_t dim, float eps) {
  parallel_for(0, rows, [&](int64_t r) {
    const float rs = rmsnorm_row(x + r * dim, w, y + r * dim, dim, eps);
    if (rstd) rstd[r] = rs;
  });
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                      float* dw, int64_t rows, int64_t dim) {
  parallel_for(0, rows, [&](int64_t r) {
    rmsnorm_backward_row(x + r * dim, w, rstd[r], dy + r * dim, dx + r * dim, dim);
  });
  if (!dw) return;
  // Column blocks own their sums, rows are visited in order: same bits for any thread count and
  // block width. Blocks of 32 rather than 64 columns split dim 320 evenly between two threads.
  constexpr int64_t kWidth = 32;
  parallel_for(0, (dim + kWidth - 1) / kWidth, [&](int64_t b) {
    const int64_t lo = b * kWidth, hi = std::min(dim, lo + kWidth);
    double acc[kWidth];
    scaled_product_column_sums(x + lo, dy + lo, rstd, rows, dim, hi - lo, acc);
    for (int64_t i = lo; i < hi; ++i) dw[i] += static_cast<float>(acc[i - lo]);
  });
}

void add_inplace(float* y, const float* x, int64_t n) {
  for_chunks(n, [&](int64_t lo, int64_t hi) { add_row(y + lo, x + lo, hi - lo); });
}

}  // namespace moe
