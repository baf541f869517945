// In-register transpose of a square of vectors, shared by the kernels that pack operands
// (kernels/gemm.cpp, kernels/mxfp4_gemm.cpp). Included after <hwy/highway.h>, once per target
// (Highway's -inl.h convention).
#if defined(MOE_KERNELS_TRANSPOSE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_KERNELS_TRANSPOSE_INL_H_
#undef MOE_KERNELS_TRANSPOSE_INL_H_
#else
#define MOE_KERNELS_TRANSPOSE_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {

#if HWY_TARGET != HWY_SCALAR  // one lane: nothing to transpose

// Transposes N vectors (rows) of N lanes, N = 8 or 16: afterwards r[c] holds former lane c.
// Each stage takes even and odd lanes of row pairs, which rotates the (row, lane) index bits by
// one; log2(N) stages swap row and lane bits.
template <int N, class D>
HWY_INLINE void TransposeSquare(D d, hwy::HWY_NAMESPACE::Vec<D>* r) {
  namespace hn = hwy::HWY_NAMESPACE;
  static_assert(N == 8 || N == 16, "8 x 8 or 16 x 16");
  constexpr int kStages = N == 16 ? 4 : 3;
  constexpr int kHalf = N / 2;
#pragma GCC unroll 4
  for (int stage = 0; stage < kStages; ++stage) {
    hn::Vec<D> t[N];
#pragma GCC unroll 8
    for (int q = 0; q < kHalf; ++q) {
      t[q] = hn::ConcatEven(d, r[2 * q + 1], r[2 * q]);
      t[q + kHalf] = hn::ConcatOdd(d, r[2 * q + 1], r[2 * q]);
    }
#pragma GCC unroll 16
    for (int q = 0; q < N; ++q) r[q] = t[q];
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_KERNELS_TRANSPOSE_INL_H_
