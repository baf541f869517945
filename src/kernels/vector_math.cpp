#include "kernels/vector_math.h"

// Same bits on every SIMD target: every operation is lane-wise IEEE arithmetic (the exp below
// uses only exactly specified operations, with fused multiply-adds that the scalar target runs
// through std::fma), and sums over a row run in 16 virtual lanes — the AVX-512 vector, two AVX2
// vectors, or 16 scalars — reduced by one fixed tree.

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/simd.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/vector_math.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "kernels/exact_fma-inl.h"

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

// e^x with about 1 ulp error: x = n·ln2 + r (|r| ≤ ln2/2, n rounded to nearest even), e^r by a
// degree-7 Taylor polynomial in Horner form, then 2^n applied as two exact power-of-two factors
// so subnormal results round once. x ≥ 88.73 gives +inf, x ≤ -104 gives 0, NaN stays NaN.
HWY_INLINE V exp(V x_in) {
  const D d;
  const hn::RebindToSigned<D> di;
  const V x = hn::Min(hn::Max(x_in, hn::Set(d, -104.0f)), hn::Set(d, 89.0f));
  const V n = hn::Round(hn::Mul(x, hn::Set(d, 1.44269504088896341f)));
  V r = ExactMulAdd(n, hn::Set(d, -0.693145751953125f), x);  // ln2 high part: n·hi is exact
  r = ExactMulAdd(n, hn::Set(d, -1.42860682030941723212e-6f), r);
  V p = hn::Set(d, 1.0f / 5040.0f);
  p = ExactMulAdd(p, r, hn::Set(d, 1.0f / 720.0f));
  p = ExactMulAdd(p, r, hn::Set(d, 1.0f / 120.0f));
  p = ExactMulAdd(p, r, hn::Set(d, 1.0f / 24.0f));
  p = ExactMulAdd(p, r, hn::Set(d, 1.0f / 6.0f));
  p = ExactMulAdd(p, r, hn::Set(d, 0.5f));
  p = ExactMulAdd(p, r, hn::Set(d, 1.0f));
  p = ExactMulAdd(p, r, hn::Set(d, 1.0f));
  const auto ni = hn::ConvertTo(di, n);
  const auto n1 = hn::ShiftRight<1>(ni), n2 = hn::Sub(ni, n1);
  const auto bias = hn::Set(di, 127);
  const V s1 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(n1, bias)));
  const V s2 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(n2, bias)));
  // Min/Max would turn a NaN into a bound.
  return hn::IfThenElse(hn::IsNaN(x_in), x_in, hn::Mul(hn::Mul(p, s1), s2));
}

HWY_INLINE V sigmoid(V x) {
  const D d;
  const V one = hn::Set(d, 1.0f);
  return hn::Div(one, hn::Add(one, exp(hn::Neg(x))));
}

// The 16 virtual lanes' sums added by the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).
template <typename T>
HWY_INLINE T fold16(T* lanes) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// Sum of f(i, mask) over [0, n) in 16 virtual lanes: lane l adds the values at l, l + 16, ...
// in order; the lanes are then added by the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).
template <typename F>
HWY_INLINE float sum16(int64_t n, F&& f) {
  const D d;
  constexpr int64_t kLanes = static_cast<int64_t>(hn::MaxLanes(D()));
  static_assert(16 % kLanes == 0, "16 virtual lanes must be whole vectors");
  constexpr int64_t kParts = 16 / kLanes;
  V acc[kParts];
  for (int64_t q = 0; q < kParts; ++q) acc[q] = hn::Zero(d);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int64_t q = 0; q < kParts; ++q)
      acc[q] = hn::Add(acc[q], f(i + q * kLanes, hn::FirstN(d, kLanes), false));
  for (int64_t q = 0; q < kParts && i + q * kLanes < n; ++q) {
    const auto m = hn::FirstN(d, static_cast<size_t>(std::min(kLanes, n - i - q * kLanes)));
    acc[q] = hn::Add(acc[q], hn::IfThenElseZero(m, f(i + q * kLanes, m, true)));
  }
  alignas(64) float lanes[16];
  for (int64_t q = 0; q < kParts; ++q) hn::Store(acc[q], d, lanes + q * kLanes);
  return fold16(lanes);
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
  return static_cast<double>(sum16(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V e = exp(hn::Sub(load(x + i, k, tail), s));
    store(e, x + i, k, tail);
    return e;
  }));
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

void ClampedSwigluRow(const float* g, const float* u, float* h, int64_t n, float limit) {
  const D d;
  const V hi = hn::Set(d, limit), lo = hn::Set(d, -limit);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V gv = hn::Min(load(g + i, k, tail), hi);
    const V uv = hn::Min(hn::Max(load(u + i, k, tail), lo), hi);
    store(hn::Mul(hn::Mul(gv, sigmoid(gv)), uv), h + i, k, tail);
  });
}

void ClampedSwigluBackwardRow(const float* g, const float* u, const float* dh, float* dg,
                              float* du, int64_t n, float limit) {
  const D d;
  const V one = hn::Set(d, 1.0f), hi = hn::Set(d, limit), lo = hn::Set(d, -limit);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V graw = load(g + i, k, tail), uraw = load(u + i, k, tail), dv = load(dh + i, k, tail);
    const auto g_free = hn::Le(graw, hi);
    const auto u_free = hn::And(hn::Ge(uraw, lo), hn::Le(uraw, hi));
    const V gv = hn::Min(graw, hi);
    const V uv = hn::Min(hn::Max(uraw, lo), hi);
    const V s = sigmoid(gv);
    const V dsilu = hn::Mul(s, hn::Add(one, hn::Mul(gv, hn::Sub(one, s))));
    store(hn::IfThenElseZero(g_free, hn::Mul(hn::Mul(dv, uv), dsilu)), dg + i, k, tail);
    store(hn::IfThenElseZero(u_free, hn::Mul(dv, hn::Mul(gv, s))), du + i, k, tail);
  });
}

float RmsnormRow(const float* x, const float* w, float* y, int64_t n, float eps) {
  const D d;
  const float ss = sum16(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V xv = load(x + i, k, tail);
    return hn::Mul(xv, xv);
  });
  const float rs = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ss) / static_cast<double>(n) + eps));
  const V rsv = hn::Set(d, rs);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    store(hn::Mul(hn::Mul(load(x + i, k, tail), rsv), load(w + i, k, tail)), y + i, k, tail);
  });
  return rs;
}

void RmsnormBackwardRow(const float* x, const float* w, float rs, const float* dy, float* dx, int64_t n) {
  const D d;
  const float dot = sum16(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    return hn::Mul(hn::Mul(load(dy + i, k, tail), load(w + i, k, tail)), load(x + i, k, tail));
  });
  const double r = rs;
  const V c = hn::Set(d, static_cast<float>(static_cast<double>(dot) * r * r * r / static_cast<double>(n)));
  const V rsv = hn::Set(d, rs);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V g = hn::Mul(hn::Mul(rsv, load(dy + i, k, tail)), load(w + i, k, tail));
    store(hn::Sub(g, hn::Mul(c, load(x + i, k, tail))), dx + i, k, tail);
  });
}

// Σ double(a[i])·b[i] in 16 double lanes as sum16 (lane l adds i = l, l + 16, ... in order; each
// product of two floats is exact in double, the lanes' sums round), then fold16's tree. The 16
// lanes are kDotParts vectors; add16 takes one group of 16 values, finish16 the last values
// (fewer than 16) and the tree, so every caller has the same arithmetic by construction.
using DD = hn::ScalableTag<double>;
using VD = hn::Vec<DD>;
constexpr int64_t kDotLanes = static_cast<int64_t>(hn::MaxLanes(DD()));
static_assert(16 % kDotLanes == 0, "16 virtual lanes must be whole vectors");
constexpr int64_t kDotParts = 16 / kDotLanes;

HWY_INLINE void add16(VD* acc, const float* a, const float* b) {
  const DD dd;
  const hn::Rebind<float, DD> df;
  for (int64_t q = 0; q < kDotParts; ++q) {
    const VD va = hn::PromoteTo(dd, hn::LoadU(df, a + q * kDotLanes));
    const VD vb = hn::PromoteTo(dd, hn::LoadU(df, b + q * kDotLanes));
    acc[q] = hn::Add(acc[q], hn::Mul(va, vb));
  }
}

// The lanes in acc plus a[k]·b[k] for k in [i, n) (n - i < 16), folded.
HWY_INLINE double finish16(const VD* acc, const float* a, const float* b, int64_t i, int64_t n) {
  alignas(64) double lanes[16];
  for (int64_t q = 0; q < kDotParts; ++q) hn::Store(acc[q], DD(), lanes + q * kDotLanes);
  for (int64_t j = i; j < n; ++j) lanes[j - i] += static_cast<double>(a[j]) * b[j];
  return fold16(lanes);
}

HWY_INLINE double dot16(const float* a, const float* b, int64_t n) {
  VD acc[kDotParts];
  for (int64_t q = 0; q < kDotParts; ++q) acc[q] = hn::Zero(DD());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) add16(acc, a + i, b + i);
  return finish16(acc, a, b, i, n);
}

double SumOfSquaresRow(const float* x, int64_t n) { return dot16(x, x, n); }

// sum_of_squares of kSquareRows rows at once, each with dot16's operations in dot16's order:
// the rows are read interleaved, several streams per core, where one row at a time is one
// stream, which keeps too few lines in flight to read more than about half the DRAM bandwidth
// (docs/PERF.md, session 34). On 256-bit vectors a row's 16 lanes take 4 accumulators, so the
// rows go 2 at a time there, to stay within 16 registers.
void SumsOfSquaresRows(const float* const* x, const int64_t* n, double* out) {
  constexpr int kTogether = kDotParts <= 2 ? 4 : 2;
  static_assert(kSquareRows % kTogether == 0, "rows go in whole groups");
  for (int g = 0; g < kSquareRows; g += kTogether) {
    VD acc[kTogether][kDotParts];
    int64_t common = n[g];
    for (int r = 0; r < kTogether; ++r) {
      common = std::min(common, n[g + r]);
      for (int64_t q = 0; q < kDotParts; ++q) acc[r][q] = hn::Zero(DD());
    }
    int64_t i = 0;
    for (; i + 16 <= common; i += 16)
#pragma GCC unroll 4
      for (int r = 0; r < kTogether; ++r) add16(acc[r], x[g + r] + i, x[g + r] + i);
    for (int r = 0; r < kTogether; ++r) {
      const float* row = x[g + r];
      int64_t j = i;
      for (; j + 16 <= n[g + r]; j += 16) add16(acc[r], row + j, row + j);
      out[g + r] = finish16(acc[r], row, row, j, n[g + r]);
    }
  }
}
double DotProductRow(const float* a, const float* b, int64_t n) { return dot16(a, b, n); }

double SoftmaxBackwardRow(float* p, const float* dp, int64_t n, float scale) {
  const D d;
  const double dot = dot16(p, dp, n);
  const V rowdot = hn::Set(d, static_cast<float>(dot)), sv = hn::Set(d, scale);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V pv = load(p + i, k, tail);
    store(hn::Mul(sv, hn::Mul(pv, hn::Sub(load(dp + i, k, tail), rowdot))), p + i, k, tail);
  });
  return dot;
}

void AddRow(float* y, const float* x, int64_t n) {
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    store(hn::Add(load(y + i, k, tail), load(x + i, k, tail)), y + i, k, tail);
  });
}

void ScaledProductColumnSums(const float* x, const float* dy, const float* rstd, int64_t rows,
                             int64_t stride, int64_t n, double* sums) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(dd));
  const int64_t whole = n / lanes * lanes;
  for (int64_t j = 0; j < n; ++j) sums[j] = 0.0;
  // Row by row, each row's columns in one contiguous run, the running sums in `sums` (L1):
  // walking a narrow column block down the rows instead waits on a cache miss per row.
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * stride;
    const float* dyr = dy + r * stride;
    const auto rs = hn::Set(dd, static_cast<double>(rstd[r]));
    for (int64_t j = 0; j < whole; j += lanes) {
      const auto p = hn::Mul(hn::PromoteTo(dd, hn::LoadU(df, dyr + j)), hn::PromoteTo(dd, hn::LoadU(df, xr + j)));
      hn::StoreU(hn::Add(hn::LoadU(dd, sums + j), hn::Mul(p, rs)), dd, sums + j);
    }
    for (int64_t j = whole; j < n; ++j)
      sums[j] += static_cast<double>(dyr[j]) * xr[j] * static_cast<double>(rstd[r]);
  }
}

template <bool kZeroGrad>
HWY_INLINE void AdamWRowImpl(float* w, float* g, float* m, float* v, int64_t n,
                             const AdamWRowParams& p) {
  const D d;
  const V scale = hn::Set(d, p.grad_scale), decay = hn::Set(d, p.decay);
  const V b1 = hn::Set(d, p.beta1), b2 = hn::Set(d, p.beta2);
  const V one_b1 = hn::Set(d, p.one_minus_beta1), one_b2 = hn::Set(d, p.one_minus_beta2);
  const V step = hn::Set(d, p.step_size), bc2 = hn::Set(d, p.bc2_sqrt), eps = hn::Set(d, p.eps);
  for_lanes(n, [&](int64_t i, hn::Mask<D> k, bool tail) {
    const V gv = hn::Mul(load(g + i, k, tail), scale);
    if constexpr (kZeroGrad) store(hn::Zero(d), g + i, k, tail);
    const V mv = hn::Add(hn::Mul(load(m + i, k, tail), b1), hn::Mul(gv, one_b1));
    const V vv = hn::Add(hn::Mul(load(v + i, k, tail), b2), hn::Mul(hn::Mul(gv, gv), one_b2));
    const V denom = hn::Add(hn::Div(hn::Sqrt(vv), bc2), eps);
    const V wv = hn::Mul(load(w + i, k, tail), decay);
    store(mv, m + i, k, tail);
    store(vv, v + i, k, tail);
    store(hn::Sub(wv, hn::Mul(step, hn::Div(mv, denom))), w + i, k, tail);
  });
}

void AdamWRow(float* w, float* g, float* m, float* v, int64_t n, const AdamWRowParams& p) {
  if (p.zero_grad) AdamWRowImpl<true>(w, g, m, v, n, p);
  else AdamWRowImpl<false>(w, g, m, v, n, p);
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
HWY_EXPORT(ClampedSwigluRow);
HWY_EXPORT(ClampedSwigluBackwardRow);
HWY_EXPORT(AdamWRow);
HWY_EXPORT(SumOfSquaresRow);
HWY_EXPORT(SumsOfSquaresRows);
HWY_EXPORT(DotProductRow);
HWY_EXPORT(SoftmaxBackwardRow);
HWY_EXPORT(RmsnormRow);
HWY_EXPORT(RmsnormBackwardRow);
HWY_EXPORT(AddRow);
HWY_EXPORT(ScaledProductColumnSums);

void add_row(float* y, const float* x, int64_t n) { MOE_DISPATCH(AddRow)(y, x, n); }
void scaled_product_column_sums(const float* x, const float* dy, const float* rstd, int64_t rows,
                                int64_t stride, int64_t n, double* sums) {
  MOE_DISPATCH(ScaledProductColumnSums)(x, dy, rstd, rows, stride, n, sums);
}

float rmsnorm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  return MOE_DISPATCH(RmsnormRow)(x, w, y, n, eps);
}
void rmsnorm_backward_row(const float* x, const float* w, float rstd, const float* dy, float* dx,
                          int64_t n) {
  MOE_DISPATCH(RmsnormBackwardRow)(x, w, rstd, dy, dx, n);
}

void adamw_row(float* w, float* g, float* m, float* v, int64_t n, const AdamWRowParams& p) {
  MOE_DISPATCH(AdamWRow)(w, g, m, v, n, p);
}

double sum_of_squares(const float* x, int64_t n) { return MOE_DISPATCH(SumOfSquaresRow)(x, n); }
void sums_of_squares(const float* const* x, const int64_t* n, double* out) {
  MOE_DISPATCH(SumsOfSquaresRows)(x, n, out);
}
double dot_product(const float* a, const float* b, int64_t n) {
  return MOE_DISPATCH(DotProductRow)(a, b, n);
}
double softmax_backward_row(float* p, const float* dp, int64_t n, float scale) {
  return MOE_DISPATCH(SoftmaxBackwardRow)(p, dp, n, scale);
}

float row_max(const float* x, int64_t n) { return MOE_DISPATCH(RowMax)(x, n); }
double exp_shift_sum(float* x, int64_t n, float shift) {
  return MOE_DISPATCH(ExpShiftSum)(x, n, shift);
}
void scale_row(float* x, int64_t n, float s) { MOE_DISPATCH(ScaleRow)(x, n, s); }
void sigmoid_row(const float* x, float* y, int64_t n) { MOE_DISPATCH(SigmoidRow)(x, y, n); }
void swiglu_row(const float* g, const float* u, float* h, int64_t n) {
  MOE_DISPATCH(SwigluRow)(g, u, h, n);
}
void swiglu_backward_row(const float* g, const float* u, const float* dh, float* dg, float* du,
                         int64_t n) {
  MOE_DISPATCH(SwigluBackwardRow)(g, u, dh, dg, du, n);
}
void clamped_swiglu_row(const float* g, const float* u, float* h, int64_t n, float limit) {
  MOE_DISPATCH(ClampedSwigluRow)(g, u, h, n, limit);
}
void clamped_swiglu_backward_row(const float* g, const float* u, const float* dh, float* dg,
                                 float* du, int64_t n, float limit) {
  MOE_DISPATCH(ClampedSwigluBackwardRow)(g, u, dh, dg, du, n, limit);
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
