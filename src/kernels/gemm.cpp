#include "kernels/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

#include "core/parallel.h"

namespace moe {

namespace {

// OpenBLAS's own threading changes per-element rounding with the thread count (measured: a
// 257x300x129 sgemm differs between 1 and 2 threads). We therefore split C into tiles whose
// bounds depend only on the shape and run single-threaded OpenBLAS on each tile in our own
// OpenMP loop. Large extents get wide tiles (packing amortised), small ones narrow tiles so
// that they still spread over the threads.
int64_t tile_for(int64_t extent) { return extent >= 1024 ? 256 : 64; }

enum class Layout { NT, NN, TN };

void sgemm_tile(Layout layout, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const auto ta = layout == Layout::TN ? CblasTrans : CblasNoTrans;
  const auto tb = layout == Layout::NT ? CblasTrans : CblasNoTrans;
  cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
              alpha, A, static_cast<int>(lda), B, static_cast<int>(ldb), beta, C,
              static_cast<int>(ldc));
}

// False when there is nothing to multiply; an empty contraction (an expert with no tokens)
// leaves C, or clears it.
bool nonempty(int64_t M, int64_t N, int64_t K, float* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return false;
  if (K > 0) return true;
  if (!accumulate)
    for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * N);
  return false;
}

void gemm(Layout layout, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  // Pins OpenBLAS to one thread even for callers that never chose a thread count.
  static const bool kThreadPolicy = (set_num_threads(num_threads()), true);
  (void)kThreadPolicy;
  if (!nonempty(M, N, K, C, ldc, accumulate)) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  const bool split_rows = M >= N;
  const int64_t extent = split_rows ? M : N;
  const int64_t tile = tile_for(extent);
  const int64_t tiles = (extent + tile - 1) / tile;
  auto run_tile = [&](int64_t t) {
    const int64_t lo = t * tile, len = std::min(tile, extent - lo);
    if (split_rows) {
      const float* a = layout == Layout::TN ? A + lo : A + lo * lda;
      sgemm_tile(layout, len, N, K, alpha, a, lda, B, ldb, beta, C + lo * ldc, ldc);
    } else {
      const float* b = layout == Layout::NT ? B + lo * ldb : B + lo;
      sgemm_tile(layout, M, len, K, alpha, A, lda, b, ldb, beta, C + lo, ldc);
    }
  };
  // Even a single tile runs inside a parallel region: outside one, the OpenMP build of OpenBLAS
  // would thread by itself and round differently per thread count.
  parallel_for_dynamic(0, tiles, run_tile);
}

void gemm_serial(Layout layout, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  if (nonempty(M, N, K, C, ldc, accumulate))
    sgemm_tile(layout, M, N, K, alpha, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, ldc);
}

}  // namespace

void gemm_nt_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  gemm_serial(Layout::NT, M, N, K, A, lda, B, ldb, C, ldc, accumulate, alpha);
}
void gemm_nn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  gemm_serial(Layout::NN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, alpha);
}
void gemm_tn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  gemm_serial(Layout::TN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, alpha);
}

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  gemm(Layout::NT, M, N, K, A, lda, B, ldb, C, ldc, accumulate, alpha);
}

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  gemm(Layout::NN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, alpha);
}

void gemm_tn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha) {
  gemm(Layout::TN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, alpha);
}

}  // namespace moe
