#include "moe/expert_weights.h"

#include <algorithm>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm.h"

namespace moe {

namespace {

// Work-item extents, constants so the decomposition depends on shapes and row counts only.
// An item is one expert's row block against a whole projection (gate, up or down): packing
// costs (rows + cols)·K per item, so wide items keep it small next to the 2·rows·cols·K FLOPs,
// and 512-row blocks still cut the heaviest expert of a skewed batch into several items.
// Measured at dim 1024 / width 704 / 64 experts (bench_moe, 2 threads): 256x256 items reached
// 0.71 of the dense rate, 512 x whole width 0.81-0.85.
constexpr int64_t kRowBlock = 512;
constexpr int64_t kColBlock = 4096;

struct Item {
  int64_t expert, part, r0, rn, c0, cn, cost;
};

// Items in a fixed order (largest first, ties by construction order) so the schedule, while
// free to map items to any thread, never changes what an item computes.
template <typename F>
void run_items(std::vector<Item>& items, F&& body) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  parallel_for_dynamic(0, static_cast<int64_t>(items.size()),
                       [&](int64_t i) { body(items[static_cast<size_t>(i)]); });
}

// Items over the output [rows of expert e, N] for `parts` outputs; K is the contraction length.
std::vector<Item> row_items(const ExpertSegments& seg, int64_t parts, int64_t N, int64_t K) {
  std::vector<Item> items;
  for (int64_t e = 0; e < seg.experts(); ++e)
    for (int64_t r0 = 0; r0 < seg.rows(e); r0 += kRowBlock)
      for (int64_t p = 0; p < parts; ++p)
        for (int64_t c0 = 0; c0 < N; c0 += kColBlock) {
          const int64_t rn = std::min(kRowBlock, seg.rows(e) - r0),
                        cn = std::min(kColBlock, N - c0);
          items.push_back({e, p, r0, rn, c0, cn, rn * cn * K});
        }
  return items;
}

// Items over a weight gradient [M, N] per expert and part; the contraction runs over the
// expert's rows (possibly none: the gradient is then left untouched, exactly zero if unused).
std::vector<Item> weight_items(const ExpertSegments& seg, int64_t parts, int64_t M, int64_t N) {
  std::vector<Item> items;
  for (int64_t e = 0; e < seg.experts(); ++e)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t r0 = 0; r0 < M; r0 += kColBlock)
        for (int64_t c0 = 0; c0 < N; c0 += kColBlock) {
          const int64_t rn = std::min(kColBlock, M - r0), cn = std::min(kColBlock, N - c0);
          items.push_back({e, p, r0, rn, c0, cn, rn * cn * seg.rows(e)});
        }
  return items;
}

}  // namespace

ExpertSegments ExpertSegments::from(const Handle& handle) {
  ExpertSegments s;
  const int64_t n = handle.experts().count;
  s.offsets.resize(static_cast<size_t>(n + 1));
  for (int64_t e = 0; e <= n; ++e) s.offsets[static_cast<size_t>(e)] = handle.offsets()[e];
  return s;
}


// The input-side products of every store: the same work items, whatever the storage.

void ExpertWeights::gate_up_forward(const ExpertSegments& seg, const float* x, float* g,
                                    float* u, ExpertActivations activations) const {
  const int64_t D = dim(), H = hidden();
  auto items = row_items(seg, 2, H, D);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    float* out = it.part == 0 ? g : u;
    times_weight_t(it.expert, static_cast<int>(it.part), it.rn, x + row * D, D, it.c0, it.cn,
                   out + row * H + it.c0, H, activations);
  });
}

void ExpertWeights::down_forward(const ExpertSegments& seg, const float* h, float* y,
                                 ExpertActivations activations) const {
  const int64_t D = dim(), H = hidden();
  auto items = row_items(seg, 1, D, H);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    times_weight_t(it.expert, 2, it.rn, h + row * H, H, it.c0, it.cn, y + row * D + it.c0, D,
                   activations);
  });
}

void ExpertWeights::down_backward_input(const ExpertSegments& seg, const float* dy,
                                        float* dh) const {
  const int64_t D = dim(), H = hidden();
  auto items = row_items(seg, 1, H, D);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    times_weight(it.expert, 2, it.rn, dy + row * D, D, it.c0, it.cn, dh + row * H + it.c0, H,
                 false);
  });
}

void ExpertWeights::gate_up_backward_input(const ExpertSegments& seg, const float* dg,
                                           const float* du, float* dx) const {
  const int64_t D = dim(), H = hidden();
  auto items = row_items(seg, 1, D, 2 * H);
  run_items(items, [&](const Item& it) {
    const int64_t row = seg.begin(it.expert) + it.r0;
    float* out = dx + row * D + it.c0;
    // Gate then up into the same tile: a fixed two-term order.
    times_weight(it.expert, 0, it.rn, dg + row * H, H, it.c0, it.cn, out, D, false);
    times_weight(it.expert, 1, it.rn, du + row * H, H, it.c0, it.cn, out, D, true);
  });
}

void DenseExpertWeights::init(const std::string& prefix, ExpertRange experts, int64_t dim,
                              int64_t hidden, FfnKeys keys) {
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
    gate(e).name = key + ffn_key(keys, 0) + ".weight";
    gate(e).value = gu_e.narrow(0, hidden);
    up(e).name = key + ffn_key(keys, 1) + ".weight";
    up(e).value = gu_e.narrow(hidden, hidden);
    down(e).name = key + ffn_key(keys, 2) + ".weight";
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

void DenseExpertWeights::times_weight_t(int64_t e, int part, int64_t m, const float* x,
                                        int64_t ldx, int64_t c0, int64_t cn, float* y,
                                        int64_t ldy, ExpertActivations activations) const {
  MOE_CHECK(activations == ExpertActivations::Fp32,
            "internal: fp32 routed experts have no int8-activation forward (MXFP4 experts only)");
  const Param& w = matrix(e, part);
  const int64_t in = w.value.dim(1);
  gemm_nt_serial(m, cn, in, x, ldx, w.w() + c0 * in, in, y, ldy, false);
}

void DenseExpertWeights::times_weight(int64_t e, int part, int64_t m, const float* dy,
                                      int64_t lddy, int64_t c0, int64_t cn, float* dx,
                                      int64_t lddx, bool accumulate) const {
  const Param& w = matrix(e, part);
  gemm_nn_serial(m, cn, w.value.dim(0), dy, lddy, w.w() + c0, w.value.dim(1), dx, lddx,
                 accumulate);
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
