#pragma once
// Inference-only MXFP4 matmul with int8 activations: y[m, rows] (+)= x[m, cols] · Wᵀ, where x is
// first quantized per 32-element block to int8 (scale max|x| / 127, round to nearest even) and
// the E2M1 × int8 products are summed exactly in integers. It reads the packed weights at memory
// speed where the exact mxfp4_gemm_nt is bound by its decode, and differs from it only by the
// activation rounding: |y − y_exact| <= Σ_blocks (amax_block / 254) · Σ|w| over the block
// (half a quantization step per element), about 0.4% of Σ|x·w| at worst, typically far less
// (docs/PERF.md, tests/test_mxfp4.cpp). Never used where a backward runs.
//
// Same calling rules as mxfp4_gemm_nt: runs on the calling thread, cols % 32 == 0, and the bits
// depend on the shapes only (not on m, threads or the SIMD target); the arithmetic is spelled
// out at the top of mxfp4_gemm_q8.cpp. A NaN or ±Inf in a block of x makes the outputs NaN.
#include <cstdint>

#include "kernels/mxfp4_gemm.h"

namespace moe {

void mxfp4_gemm_nt_q8(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y,
                      int64_t ldy, bool accumulate);

}  // namespace moe
