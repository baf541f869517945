// Expert parallelism at the MoE-layer level (SPEC §3–4, issue 4). One binary, run by ctest under
// mpirun at 1, 2 and 4 ranks, and without mpirun as one rank (LocalCommunicator, no MPI).
//
// Every rank builds the same full layer from one seed (LocalDispatcher, all experts) as the
// reference and an expert-parallel layer (AllToAllDispatcher, only its E/e experts) with the
// same values. Rank r's tokens are its own sequences of one global batch; the reference runs the
// union (ranks' sequences concatenated in rank order) in one process. Then:
//  - outputs, dx and every local expert's gradients equal the reference bitwise: the received
//    rows are expert-major with sources in rank order, i.e. the union's row order, so every
//    grouped GEMM and every slot sum sees the same operands in the same order;
//  - router (gate.weight) and shared-expert gradients are per-rank partial sums over that
//    rank's tokens; their deterministic all_reduce_sum matches the reference's one GEMM over all
//    tokens to 1e-6 norm-wise relative error (not bitwise: the reduction over tokens is split at
//    rank boundaries and re-associated, a last-bit difference).
//
// Collectives must line up on every rank, so tests never ASSERT between collectives; failures
// are EXPECTs and ctest's TIMEOUT turns any hang into a failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "core/rng.h"
#include "parallel/all_to_all_dispatcher.h"
#include "parallel/communicator.h"
#include "moe/dispatcher.h"
#include "moe/moe_layer.h"
#include "moe_test_util.h"
#include "mpi_test_main.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

struct Opt {
  int64_t dim = 16, hidden = 8, experts = 16, top_k = 3, shared = 1, seq = 5;
  double alpha = 0.0;
};

ModelConfig make_cfg(const Opt& o) {
  ModelConfig c;
  c.hidden_size = o.dim;
  c.moe_intermediate_size = o.hidden;
  c.n_routed_experts = o.experts;
  c.num_experts_per_tok = o.top_k;
  c.n_shared_experts = o.shared;
  c.scoring_func = "sigmoid";
  c.norm_topk_prob = true;
  c.n_group = 1;
  c.topk_group = 1;
  c.topk_method = "noaux_tc";
  c.routed_scaling_factor = 1.0;
  c.aux_loss_alpha = o.alpha;
  return c;
}

std::map<std::string, Param*> by_name(MoELayer& m) {
  ParamList ps;
  m.collect(ps);
  std::map<std::string, Param*> out;
  for (Param* p : ps) out[p->name] = p;
  return out;
}

// Same values on every rank: one seed, drawn in the full layer's parameter order.
void randomize_full(MoELayer& m, uint64_t seed) {
  Rng rng(seed);
  randomize_moe(m, rng);
}

struct Pair {
  LocalDispatcher local;
  std::unique_ptr<AllToAllDispatcher> ep;
  MoELayer full, part;
};

// tweak runs on the full layer before its values are copied (e.g. forcing the routing).
std::unique_ptr<Pair> build(const Opt& o, uint64_t seed,
                            const std::function<void(MoELayer&)>& tweak = nullptr) {
  auto p = std::make_unique<Pair>();
  p->ep = std::make_unique<AllToAllDispatcher>(g_world);
  const ModelConfig cfg = make_cfg(o);
  p->full.init("model.layers.1.mlp.", cfg, p->local);
  p->part.init("model.layers.1.mlp.", cfg, *p->ep);
  randomize_full(p->full, seed);
  if (tweak) tweak(p->full);
  auto full = by_name(p->full);
  for (auto& [name, q] : by_name(p->part)) {
    auto it = full.find(name);
    EXPECT_TRUE(it != full.end()) << name;
    if (it != full.end()) q->value.copy_from(it->second->value);
  }
  p->full.allocate_grads();
  p->part.allocate_grads();
  return p;
}

bool bitwise_equal(const float* a, const float* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(float) * static_cast<size_t>(n)) == 0;
}

struct Batches {
  std::vector<int64_t> batch;  // sequences per rank
  int64_t seq = 0;
  int64_t total() const {
    int64_t n = 0;
    for (int64_t b : batch) n += b;
    return n;
  }
  int64_t first_row(int r) const {
    int64_t n = 0;
    for (int i = 0; i < r; ++i) n += batch[static_cast<size_t>(i)];
    return n * seq;
  }
};

// One global batch (same on every rank); rank r's rows are [first_row(r), + batch[r]·seq).
struct Result {
  double router_err = 0, shared_err = 0;
};

Result check_against_union(const Opt& o, const Batches& b, uint64_t seed,
                           const std::function<void(MoELayer&)>& tweak = nullptr) {
  const int r = g_world->rank();
  auto p = build(o, seed, tweak);
  const int64_t D = o.dim, TT = b.total() * b.seq;
  const int64_t T = b.batch[static_cast<size_t>(r)] * b.seq, row0 = b.first_row(r);
  Rng rng(seed + 1000);
  Tensor X = random_tensor({TT, D}, rng), DY = random_tensor({TT, D}, rng);
  Tensor x = Tensor::empty({T, D}, DType::F32, MemCategory::Scratch);
  Tensor dy = Tensor::empty({T, D}, DType::F32, MemCategory::Scratch);
  if (T > 0) {
    std::memcpy(x.f32(), X.f32() + row0 * D, sizeof(float) * static_cast<size_t>(T * D));
    std::memcpy(dy.f32(), DY.f32() + row0 * D, sizeof(float) * static_cast<size_t>(T * D));
  }

  // Reference: the union in one process.
  Tensor Y = p->full.forward(X, {b.total(), b.seq}, Pass::Train);
  Tensor DX = p->full.backward(DY);
  EXPECT_EQ(routing_bytes(), 0);

  // Expert parallel, an Eval forward first (must equal the Train forward and leave nothing).
  Tensor ye = p->part.forward(x, {b.batch[static_cast<size_t>(r)], b.seq}, Pass::Eval);
  EXPECT_EQ(routing_bytes(), 0) << "an Eval forward left routing state";
  // A Train forward whose backward never runs: the next forward replaces its handle, and both
  // the permutation and the send-side state go with it.
  p->part.forward(x, {b.batch[static_cast<size_t>(r)], b.seq}, Pass::Train);
  const int64_t one_step = routing_bytes();
  Tensor y = p->part.forward(x, {b.batch[static_cast<size_t>(r)], b.seq}, Pass::Train);
  EXPECT_EQ(routing_bytes(), one_step) << "a superseded Train forward left routing state";
  EXPECT_GT(routing_bytes(), 0) << "Train forward must keep its handle";
  Tensor dx = p->part.backward(dy);
  EXPECT_EQ(routing_bytes(), 0) << "backward must release the handle";
  EXPECT_FALSE(p->part.has_saved());

  EXPECT_TRUE(bitwise_equal(ye.f32(), Y.f32() + row0 * D, T * D)) << "rank " << r << " eval y";
  EXPECT_TRUE(bitwise_equal(y.f32(), Y.f32() + row0 * D, T * D)) << "rank " << r << " y";
  EXPECT_TRUE(bitwise_equal(dx.f32(), DX.f32() + row0 * D, T * D)) << "rank " << r << " dx";

  // Expert grads: bitwise, rank-local. Router and shared grads: summed over ranks.
  Result res;
  auto full = by_name(p->full);
  for (auto& [name, q] : by_name(p->part)) {
    if (!q->grad.defined()) continue;
    Param* f = full.at(name);
    const int64_t n = q->grad.numel();
    if (name.find(".experts.") != std::string::npos) {
      EXPECT_TRUE(bitwise_equal(q->g(), f->g(), n)) << "rank " << r << " " << name;
      continue;
    }
    std::vector<float> sum(q->g(), q->g() + n);
    g_world->all_reduce_sum(sum.data(), n);
    const double err = rel_error(sum.data(), f->g(), n);
    if (name.find("gate.weight") != std::string::npos) res.router_err = std::max(res.router_err, err);
    else res.shared_err = std::max(res.shared_err, err);
    EXPECT_LE(err, 1e-6) << "rank " << r << " " << name;
    // The deterministic reduction gives the same bits on every rank: rank 0's bit patterns,
    // spread by an exact integer sum (zeros elsewhere), against this rank's.
    std::vector<int64_t> bits(static_cast<size_t>(n)), mine(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &sum[static_cast<size_t>(i)], 4);
      mine[static_cast<size_t>(i)] = u;
      bits[static_cast<size_t>(i)] = r == 0 ? u : 0;
    }
    g_world->all_reduce_sum(bits.data(), n);
    EXPECT_TRUE(bits == mine) << name << ": the all-reduced gradient differs between ranks";
  }
  return res;
}

Batches uneven(int size, int64_t seq) {
  Batches b;
  b.seq = seq;
  for (int i = 0; i < size; ++i) b.batch.push_back(1 + (i % 3));
  return b;
}

}  // namespace

// ------------------------------------------------------------------ communicator

TEST(Communicator, DeterministicSumMinAndAllToAll) {
  Communicator& c = *g_world;
  const int W = c.size(), r = c.rank();
  // A sum whose value depends on the order: the result must be rank-order left-to-right.
  std::vector<float> v(3001);
  for (size_t i = 0; i < v.size(); ++i) v[i] = (r % 2 ? 1e-8f : 1.0f) * static_cast<float>(i + r);
  std::vector<float> s = v;
  c.all_reduce_sum(s.data(), static_cast<int64_t>(s.size()));
  bool ok = true;
  for (size_t i = 0; i < v.size(); ++i) {
    float acc = 0;
    for (int q = 0; q < W; ++q) {
      const float vq = (q % 2 ? 1e-8f : 1.0f) * static_cast<float>(i + q);
      acc = q == 0 ? vq : acc + vq;
    }
    ok = ok && std::memcmp(&acc, &s[i], sizeof(float)) == 0;
  }
  EXPECT_TRUE(ok) << "all_reduce_sum(float) is not the rank-ordered sum";
  std::vector<double> d{1.0 * r, 0.5};
  c.all_reduce_sum(d.data(), 2);
  EXPECT_EQ(d[0], W * (W - 1) / 2.0);
  EXPECT_EQ(d[1], 0.5 * W);
  std::vector<int64_t> mn{10 - r, 7};
  c.all_reduce_min(mn.data(), 2);
  EXPECT_EQ(mn[0], 10 - (W - 1));
  EXPECT_EQ(mn[1], 7);
  std::vector<int64_t> send(static_cast<size_t>(2 * W)), recv(static_cast<size_t>(2 * W));
  for (int j = 0; j < W; ++j) send[2 * j] = 100 * r + j, send[2 * j + 1] = -1;
  c.all_to_all(send.data(), recv.data(), 2);
  for (int j = 0; j < W; ++j) EXPECT_EQ(recv[static_cast<size_t>(2 * j)], 100 * j + r);

  // all_to_all_v with zero rows to some ranks: rank r sends (r + j) % 2 rows to rank j.
  const int64_t width = 3;
  std::vector<int64_t> sr(static_cast<size_t>(W)), rr(static_cast<size_t>(W));
  for (int j = 0; j < W; ++j) sr[j] = (r + j) % 2, rr[j] = (j + r) % 2;
  std::vector<float> sb, rb(static_cast<size_t>(W * width));
  for (int j = 0; j < W; ++j)
    for (int64_t q = 0; q < sr[j] * width; ++q) sb.push_back(static_cast<float>(1000 * r + j));
  sb.push_back(0);
  c.all_to_all_v(sb.data(), sr.data(), rb.data(), rr.data(), width);
  int64_t at = 0;
  for (int j = 0; j < W; ++j)
    for (int64_t q = 0; q < rr[j] * width; ++q, ++at)
      EXPECT_EQ(rb[static_cast<size_t>(at)], static_cast<float>(1000 * j + r));
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(Communicator, RowExchangeGathersAndScattersInPlace) {
  Communicator& c = *g_world;
  const int W = c.size(), r = c.rank();
  const int64_t width = 5, rows = 40;
  // Rank r sends rank j the rows (j + 3·i) % rows for i < n(r, j) = (r + 2j) % 4, in that order
  // (repeats allowed: one row can go to a rank twice), and rank j writes what it gets from r
  // backwards into rows [base(r) + n - 1, ..., base(r)] of its output, runs cut differently.
  auto n_of = [](int from, int to) { return (from + 2 * to) % 4; };
  std::vector<float> send(static_cast<size_t>(rows * width));
  for (int64_t q = 0; q < rows; ++q)
    for (int64_t w = 0; w < width; ++w) send[static_cast<size_t>(q * width + w)] = 1000.0f * r + q + 0.01f * w;
  std::vector<RowRuns> to(static_cast<size_t>(W)), from(static_cast<size_t>(W));
  std::vector<int32_t> base(static_cast<size_t>(W));
  int32_t at = 0;
  for (int j = 0; j < W; ++j) {
    for (int i = 0; i < n_of(r, j); ++i) to[static_cast<size_t>(j)].add((j + 3 * i) % rows, 1);
    base[static_cast<size_t>(j)] = at;
    for (int i = n_of(j, r) - 1; i >= 0; --i) from[static_cast<size_t>(j)].add(at + i, 1);
    at += n_of(j, r) + 1;  // a gap row between sources stays untouched
  }
  std::vector<float> recv(static_cast<size_t>(at * width), -7.0f);
  c.all_to_all_rows(send.data(), to, recv.data(), from, width);
  for (int j = 0; j < W; ++j) {
    const int n = n_of(j, r);
    for (int i = 0; i < n; ++i) {
      const int64_t dst = base[static_cast<size_t>(j)] + (n - 1 - i);
      const int64_t src_row = (r + 3 * i) % rows;
      for (int64_t w = 0; w < width; ++w)
        EXPECT_EQ(recv[static_cast<size_t>(dst * width + w)], 1000.0f * j + src_row + 0.01f * w)
            << "from " << j << " item " << i;
    }
    EXPECT_EQ(recv[static_cast<size_t>((base[static_cast<size_t>(j)] + n) * width)], -7.0f) << "gap";
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(Communicator, SplitByColor) {
  Communicator& c = *g_world;
  auto sub = c.split(c.rank() % 2, c.rank());
  EXPECT_EQ(sub->size(), (c.size() + 1 - c.rank() % 2) / 2);
  EXPECT_EQ(sub->rank(), c.rank() / 2);
  int64_t n = 1;
  sub->all_reduce_sum(&n, 1);
  EXPECT_EQ(n, sub->size());
}

// ------------------------------------------------------------------ MoE layer

TEST(ExpertParallel, MatchesSingleProcessOnUnionOfTokens) {
  const Batches b = uneven(g_world->size(), 5);
  const Result res = check_against_union(Opt{}, b, 7);
  if (g_world->rank() == 0)
    std::printf("[ EP %d ] router grad rel err %.3g, shared grad rel err %.3g\n", g_world->size(),
                res.router_err, res.shared_err);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(ExpertParallel, TopOneAndNoSharedExperts) {
  Opt o;
  o.top_k = 1;
  o.shared = 0;
  o.experts = 8;
  check_against_union(o, uneven(g_world->size(), 7), 21);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(ExpertParallel, AllTokensToTheExpertsOfOneRank) {
  // The correction bias selects the last rank's experts for every token: every other rank's
  // experts get no rows (zero gradients), and every rank sends everything to one rank.
  const int W = g_world->size();
  Opt o;
  const int64_t per = o.experts / W;
  auto force = [&](MoELayer& m) {
    float* bias = m.gate_bias.w();
    for (int64_t i = 0; i < o.experts; ++i) bias[i] = i >= (W - 1) * per ? 10.0f : 0.0f;
  };
  check_against_union(o, uneven(W, 4), 33, force);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(ExpertParallel, RankWithZeroTokens) {
  // Rank 1 (or rank 0 alone) brings no tokens at all but still receives rows for its experts.
  const int W = g_world->size();
  Batches b;
  b.seq = 6;
  for (int i = 0; i < W; ++i) b.batch.push_back(i == std::min(1, W - 1) ? 0 : 2);
  if (W == 1) b.batch[0] = 0;
  check_against_union(Opt{}, b, 45);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(ExpertParallel, HandleLifetimeAndFlatMemoryOver300EvalForwards) {
  const int r = g_world->rank();
  Opt o;
  auto p = build(o, 51);
  Rng rng(52 + static_cast<uint64_t>(r));
  Tensor x = random_tensor({2 * o.seq, o.dim}, rng);
  int64_t after10 = -1, bad_routing = 0;
  for (int i = 0; i < 300; ++i) {
    const Pass pass = i % 2 ? Pass::Eval : Pass::Inference;
    { Tensor y = p->part.forward(x, {2, o.seq}, pass); }
    if (routing_bytes() != 0) ++bad_routing;
    if (i == 9) after10 = MemoryTracker::instance().snapshot().total_current();
  }
  EXPECT_EQ(bad_routing, 0) << "routing bytes left after an Eval/Inference forward";
  EXPECT_EQ(MemoryTracker::instance().snapshot().total_current(), after10)
      << "tracked bytes grew over 300 forwards";
  // Train forward keeps exactly one handle; a backward-free Eval in between does not disturb it.
  Tensor y = p->part.forward(x, {2, o.seq}, Pass::Train);
  const int64_t kept = routing_bytes();
  EXPECT_GT(kept, 0);
  Tensor dy = random_tensor({2 * o.seq, o.dim}, rng);
  p->part.backward(dy);
  EXPECT_EQ(routing_bytes(), 0);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(ExpertParallel, BackwardAfterEvalForwardIsAnErrorNotAHang) {
  // Misuse is caught locally (before any collective) on every rank alike.
  Opt o;
  auto p = build(o, 61);
  Rng rng(62);
  Tensor x = random_tensor({o.seq, o.dim}, rng);
  Dispatcher& d = *p->ep;
  Tensor logits_ids = Tensor::zeros({o.seq, o.top_k}, DType::I32, MemCategory::Scratch);
  for (int64_t t = 0; t < o.seq; ++t)
    for (int64_t j = 0; j < o.top_k; ++j) logits_ids.i32()[t * o.top_k + j] = static_cast<int32_t>(j);
  Tensor w = Tensor::f32({o.seq, o.top_k}, MemCategory::Scratch);
  Dispatched dd = d.dispatch(x, logits_ids, w, o.experts);
  Tensor y = d.combine(dd.rows, dd.handle, Pass::Eval);
  EXPECT_FALSE(dd.handle.live());
  EXPECT_THROW(d.dispatch_backward(dd.rows, dd.handle), Error);
  EXPECT_EQ(routing_bytes(), 0);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

int main(int argc, char** argv) { return moe::testing::run_mpi_tests(argc, argv); }
