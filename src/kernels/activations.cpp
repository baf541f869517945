#include "kernels/activations.h"

#include <algorithm>
#include <cmath>
#include <vector>

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
  if (!dw) {
    parallel_for(0, rows, [&](int64_t r) {
      rmsnorm_backward_row(x + r * dim, w, rstd[r], dy + r * dim, dx + r * dim, dim);
    });
    return;
  }
  // The weight gradient is summed per fixed chunk of rows, right after the chunk's dx rows while
  // they are in cache, and the chunks' sums join the total in chunk order: the same bits for any
  // thread count. (A pass of its own read every row again, from L3 at best: as long as the dx
  // pass.) The chunk sums wait in a buffer of a wave of chunks, 256 KiB or a few per thread,
  // whatever the row count; the wave's size changes no bit.
  const int64_t chunks = (rows + kReduceChunk - 1) / kReduceChunk;
  const int64_t wave = std::max<int64_t>(2 * num_threads(), (int64_t{1} << 15) / std::max<int64_t>(dim, 1));
  std::vector<double> partial(static_cast<size_t>(std::min(wave, chunks) * dim));
  std::vector<double> total(static_cast<size_t>(dim), 0.0);
  for (int64_t c0 = 0; c0 < chunks; c0 += wave) {
    const int64_t n = std::min(wave, chunks - c0);
    parallel_for(0, n, [&](int64_t i) {
      const int64_t lo = (c0 + i) * kReduceChunk, hi = std::min(rows, lo + kReduceChunk);
      for (int64_t r = lo; r < hi; ++r)
        rmsnorm_backward_row(x + r * dim, w, rstd[r], dy + r * dim, dx + r * dim, dim);
      scaled_product_column_sums(x + lo * dim, dy + lo * dim, rstd + lo, hi - lo, dim, dim,
                                 partial.data() + i * dim);
    });
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < dim; ++j)
        total[static_cast<size_t>(j)] += partial[static_cast<size_t>(i * dim + j)];
  }
  for (int64_t j = 0; j < dim; ++j) dw[j] += static_cast<float>(total[static_cast<size_t>(j)]);
}

void add_inplace(float* y, const float* x, int64_t n) {
  for_chunks(n, [&](int64_t lo, int64_t hi) { add_row(y + lo, x + lo, hi - lo); });
}

}  // namespace moe
