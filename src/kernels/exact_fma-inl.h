// a·b + c rounded once, lane by lane, on every SIMD target: the one primitive behind the kernels'
// "same bits on every target" rule. Targets with a hardware FMA use it; the others (the scalar
// fallback, or Highway's emulated 128-bit target where a compiler makes it the fallback) go lane
// by lane through std::fma. Included by kernel files after <hwy/highway.h>, once per target
// (Highway's -inl.h convention).
#if defined(MOE_KERNELS_EXACT_FMA_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_KERNELS_EXACT_FMA_INL_H_
#undef MOE_KERNELS_EXACT_FMA_INL_H_
#else
#define MOE_KERNELS_EXACT_FMA_INL_H_
#endif

#include <hwy/highway.h>

#include <cmath>
#include <cstddef>

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {

template <class V>
HWY_INLINE V ExactMulAdd(V a, V b, V c) {
  namespace hn = hwy::HWY_NAMESPACE;
#if HWY_NATIVE_FMA
  return hn::MulAdd(a, b, c);
#else
  using T = hn::TFromV<V>;
  const hn::DFromV<V> d;
  alignas(64) T la[HWY_MAX_BYTES / sizeof(T)], lb[HWY_MAX_BYTES / sizeof(T)], lc[HWY_MAX_BYTES / sizeof(T)];
  hn::StoreU(a, d, la), hn::StoreU(b, d, lb), hn::StoreU(c, d, lc);
  for (size_t i = 0; i < hn::Lanes(d); ++i) la[i] = std::fma(la[i], lb[i], lc[i]);
  return hn::LoadU(d, la);
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_KERNELS_EXACT_FMA_INL_H_
