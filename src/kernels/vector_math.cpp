#include "kernels/vector_math.h"

#include <cmath>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/vector_math.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// Applies `op(i, mask)` over [0, n) in whole vectors plus one masked tail vector.
template <typename Op>
HWY_INLINE void for_lanes(int64_t n, Op&& op) {
  const D d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) op(i, hn::FirstN(d, static_cast<size_t>(N)), false);
  if (i < n) op(i, hn::FirstN(d, static_cast<size_t>(n - i)), true);
}

HWY_INLINE V load(const float* p, hn::Mask<D> m, bool tail) {
  const D d;
  return tail ? hn::MaskedLoad(m, d, p) : hn::LoadU(d, p);
}

HWY_INLINE void store(V v, float* p, hn::Mask<D> m, bool tail) {
  const D d;
  if (tail)
    hn::BlendedStore(v, m, d, p);
  else
    hn::StoreU(v, d, p);
}

HWY_INLINE V sigmoid(V x) {
  const D d;
  const V one = hn::Set(d, 1.0f);
  return hn::Div(one, hn::Add(one, hn::Exp(d, hn::Neg(x))));
}

float RowMax(const float* x, int64_t n) {
  const D d;
  V m = hn::Set(d, -INFINITY);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    m = hn::IfThenElse(k, hn::Max(m, load(x + i, k, tail)), m);
  });
  return hn::GetLane(hn::MaxOfLanes(d, m));
}

double ExpShiftSum(float* x, int64_t n, float shift) {
  const D d;
  const V s = hn::Set(d, shift);
  V acc = hn::Zero(d);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V e = hn::IfThenElseZero(k, hn::Exp(d, hn::Sub(load(x + i, k, tail), s)));
    store(e, x + i, k, tail);
    acc = hn::Add(acc, e);
  });
  return static_cast<double>(hn::GetLane(hn::SumOfLanes(d, acc)));
}

void ScaleRow(float* x, int64_t n, float s) {
  const D d;
  const V sv = hn::Set(d, s);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    store(hn::Mul(load(x + i, k, tail), sv), x + i, k, tail);
  });
}

void SigmoidRow(const float* x, float* y, int64_t n) {
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    store(sigmoid(load(x + i, k, tail)), y + i, k, tail);
  });
}

void SwigluRow(const float* g, const float* u, float* h, int64_t n) {
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V gv = load(g + i, k, tail);
    store(hn::Mul(hn::Mul(gv, sigmoid(gv)), load(u + i, k, tail)), h + i, k, tail);
  });
}

void SwigluBackwardRow(const float* g, const float* u, const float* dh, float* dg, float* du,
                       int64_t n) {
  const D d;
  const V one = hn::Set(d, 1.0f);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V gv = load(g + i, k, tail), uv = load(u + i, k, tail), dv = load(dh + i, k, tail);
    const V s = sigmoid(gv);
    const V dsilu = hn::Mul(s, hn::Add(one, hn::Mul(gv, hn::Sub(one, s))));
    store(hn::Mul(hn::Mul(dv, uv), dsilu), dg + i, k, tail);
    store(hn::Mul(dv, hn::Mul(gv, s)), du + i, k, tail);
  });
}

void AdamWRow(float* w, const float* g, float* m, float* v, int64_t n, const AdamWRowParams& p) {
  const D d;
  const V scale = hn::Set(d, p.grad_scale), decay = hn::Set(d, p.decay);
  const V b1 = hn::Set(d, p.beta1), b2 = hn::Set(d, p.beta2);
  const V one_b1 = hn::Set(d, 1.0f - p.beta1), one_b2 = hn::Set(d, 1.0f - p.beta2);
  const V step = hn::Set(d, p.step_size), bc2 = hn::Set(d, p.bc2_sqrt), eps = hn::Set(d, p.eps);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V gv = hn::Mul(load(g + i, k, tail), scale);
    const V mv = hn::Add(hn::Mul(load(m + i, k, tail), b1), hn::Mul(gv, one_b1));
    const V vv = hn::Add(hn::Mul(load(v + i, k, tail), b2), hn::Mul(hn::Mul(gv, gv), one_b2));
    const V denom = hn::Add(hn::Div(hn::Sqrt(vv), bc2), eps);
    const V wv = hn::Mul(load(w + i, k, tail), decay);
    store(mv, m + i, k, tail);
    store(vv, v + i, k, tail);
    store(hn::Sub(wv, hn::Mul(step, hn::Div(mv, denom))), w + i, k, tail);
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe {

HWY_EXPORT(RowMax);
HWY_EXPORT(ExpShiftSum);
HWY_EXPORT(ScaleRow);
HWY_EXPORT(SigmoidRow);
HWY_EXPORT(SwigluRow);
HWY_EXPORT(SwigluBackwardRow);
HWY_EXPORT(AdamWRow);

void adamw_row(float* w, const float* g, float* m, float* v, int64_t n, const AdamWRowParams& p) {
  HWY_DYNAMIC_DISPATCH(AdamWRow)(w, g, m, v, n, p);
}

float row_max(const float* x, int64_t n) { return HWY_DYNAMIC_DISPATCH(RowMax)(x, n); }
double exp_shift_sum(float* x, int64_t n, float shift) {
  return HWY_DYNAMIC_DISPATCH(ExpShiftSum)(x, n, shift);
}
void scale_row(float* x, int64_t n, float s) { HWY_DYNAMIC_DISPATCH(ScaleRow)(x, n, s); }
void sigmoid_row(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(SigmoidRow)(x, y, n); }
void swiglu_row(const float* g, const float* u, float* h, int64_t n) {
  HWY_DYNAMIC_DISPATCH(SwigluRow)(g, u, h, n);
}
void swiglu_backward_row(const float* g, const float* u, const float* dh, float* dg, float* du,
                         int64_t n) {
  HWY_DYNAMIC_DISPATCH(SwigluBackwardRow)(g, u, dh, dg, du, n);
}

double softmax_inplace(float* x, int64_t n) {
  if (n <= 0) return -INFINITY;
  const float mx = row_max(x, n);
  const double sum = exp_shift_sum(x, n, mx);
  scale_row(x, n, static_cast<float>(1.0 / sum));
  return static_cast<double>(mx) + std::log(sum);
}

double log_sum_exp(const float* x, float* scratch, int64_t n) {
  if (n <= 0) return -INFINITY;
  const float mx = row_max(x, n);
  for (int64_t i = 0; i < n; ++i) scratch[i] = x[i];
  return static_cast<double>(mx) + std::log(exp_shift_sum(scratch, n, mx));
}

}  // namespace moe
#endif  // HWY_ONCE
