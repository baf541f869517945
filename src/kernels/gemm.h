#pragma once
// Row-major fp32 GEMM through OpenBLAS. Naming follows the operand layouts of a linear layer
// with W [out, in]: forward y = x·Wᵀ (nt), input gradient dx = dy·W (nn), weight gradient
// dW += dyᵀ·x (tn). `accumulate` adds into C instead of overwriting it.
#include <cstdint>

namespace moe {

// C[M,N] (+)= A[M,K] · B[N,K]ᵀ
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha = 1.0f);
// C[M,N] (+)= A[M,K] · B[K,N]
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha = 1.0f);
// C[M,N] (+)= A[K,M]ᵀ · B[K,N]
void gemm_tn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha = 1.0f);

// One OpenBLAS call on the calling thread, for work items that already run inside a
// parallel_for body (attention heads, expert segments): no re-tiling, so one item packs its
// operands once. Outside a parallel region use the tiled forms above, whose bits never depend
// on the thread count. Same contract for M, N or K = 0.
void gemm_nt_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha = 1.0f);
void gemm_nn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha = 1.0f);
void gemm_tn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate, float alpha = 1.0f);

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
