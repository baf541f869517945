#include "parallel/all_to_all_dispatcher.h"

#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace moe {

namespace detail {

// One I32 Routing tensor: [T, k, send_rows[e], recv_rows[e], send_pos[T·k]]. send_pos[s] is
// the send-buffer row of slot s = t·k + j.
struct EpSendSide {
  const int32_t* state = nullptr;
  int e = 1;
  int64_t tokens() const { return state[0]; }
  int64_t top_k() const { return state[1]; }
  const int32_t* send_rows() const { return state + 2; }
  const int32_t* recv_rows() const { return state + 2 + e; }
  const int32_t* send_pos() const { return state + 2 + 2 * e; }
};

}  // namespace detail

namespace {

Tensor activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemCategory::Activations);
}

std::vector<int64_t> widen(const int32_t* p, int n) { return std::vector<int64_t>(p, p + n); }

// Per destination rank, the per-token rows of the slots it receives, in send order: slot s
// (token s / k) sits at send position send_pos[s], and rank d takes positions
// [Σ_{i<d} send_rows[i], +send_rows[d]).
std::vector<RowRuns> token_rows_by_destination(const int32_t* send_pos, const int32_t* send_rows,
                                               int e, int64_t slots, int64_t k) {
  std::vector<int32_t> token_at(static_cast<size_t>(slots));
  for (int64_t s = 0; s < slots; ++s) token_at[static_cast<size_t>(send_pos[s])] = static_cast<int32_t>(s / k);
  std::vector<RowRuns> runs(static_cast<size_t>(e));
  int64_t p = 0;
  for (int d = 0; d < e; ++d)
    for (int32_t n = 0; n < send_rows[d]; ++n, ++p) runs[static_cast<size_t>(d)].add(token_at[static_cast<size_t>(p)], 1);
  return runs;
}

// Per source rank, the expert-major rows its arrivals occupy: arrival p (source-rank-major
// order) is expert-major row row_of_arrival[p]; within one (source, expert) pair they are
// consecutive, so each pair is one run.
std::vector<RowRuns> expert_rows_by_source(const int32_t* row_of_arrival, const int32_t* recv_rows,
                                           int e) {
  std::vector<RowRuns> runs(static_cast<size_t>(e));
  int64_t p = 0;
  for (int src = 0; src < e; ++src)
    for (int32_t n = 0; n < recv_rows[src]; ++n, ++p) runs[static_cast<size_t>(src)].add(row_of_arrival[p], 1);
  return runs;
}

// Rank-ordered contiguous blocks of `rows[j]` rows each.
std::vector<RowRuns> contiguous_by_rank(const int32_t* rows, int e) {
  std::vector<RowRuns> runs(static_cast<size_t>(e));
  int32_t at = 0;
  for (int j = 0; j < e; ++j) runs[static_cast<size_t>(j)].add(at, rows[j]), at += rows[j];
  return runs;
}

}  // namespace

// The Handle builder: a LocalDispatcher whose "all experts" are this rank's experts.
class AllToAllDispatcher::HandleFactory final : public LocalDispatcher {
 public:
  ExpertRange range;
  ExpertRange local_experts(int64_t) const override { return range; }
};

AllToAllDispatcher::AllToAllDispatcher(std::shared_ptr<Communicator> ep_group)
    : comm_(std::move(ep_group)), factory_(std::make_unique<HandleFactory>()) {
  MOE_CHECK(comm_ != nullptr, "AllToAllDispatcher: no communicator");
}

AllToAllDispatcher::~AllToAllDispatcher() = default;

ExpertRange AllToAllDispatcher::local_experts(int64_t num_experts) const {
  const int64_t e = comm_->size(), r = comm_->rank();
  MOE_CHECK(num_experts >= e && num_experts % e == 0,
            "expert parallelism: {} routed experts cannot be split evenly over {} ranks",
            num_experts, e);
  const int64_t per = num_experts / e;
  return {r * per, per};
}

detail::EpSendSide AllToAllDispatcher::send_side(const Handle& handle, const char* op) const {
  MOE_CHECK(handle.live(),
            "{}: the dispatch handle was already released (backward after an evaluation "
            "forward, or a second backward)",
            op);
  MOE_CHECK(owner_of(handle) == this, "{}: the dispatch handle belongs to another dispatcher", op);
  return {extra_state(handle).i32(), comm_->size()};
}

Dispatched AllToAllDispatcher::dispatch(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                        int64_t num_experts) {
  check_dispatch_inputs(x, ids, weights, num_experts);
  const int64_t T = x.dim(0), dim = x.dim(1), k = ids.dim(1), slots = T * k;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  const int e = comm_->size();
  const ExpertRange local = local_experts(num_experts);
  const int64_t per = local.count, E = num_experts;
  const int32_t* id = ids.i32();
  MOE_CHECK(slots < kMax, "dispatch: {} token slots exceed the 32-bit row index", slots);

  // 1. Send order: stable counting sort by global expert (= destination rank, then expert).
  Tensor side = Tensor::empty({2 + 2 * static_cast<int64_t>(e) + slots}, DType::I32,
                              MemCategory::Routing);
  int32_t* st = side.i32();
  st[0] = static_cast<int32_t>(T);
  st[1] = static_cast<int32_t>(k);
  int32_t* send_rows = st + 2;
  int32_t* recv_rows = send_rows + e;
  int32_t* send_pos = recv_rows + e;
  std::vector<int64_t> per_expert(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < slots; ++s) ++per_expert[static_cast<size_t>(id[s])];
  {
    std::vector<int64_t> next(static_cast<size_t>(E), 0);
    int64_t acc = 0;
    for (int64_t g = 0; g < E; ++g) next[static_cast<size_t>(g)] = acc, acc += per_expert[g];
    for (int64_t s = 0; s < slots; ++s)
      send_pos[s] = static_cast<int32_t>(next[static_cast<size_t>(id[s])]++);
  }
  for (int d = 0; d < e; ++d) {
    int64_t n = 0;
    for (int64_t j = 0; j < per; ++j) n += per_expert[static_cast<size_t>(d * per + j)];
    send_rows[d] = static_cast<int32_t>(n);
  }

  // 2. Counts: block d of per_expert (experts of rank d) goes to rank d.
  std::vector<int64_t> from(static_cast<size_t>(e * per));
  comm_->all_to_all(per_expert.data(), from.data(), per);
  int64_t R = 0;
  for (int src = 0; src < e; ++src) {
    int64_t n = 0;
    for (int64_t j = 0; j < per; ++j) n += from[static_cast<size_t>(src * per + j)];
    MOE_CHECK(n < kMax, "dispatch: {} rows from rank {} exceed the 32-bit row index", n, src);
    recv_rows[src] = static_cast<int32_t>(n);
    R += n;
  }
  MOE_CHECK(R < kMax, "dispatch: {} received rows exceed the 32-bit row index", R);

  // 3. The routing weights (one float per row) in arrival order: they, and the arrival order
  //    itself, are all the expert-major permutation needs, so it exists before any row moves.
  Tensor arrived_w = Tensor::empty({R, 1}, DType::F32, MemCategory::Scratch);
  {
    std::vector<float> send_w(static_cast<size_t>(slots));
    const float* wp = weights.f32();
    for (int64_t s = 0; s < slots; ++s) send_w[static_cast<size_t>(send_pos[s])] = wp[s];
    comm_->all_to_all_v(send_w.data(), widen(send_rows, e).data(), arrived_w.f32(),
                        widen(recv_rows, e).data(), 1);
  }

  // 4. Rank-major -> expert-major: the factory's stable sort of the arrival order by expert.
  Tensor fake_ids = Tensor::empty({R, 1}, DType::I32, MemCategory::Scratch);
  {
    int32_t* fi = fake_ids.i32();
    int64_t p = 0;
    for (int src = 0; src < e; ++src)
      for (int64_t j = 0; j < per; ++j)
        for (int64_t c = 0; c < from[static_cast<size_t>(src * per + j)]; ++c, ++p)
          fi[p] = static_cast<int32_t>(local.first + j);
  }
  factory_->range = local;
  Dispatched out = factory_->dispatch(arrived_w, fake_ids, arrived_w, E);
  fake_ids.reset();
  arrived_w.reset();

  // 5. The rows, gathered from x and landing expert-major, in one exchange.
  out.rows = activation({R, dim});
  comm_->all_to_all_rows(x.f32(), token_rows_by_destination(send_pos, send_rows, e, slots, k),
                         out.rows.f32(), expert_rows_by_source(out.handle.row_of_slot(), recv_rows, e),
                         dim);
  adopt(out.handle, std::move(side), this);
  return out;
}

Tensor AllToAllDispatcher::to_sources(const float* expert_major, int64_t width, const Handle& h,
                                      const detail::EpSendSide& s) const {
  const int e = s.e;
  const int64_t slots = s.tokens() * s.top_k();
  Tensor back = activation({slots, width});
  comm_->all_to_all_rows(expert_major, expert_rows_by_source(h.row_of_slot(), s.recv_rows(), e),
                         back.f32(), contiguous_by_rank(s.send_rows(), e), width);
  return back;
}

Tensor AllToAllDispatcher::to_experts(const float* per_token, int64_t width, const Handle& h,
                                      const detail::EpSendSide& s) const {
  const int e = s.e;
  const int64_t k = s.top_k(), slots = s.tokens() * k;
  Tensor out = activation({h.rows(), width});
  comm_->all_to_all_rows(per_token, token_rows_by_destination(s.send_pos(), s.send_rows(), e, slots, k),
                         out.f32(), expert_rows_by_source(h.row_of_slot(), s.recv_rows(), e), width);
  return out;
}

Tensor AllToAllDispatcher::row_token_keys(const Tensor& token_keys, const Handle& handle) {
  const detail::EpSendSide s = send_side(handle, "row keys");
  MOE_CHECK(token_keys.dtype() == DType::I32 && token_keys.numel() == s.tokens(),
            "row keys: expected I32 [{}], got {}", s.tokens(), shape_str(token_keys.shape()));
  // The rows travel as 4-byte floats; the exchange copies bits, so the integers arrive intact.
  const Tensor moved = to_experts(reinterpret_cast<const float*>(token_keys.i32()), 1, handle, s);
  Tensor out = Tensor::empty({handle.rows()}, DType::I32, MemCategory::Routing);
  // A rank whose experts received no rows holds empty (null) buffers: nothing to copy.
  if (handle.rows() > 0)
    std::memcpy(out.raw(), moved.raw(), static_cast<size_t>(handle.rows()) * sizeof(int32_t));
  return out;
}

Tensor AllToAllDispatcher::refetch_rows(const Tensor& x, const Handle& handle) {
  const detail::EpSendSide s = send_side(handle, "row re-fetch");
  MOE_CHECK(x.ndim() == 2 && x.dim(0) == s.tokens(),
            "row re-fetch: expected the forward's input [{}, dim], got {}", s.tokens(),
            shape_str(x.shape()));
  return to_experts(x.f32(), x.dim(1), handle, s);
}

Tensor AllToAllDispatcher::combine(const Tensor& expert_out, Handle& handle, Pass pass) {
  const detail::EpSendSide s = send_side(handle, "combine");
  MOE_CHECK(expert_out.ndim() == 2 && expert_out.dim(0) == handle.rows(),
            "combine: expected expert outputs [{}, dim], got {}", handle.rows(),
            shape_str(expert_out.shape()));
  const int64_t dim = expert_out.dim(1), T = s.tokens(), k = s.top_k();
  Tensor y = activation({T, dim});
  {
    Tensor back = to_sources(expert_out.f32(), dim, handle, s);
    if (k > 0) sum_token_slots(back.f32(), s.send_pos(), y.f32(), T, k, dim);
    else y.zero();
  }
  if (!needs_backward(pass)) handle.release();
  return y;
}

Tensor AllToAllDispatcher::combine_backward(const Tensor& dy, const Handle& handle) {
  const detail::EpSendSide s = send_side(handle, "combine backward");
  MOE_CHECK(dy.ndim() == 2 && dy.dim(0) == s.tokens(),
            "combine backward: expected dy [{}, dim], got {}", s.tokens(), shape_str(dy.shape()));
  return to_experts(dy.f32(), dy.dim(1), handle, s);
}

Tensor AllToAllDispatcher::row_weights_backward(const Tensor& d_row_weights,
                                                const Handle& handle) {
  const detail::EpSendSide s = send_side(handle, "routing-weight backward");
  MOE_CHECK(d_row_weights.numel() == handle.rows(),
            "routing-weight backward: expected [{}] row gradients, got {}", handle.rows(),
            shape_str(d_row_weights.shape()));
  const int64_t T = s.tokens(), k = s.top_k();
  Tensor back = to_sources(d_row_weights.f32(), 1, handle, s);
  Tensor dw = activation({T, k});
  const int32_t* send_pos = s.send_pos();
  const float* b = back.f32();
  float* d = dw.f32();
  for (int64_t q = 0; q < T * k; ++q) d[q] = b[send_pos[q]];
  return dw;
}

Tensor AllToAllDispatcher::dispatch_backward(const Tensor& d_rows, Handle& handle) {
  const detail::EpSendSide s = send_side(handle, "dispatch backward");
  MOE_CHECK(d_rows.ndim() == 2 && d_rows.dim(0) == handle.rows(),
            "dispatch backward: expected row gradients [{}, dim], got {}", handle.rows(),
            shape_str(d_rows.shape()));
  const int64_t dim = d_rows.dim(1), T = s.tokens(), k = s.top_k();
  Tensor dx = activation({T, dim});
  {
    Tensor back = to_sources(d_rows.f32(), dim, handle, s);
    if (k > 0) sum_token_slots(back.f32(), s.send_pos(), dx.f32(), T, k, dim);
    else dx.zero();
  }
  handle.release();
  return dx;
}

}  // namespace moe
