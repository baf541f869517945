#pragma once
// Row kernels vectorised with Google Highway (runtime dispatch to the best SIMD target). Each
// call works on one contiguous row, serially: callers parallelise over rows, so results never
// depend on the thread count. Tails use masked loads, so every element takes the same path.
#include <cstdint>

namespace moe {

float row_max(const float* x, int64_t n);
// x[i] = exp(x[i] - shift); returns the sum of the new values.
double exp_shift_sum(float* x, int64_t n, float shift);
void scale_row(float* x, int64_t n, float s);
void sigmoid_row(const float* x, float* y, int64_t n);
// h = silu(g) * u
void swiglu_row(const float* g, const float* u, float* h, int64_t n);
// dg = dh * u * silu'(g), du = dh * silu(g); outputs may alias g and u.
void swiglu_backward_row(const float* g, const float* u, const float* dh, float* dg, float* du,
                         int64_t n);
// DeepSeek-V4's clamped SwiGLU: h = silu(min(g, limit)) * clamp(u, -limit, limit), limit > 0.
// Where nothing is clamped the bits equal swiglu_row's.
void clamped_swiglu_row(const float* g, const float* u, float* h, int64_t n, float limit);
// Its gradient from the unclamped g and u: zero where the clamp was active (g > limit for dg,
// |u| > limit for du), as torch's clamp backward (the bounds themselves pass). Outputs may alias
// g and u.
void clamped_swiglu_backward_row(const float* g, const float* u, const float* dh, float* dg,
                                 float* du, int64_t n, float limit);

// y = x · rstd · w with rstd = 1/sqrt(mean(x²) + eps), returned.
float rmsnorm_row(const float* x, const float* w, float* y, int64_t n, float eps);
// dx of that row from dy: rstd·dy·w − (Σ dy·w·x)·rstd³/n · x.
void rmsnorm_backward_row(const float* x, const float* w, float rstd, const float* dy, float* dx,
                          int64_t n);

// One AdamW update of a row (torch.optim.AdamW's arithmetic): g is read as g * grad_scale;
// w *= decay; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²; w -= step_size · m / (√v / bc2_sqrt + eps).
// one_minus_beta1/2: 1 - beta computed in double from the configured beta and then rounded, as
// torch.optim.AdamW does (1.0f - float(beta) is off by 1.3e-5 relative at beta2 = 0.999).
// zero_grad: g is set to 0 as it is read, in the same pass (the trainer's next step needs zero
// gradients, and a pass of its own would write the whole model's gradients once more).
struct AdamWRowParams {
  float grad_scale, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt,
      eps;
  bool zero_grad = false;
};
void adamw_row(float* w, float* g, float* m, float* v, int64_t n, const AdamWRowParams& p);

// y[i] += x[i]
void add_row(float* y, const float* x, int64_t n);
// sums[j] = Σ_r double(dy[r·stride + j])·x[r·stride + j]·rstd[r] in double, r = 0..rows-1 in
// order, for j < n: each column one chain from +0, as the scalar loop would compute it
// (RMSNorm's weight gradient over a chunk of rows).
void scaled_product_column_sums(const float* x, const float* dy, const float* rstd, int64_t rows,
                                int64_t stride, int64_t n, double* sums);

// Σ x[i]² in double: lane l of 16 adds x[l]², x[l + 16]², ... in order, then the lanes meet in a
// fixed tree, so the bits are the same on every target.
double sum_of_squares(const float* x, int64_t n);
// sum_of_squares of kSquareRows rows (x[r], n[r] values each; n[r] = 0 gives 0) into out[r],
// the same bits row by row, read together: a pass over many rows reads about twice as fast.
inline constexpr int kSquareRows = 4;
void sums_of_squares(const float* const* x, const int64_t* n, double* out);
// Σ a[i]·b[i] in double, with the same lanes and tree.
double dot_product(const float* a, const float* b, int64_t n);
// Softmax backward of one row, in place over the probabilities: with d = float(dot_product(p, dp)),
// p[i] = scale · (p[i] · (dp[i] − d)), each operation rounded in that order. Returns the
// dot product (double), which some callers keep.
double softmax_backward_row(float* p, const float* dp, int64_t n, float scale);

// Numerically stable softmax of a row in place; returns log-sum-exp of the input.
double softmax_inplace(float* x, int64_t n);
// log(sum(exp(x))) without modifying x (uses `scratch` of n floats).
double log_sum_exp(const float* x, float* scratch, int64_t n);

}  // namespace moe
