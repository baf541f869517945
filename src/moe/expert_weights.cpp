#include "moe/expert_weights.h"

#include <algorithm>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm.h"
#include "moe/expert_work_items.h"

namespace moe {

using namespace expert_items;

ExpertSegments ExpertSegments::from(const Handle& handle) {
  ExpertSegments s;
  const int64_t n = handle.experts().count;
  s.offsets.resize(static_cast<size_t>(n + 1));
  for (int64_t e = 0; e <= n; ++e) s.offsets[static_cast<size_t>(e)] = handle.offsets()[e];
  return s;
}


void DenseExpertWeights::init(const std::string& prefix, ExpertRange experts, int64_t dim,
                              int64_t hidden) {
  MOE_CHECK(experts.count >= 0 && dim > 0 && hidden > 0,
            "{}experts: bad shape (count {}, dim {}, hidden {})", prefix, experts.count, dim,
            hidden);
  dim_ = dim;
  hidden_ = hidden;
  range_ = experts;
  const int64_t n = experts.count, gu = n * 2 * hidden * dim;
  Tensor flat = Tensor::zeros({gu + n * dim * hidden}, DType::F32, MemCategory::Weights);
  gate_up_ = flat.narrow(0, gu).view({n, 2 * hidden, dim});
  down_ = flat.narrow(gu, n * dim * hidden).view({n, dim, hidden});
  params_.assign(static_cast<size_t>(3 * n), Param{});
  for (int64_t e = 0; e < n; ++e) {
    const std::string key = prefix + "experts." + std::to_string(experts.first + e) + ".";
    const Tensor gu_e = gate_up_.narrow(e, 1).view({2 * hidden, dim});
    gate(e).name = key + "gate_proj.weight";
    gate(e).value = gu_e.narrow(0, hidden);
    up(e).name = key + "up_proj.weight";
    up(e).value = gu_e.narrow(hidden, hidden);
    down(e).name = key + "down_proj.weight";
    down(e).value = down_.narrow(e, 1).view({dim, hidden});
  }
}

void DenseExpertWeights::collect(ParamList& out) {
  for (Param& p : params_) out.push_back(&p);
}

void DenseExpertWeights::freeze() {
  frozen_ = true;
  for (Param& p : params_) p.trainable = false;
}

void DenseExpertWeights::allocate_grads() {
  if (frozen_ || gate_up_grad_.defined()) return;
  const int64_t n = range_.count, gu = n * 2 * hidden_ * dim_;
  Tensor flat = Tensor::zeros({gu + n * dim_ * hidden_}, DType::F32, MemCategory::Grads);
  gate_up_grad_ = flat.narrow(0, gu).view({n, 2 * hidden_, dim_});
  down_grad_ = flat.narrow(gu, n * dim_ * hidden_).view({n, dim_, hidden_});
  for (int64_t e = 0; e < n; ++e) {
    const Tensor gu_e = gate_up_grad_.narrow(e, 1).view({2 * hidden_, dim_});
    gate(e).grad = gu_e.narrow(0, hidden_);
    up(e).grad = gu_e.narrow(hidden_, hidden_);
    down(e).grad = down_grad_.narrow(e, 1).view({dim_, hidden_});
  }
}

// The kernels read each Param's own tensor rather than the blocks, so a loader that replaces
// a value (or a trainer that allocated one grad on its own) still gets correct results; the
// blocks only make the common case contiguous.

void DenseExpertWeights::gate_up_forward(const ExpertSegments& seg, const float* x, float* g,
                                         float* u) const {
  const int64_t D = dim_, H = hidden_;
  auto items = row_items(seg, 2, H, D);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    const Param& w = it.part == 0 ? gate(it.expert) : up(it.expert);
    float* out = it.part == 0 ? g : u;
    gemm_nt_serial(it.rn, it.cn, D, x + row * D, D, w.w() + it.c0 * D, D, out + row * H + it.c0,
              H, false);
  });
}

void DenseExpertWeights::down_forward(const ExpertSegments& seg, const float* h, float* y) const {
  const int64_t D = dim_, H = hidden_;
  auto items = row_items(seg, 1, D, H);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    gemm_nt_serial(it.rn, it.cn, H, h + row * H, H, down(it.expert).w() + it.c0 * H, H,
              y + row * D + it.c0, D, false);
  });
}

void DenseExpertWeights::down_backward_input(const ExpertSegments& seg, const float* dy,
                                             float* dh) const {
  const int64_t D = dim_, H = hidden_;
  auto items = row_items(seg, 1, H, D);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    gemm_nn_serial(it.rn, it.cn, D, dy + row * D, D, down(it.expert).w() + it.c0, H,
              dh + row * H + it.c0, H, false);
  });
}

void DenseExpertWeights::gate_up_backward_input(const ExpertSegments& seg, const float* dg,
                                                const float* du, float* dx) const {
  const int64_t D = dim_, H = hidden_;
  auto items = row_items(seg, 1, D, 2 * H);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    float* out = dx + row * D + it.c0;
    // Gate then up into the same tile: a fixed two-term order.
    gemm_nn_serial(it.rn, it.cn, H, dg + row * H, H, gate(it.expert).w() + it.c0, D, out, D,
              false);
    gemm_nn_serial(it.rn, it.cn, H, du + row * H, H, up(it.expert).w() + it.c0, D, out, D, true);
  });
}

void DenseExpertWeights::gate_up_backward_weight(const ExpertSegments& seg, const float* dg,
                                                 const float* du, const float* x) {
  const int64_t D = dim_, H = hidden_;
  auto items = weight_items(seg, 2, H, D);
  run_items(items, [&](const Item& it) {
    const Param& w = it.part == 0 ? gate(it.expert) : up(it.expert);
    if (!w.grad.defined()) return;
    const int64_t row = seg.begin(it.expert);
    const float* d = (it.part == 0 ? dg : du) + row * H + it.r0;
    gemm_tn_serial(it.rn, it.cn, seg.rows(it.expert), d, H, x + row * D + it.c0, D,
              w.g() + it.r0 * D + it.c0, D, true);
  });
}

void DenseExpertWeights::down_backward_weight(const ExpertSegments& seg, const float* dy,
                                              const float* h) {
  const int64_t D = dim_, H = hidden_;
  auto items = weight_items(seg, 1, D, H);
  run_items(items, [&](const Item& it) {
    const Param& w = down(it.expert);
    if (!w.grad.defined()) return;
    const int64_t row = seg.begin(it.expert);
    gemm_tn_serial(it.rn, it.cn, seg.rows(it.expert), dy + row * D + it.r0, D,
              h + row * H + it.c0, H, w.g() + it.r0 * H + it.c0, H, true);
  });
}

}  // namespace moe
