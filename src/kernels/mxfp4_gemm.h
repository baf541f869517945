#pragma once
// Matmuls against an MXFP4 weight that decode it block by block inside the kernel: a full fp32
// copy of the weight never exists (scratch is bounded by one tile, see mxfp4_gemm.cpp).
#include <cstdint>

#include "kernels/kernel_scratch.h"

namespace moe {

// A packed matrix W [rows, cols] (rows = out features, cols = in features, cols % 32 == 0 for
// the whole matrix): row r's bytes start at packed + r*packed_stride, its scales at
// scales + r*scale_stride. A 32-aligned column sub-range [c0, c0 + cols) is described by
// offsetting the pointers (c0/2 bytes, c0/32 scales) and setting cols; a row sub-range by
// offsetting both pointers by r0 rows.
struct Mxfp4Matrix {
  const uint8_t* packed;
  const uint8_t* scales;
  int64_t rows, cols;
  int64_t packed_stride, scale_stride;
};

// Both kernels run on the calling thread only and are deterministic: the result depends on the
// shapes only, never on the thread count, the SIMD target or other calls running concurrently
// (the arithmetic is spelled out at the top of mxfp4_gemm.cpp: nn is exactly gemm_nn on the
// decoded weights, nt a fixed 16-lane sum per 1,024 columns). Callers
// parallelise by calling them from inside their own parallel loops, one call per work item.
// An empty contraction (cols == 0 for nt, rows == 0 for nn) with accumulate=false zeroes the
// output, like gemm_*_serial.

// y[m, rows] (+)= x[m, cols] · Wᵀ   (ldx, ldy in floats; accumulate=false overwrites)
void mxfp4_gemm_nt(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y,
                   int64_t ldy, bool accumulate);
// dx[m, cols] (+)= dy[m, rows] · W
void mxfp4_gemm_nn(int64_t m, const float* dy, int64_t lddy, const Mxfp4Matrix& w, float* dx,
                   int64_t lddx, bool accumulate);

// The scratch a call of m rows asks for on the current SIMD target: nt's whatever W's shape,
// nn's for W of rows × cols (from some row count on, the fp32 GEMM runs it, packing W's
// decoded rows: gemm_nn_serial_rows).
ScratchFloats mxfp4_gemm_nt_scratch_floats(int64_t m);
ScratchFloats mxfp4_gemm_nn_scratch_floats(int64_t m, int64_t rows, int64_t cols);

}  // namespace moe
