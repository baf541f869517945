#include "moe/mxfp4_expert_weights.h"

#include "core/error.h"
#include "kernels/mxfp4.h"
#include "kernels/mxfp4_gemm_q8.h"

namespace moe {

void Mxfp4ExpertWeights::init(const std::string& prefix, ExpertRange experts, int64_t dim,
                              int64_t hidden, FfnKeys keys) {
  MOE_CHECK(experts.count >= 0 && dim > 0 && hidden > 0,
            "{}experts: bad shape (count {}, dim {}, hidden {})", prefix, experts.count, dim,
            hidden);
  MOE_CHECK(dim % mxfp4::kBlock == 0 && hidden % mxfp4::kBlock == 0,
            "{}experts: MXFP4 needs dim and hidden divisible by {}, got {} and {}", prefix,
            mxfp4::kBlock, dim, hidden);
  dim_ = dim;
  hidden_ = hidden;
  range_ = experts;
  const int64_t n = experts.count, B = mxfp4::kBlock;
  const int64_t gu_data = n * 2 * hidden * dim / 2, down_data = n * dim * hidden / 2;
  const int64_t gu_scales = n * 2 * hidden * dim / B, down_scales = n * dim * hidden / B;
  storage_ = Tensor::zeros({gu_data + down_data + gu_scales + down_scales}, DType::U8,
                           MemCategory::Weights);
  int64_t at = 0;
  auto take = [&](int64_t count, const Shape& shape) {
    Tensor t = storage_.narrow(at, count).view(shape);
    at += count;
    return t;
  };
  gate_up_data_ = take(gu_data, {n, 2 * hidden, dim / 2});
  down_data_ = take(down_data, {n, dim, hidden / 2});
  gate_up_scales_ = take(gu_scales, {n, 2 * hidden, dim / B});
  down_scales_ = take(down_scales, {n, dim, hidden / B});

  params_.assign(static_cast<size_t>(6 * n), Param{});
  for (int64_t e = 0; e < n; ++e) {
    const std::string key = prefix + "experts." + std::to_string(experts.first + e) + ".";
    const Tensor gu_d = gate_up_data_.narrow(e, 1).view({2 * hidden, dim / 2});
    const Tensor gu_s = gate_up_scales_.narrow(e, 1).view({2 * hidden, dim / B});
    const Tensor views[6] = {gu_d.narrow(0, hidden),
                             gu_s.narrow(0, hidden),
                             gu_d.narrow(hidden, hidden),
                             gu_s.narrow(hidden, hidden),
                             down_data_.narrow(e, 1).view({dim, hidden / 2}),
                             down_scales_.narrow(e, 1).view({dim, hidden / B})};
    for (int m = 0; m < 3; ++m) {
      for (int k = 0; k < 2; ++k) {
        Param& p = params_[static_cast<size_t>(6 * e + 2 * m + k)];
        p.name = key + ffn_key(keys, m) + (k == 0 ? ".weight" : ".scale");
        p.value = views[2 * m + k];
        p.format = k == 0 ? ParamFormat::Mxfp4Data : ParamFormat::Mxfp4Scales;
        p.trainable = false;
        p.weight_decay = false;
      }
    }
  }
}

Mxfp4Matrix Mxfp4ExpertWeights::matrix(int64_t e, int part) const {
  const Param& data = params_[static_cast<size_t>(6 * e + 2 * part)];
  const Param& scales = params_[static_cast<size_t>(6 * e + 2 * part + 1)];
  const int64_t rows = data.value.dim(0), cols = 2 * data.value.dim(1);
  return {data.value.u8(), scales.value.u8(), rows, cols, cols / 2, cols / mxfp4::kBlock};
}

namespace {

// Rows [r0, r0 + rn) of W.
Mxfp4Matrix row_range(Mxfp4Matrix w, int64_t r0, int64_t rn) {
  w.packed += r0 * w.packed_stride;
  w.scales += r0 * w.scale_stride;
  w.rows = rn;
  return w;
}

// Columns [c0, c0 + cn) of W (c0 a multiple of 32).
Mxfp4Matrix col_range(Mxfp4Matrix w, int64_t c0, int64_t cn) {
  w.packed += c0 / 2;
  w.scales += c0 / mxfp4::kBlock;
  w.cols = cn;
  return w;
}

}  // namespace

void Mxfp4ExpertWeights::times_weight_t(int64_t e, int part, int64_t m, const float* x,
                                        int64_t ldx, int64_t c0, int64_t cn, float* y,
                                        int64_t ldy, ExpertActivations activations) const {
  const Mxfp4Matrix w = row_range(matrix(e, part), c0, cn);
  if (activations == ExpertActivations::Int8)
    mxfp4_gemm_nt_q8(m, x, ldx, w, y, ldy, false);
  else
    mxfp4_gemm_nt(m, x, ldx, w, y, ldy, false);
}

void Mxfp4ExpertWeights::times_weight(int64_t e, int part, int64_t m, const float* dy,
                                      int64_t lddy, int64_t c0, int64_t cn, float* dx,
                                      int64_t lddx, bool accumulate) const {
  mxfp4_gemm_nn(m, dy, lddy, col_range(matrix(e, part), c0, cn), dx, lddx, accumulate);
}

void Mxfp4ExpertWeights::gate_up_backward_weight(const ExpertSegments&, const float*,
                                                 const float*, const float*) {
  fail("internal: MXFP4 experts are frozen and have no weight gradient");
}

void Mxfp4ExpertWeights::down_backward_weight(const ExpertSegments&, const float*, const float*) {
  fail("internal: MXFP4 experts are frozen and have no weight gradient");
}

void Mxfp4ExpertWeights::collect(ParamList& out) {
  for (Param& p : params_) out.push_back(&p);
}

}  // namespace moe
