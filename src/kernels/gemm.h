#pragma once
// Row-major fp32 matmuls (the engine's own Highway kernels, kernels/gemm.cpp). Naming follows the
// operand layouts of a linear layer with W [out, in]: forward y = x·Wᵀ (nt), input gradient
// dx = dy·W (nn), weight gradient dW += dyᵀ·x (tn).
//
// Every output element is one fused multiply-add chain over k in order, starting from +0, or
// from C's value when `accumulate` (which thus continues a chain: accumulating over K1 and then
// K2 gives the bits of one call over K1 + K2). The bits of C[i,j] depend only on A's row i, B's
// column j and the start value: the same for any M, N, thread count and SIMD target.
#include <cstdint>

#include "kernels/kernel_scratch.h"

namespace moe {

// The most floats B is packed into per column block (kernels/gemm.cpp run()): the forms below
// pack it once for all threads, the serial forms once per calling thread. 16 MiB gave the
// 2048³ products 1-3% (nt, nn) and 3-4% (tn) over 4 MiB on a Zen 5 (32 MiB L3): each column
// block repacks A.
inline constexpr int64_t kGemmPackedBFloatsShared = int64_t{1} << 22;
inline constexpr int64_t kGemmPackedBFloatsPerThread = int64_t{1} << 20;
// Products of fewer multiply-adds (M·N·K) than this run on the calling thread: not worth waking
// the others.
inline constexpr int64_t kGemmParallelMinWork = int64_t{1} << 16;

// C[M,N] (+)= A[M,K] · B[N,K]ᵀ
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate);
// C[M,N] (+)= A[M,K] · B[K,N]
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate);
// C[M,N] (+)= A[K,M]ᵀ · B[K,N]
void gemm_tn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate);

// The same on the calling thread only, for work items that already run inside a parallel_for
// body (attention heads, expert segments). Same bits as the forms above; M, N or K = 0 as there.
void gemm_nt_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate);
void gemm_nn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate);
void gemm_tn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate);

// gemm_nn_serial with B supplied a row at a time by a producer rather than read as fp32 from
// memory: row(ctx, k, j0, n, out) writes B(k, j0), ..., B(k, j0 + n - 1) to out (n at most
// kGemmRowsMaxFloats). For weights kept in another format and decoded as they are packed (the
// MXFP4 experts' input gradient): the bits of gemm_nn_serial over the decoded rows, and its
// scratch (gemm_scratch_floats(GemmLayout::NN, M, N, K, true)).
struct GemmRows {
  void (*row)(const void* ctx, int64_t k, int64_t j0, int64_t n, float* out);
  const void* ctx;
};
inline constexpr int64_t kGemmRowsMaxFloats = 1024;
void gemm_nn_serial_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                         const GemmRows& B, float* C, int64_t ldc, bool accumulate);

// The operand layouts of gemm_nt, gemm_nn and gemm_tn.
enum class GemmLayout { NT, NN, TN };

// The scratch one call of this shape asks for on the current SIMD target (gemm_nt's calls of a
// few rows pack nothing; gemm_tn's may pack A once for all their tasks), `serial` for the
// gemm_*_serial forms.
ScratchFloats gemm_scratch_floats(GemmLayout layout, int64_t M, int64_t N, int64_t K, bool serial);

// Dense-layer conveniences over contiguous buffers: x [T,in], W [out,in], y [T,out].
inline void linear_forward(const float* x, const float* W, float* y, int64_t T, int64_t in,
                           int64_t out, bool accumulate = false) {
  gemm_nt(T, out, in, x, in, W, in, y, out, accumulate);
}
inline void linear_backward_input(const float* dy, const float* W, float* dx, int64_t T,
                                  int64_t in, int64_t out, bool accumulate) {
  gemm_nn(T, in, out, dy, out, W, in, dx, in, accumulate);
}
inline void linear_backward_weight(const float* dy, const float* x, float* dW, int64_t T,
                                   int64_t in, int64_t out) {
  gemm_tn(out, in, T, dy, out, x, in, dW, in, /*accumulate=*/true);
}

}  // namespace moe
