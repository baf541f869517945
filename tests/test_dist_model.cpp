// Expert parallelism for the whole model (SPEC §3–4, issue 4): one training step of a
// DeepSeekModel over an AllToAllDispatcher (EP = world size) plus reduce_gradients and
// sum_router_counts matches a single-process DeepSeekModel (LocalDispatcher) on the union of
// all ranks' sequences. Run by ctest without mpirun and under mpirun at 1, 2 and 4 ranks.
//
// What is bitwise and what is not. Every matmul computes an output element as one FMA chain
// over its row and column (kernels/gemm.h), so a token's values do not depend on how many
// tokens share a call: logits and every routed expert's gradients (its rows arrive in the
// union's order) equal the single process bit for bit. Non-expert gradients are per-rank
// partial sums over that rank's tokens, all-reduced in rank order: the chain over tokens is
// split at rank boundaries and re-associated, so they agree to 1e-6 relative (norm-wise), and
// the loss (a sum of per-rank sums in double) to 1e-12. Router counts and the biases after
// update_bias are compared exactly.
//
// Collectives must line up on every rank, so no ASSERT between collectives; ctest's TIMEOUT
// turns a hang into a failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/rng.h"
#include "parallel/all_to_all_dispatcher.h"
#include "parallel/communicator.h"
#include "parallel/ep_training.h"
#include "io/model_spec.h"
#include "model/causal_lm.h"
#include "model/model.h"
#include "mpi_test_main.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

Tensor slice_rows(const Tensor& all, int64_t first, int64_t n) {
  Tensor t = Tensor::empty({n}, DType::I32, MemCategory::Activations);
  if (n > 0) std::memcpy(t.i32(), all.i32() + first, sizeof(int32_t) * static_cast<size_t>(n));
  return t;
}

std::map<std::string, Param*> by_name(const DeepSeekModel& m) {
  std::map<std::string, Param*> out;
  for (Param* p : m.params()) out[p->name] = p;
  return out;
}

double rel_err(const float* a, const float* ref, int64_t n) {
  double d2 = 0, r2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(ref[i]);
    d2 += d * d;
    r2 += static_cast<double>(ref[i]) * ref[i];
  }
  if (r2 == 0) return std::sqrt(d2);
  return std::sqrt(d2 / r2);
}

TEST(DistModel, TrainStepMatchesSingleProcessOnUnionBatch) {
  const int W = g_world->size(), rank = g_world->rank();
  const ModelConfig cfg = resolve_model_config("debug");
  ASSERT_EQ(cfg.n_routed_experts % W, 0);  // same on every rank: no collective mismatch
  const uint64_t seed = 11;
  const BatchShape local_shape{2, 24};
  const BatchShape global_shape{local_shape.batch * W, local_shape.seq};
  const int64_t vocab = cfg.vocab_size;
  Tensor all_tokens = random_tokens(global_shape.tokens(), vocab, 101);
  Tensor all_targets = random_tokens(global_shape.tokens(), vocab, 202);

  // Reference: one process, every expert, the union batch (ranks' sequences in rank order).
  DeepSeekModel ref(cfg);
  ref.init_weights(seed);
  ref.allocate_grads();
  const LossResult ref_loss = ref.forward(all_tokens, all_targets, global_shape, Pass::Train);
  ref.backward();

  // Expert parallel: the same seed; only this rank's experts exist.
  auto dispatcher = std::make_shared<AllToAllDispatcher>(g_world);
  std::unique_ptr<Communicator> replicas = g_world->split(rank, 0);  // EP = W: one rank each
  DeepSeekModel ep(cfg, dispatcher);
  ep.init_weights(seed);
  auto ref_params = by_name(ref);
  // The assumption behind "same seed, same values": init_weights is keyed by name.
  bool same_init = true;
  int64_t expert_params = 0;
  for (Param* p : ep.params()) {
    auto it = ref_params.find(p->name);
    if (it == ref_params.end()) {
      ADD_FAILURE() << "no reference parameter " << p->name;
      same_init = false;
      continue;
    }
    if (is_routed_expert_param(p->name)) ++expert_params;
    const Param* q = it->second;
    if (p->value.numel() != q->value.numel() ||
        std::memcmp(p->w(), q->w(), sizeof(float) * static_cast<size_t>(p->value.numel())) != 0) {
      ADD_FAILURE() << "init differs from the single-process model: " << p->name;
      same_init = false;
    }
  }
  EXPECT_TRUE(same_init);
  // Each rank holds E / W experts of each MoE layer, 3 tensors each.
  const int64_t moe_layers = static_cast<int64_t>(ref.moe_layers().size());
  EXPECT_EQ(expert_params, moe_layers * 3 * cfg.n_routed_experts / W);

  ep.allocate_grads();
  const int64_t first = rank * local_shape.tokens();
  Tensor tokens = slice_rows(all_tokens, first, local_shape.tokens());
  Tensor targets = slice_rows(all_targets, first, local_shape.tokens());
  {
    // Per-token values: this rank's logits are the union's rows, bitwise.
    const Tensor ref_logits = ref.logits(all_tokens, global_shape);
    const Tensor ep_logits = ep.logits(tokens, local_shape);
    EXPECT_EQ(std::memcmp(ep_logits.f32(), ref_logits.f32() + first * cfg.vocab_size,
                          sizeof(float) * static_cast<size_t>(ep_logits.numel())), 0)
        << "rank " << rank << " logits";
  }
  LossOptions opts;
  opts.grad_scale = 1.0f / static_cast<float>(W);  // equal token counts: Σ_r loss_r / W = mean
  const LossResult r = ep.forward(tokens, targets, local_shape, Pass::Train, opts);
  ep.backward();
  EXPECT_EQ(routing_bytes(), 0);
  reduce_gradients(ep, *g_world, *replicas);
  sum_router_counts(ep, *g_world);

  double loss = r.total() / W;
  g_world->all_reduce_sum(&loss, 1);
  const double loss_err = std::abs(loss - ref_loss.total()) / std::abs(ref_loss.total());
  EXPECT_LE(loss_err, 1e-12) << loss << " vs " << ref_loss.total();

  double worst_shared = 0, worst_expert = 0;
  for (Param* p : ep.params()) {
    if (!p->grad.defined()) continue;
    auto it = ref_params.find(p->name);
    if (it == ref_params.end() || !it->second->grad.defined()) {
      ADD_FAILURE() << "no reference gradient " << p->name;
      continue;
    }
    const double e = rel_err(p->g(), it->second->g(), p->grad.numel());
    (is_routed_expert_param(p->name) ? worst_expert : worst_shared) =
        std::max(is_routed_expert_param(p->name) ? worst_expert : worst_shared, e);
    if (is_routed_expert_param(p->name))
      EXPECT_EQ(std::memcmp(p->g(), it->second->g(), sizeof(float) * static_cast<size_t>(p->grad.numel())), 0)
          << p->name << " must be bitwise";
    else
      EXPECT_LE(e, 1e-6) << p->name;
  }
  std::printf("[ EP %d ] loss rel err %.3g, worst non-expert grad rel err %.3g, worst expert grad "
              "rel err %.3g\n", W, loss_err, worst_shared, worst_expert);

  const auto ep_moe = ep.moe_layers();
  const auto ref_moe = ref.moe_layers();
  EXPECT_EQ(ep_moe.size(), ref_moe.size());
  for (size_t i = 0; i < std::min(ep_moe.size(), ref_moe.size()); ++i)
    EXPECT_EQ(ep_moe[i]->expert_counts(), ref_moe[i]->expert_counts()) << "moe layer " << i;
  ep.update_router_biases(1e-3);
  ref.update_router_biases(1e-3);
  for (size_t i = 0; i < std::min(ep_moe.size(), ref_moe.size()); ++i) {
    const int64_t n = ep_moe[i]->gate_bias.value.numel();
    EXPECT_EQ(std::memcmp(ep_moe[i]->gate_bias.w(), ref_moe[i]->gate_bias.w(),
                          sizeof(float) * static_cast<size_t>(n)), 0)
        << "bias of moe layer " << i;
  }

  // Evaluation forwards keep no dispatch handle on any rank.
  bool clean = true;
  for (int step = 0; step < 20; ++step) {
    ep.forward(tokens, targets, local_shape, Pass::Eval);
    clean = clean && routing_bytes() == 0 && !ep.has_saved();
  }
  EXPECT_TRUE(clean);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// Int8 expert activations (inference): every rank runs the int8 kernel on the rows its experts
// receive from all ranks, so each rank's logits equal, bit for bit, one process's with every
// expert on the union batch (a rank left exact would show in the rows it serves to the others).
TEST(DistModel, Int8ExpertActivationsLogitsMatchSingleProcessOnUnionBatch) {
  const int W = g_world->size(), rank = g_world->rank();
  for (const char* preset : {"debug", "debug-v4"}) {
    SCOPED_TRACE(preset);
    ModelConfig cfg = resolve_model_config(preset);
    cfg.expert_format = "mxfp4";
    cfg.validate("test");
    const BatchShape local_shape{2, 16};
    const BatchShape global_shape{local_shape.batch * W, local_shape.seq};
    const Tensor all_tokens = random_tokens(global_shape.tokens(), cfg.vocab_size, 105);
    const std::unique_ptr<CausalLM> ref = make_causal_lm(cfg);
    ref->init_weights(7);
    const Tensor ref_exact = ref->logits(all_tokens, global_shape);
    ref->set_expert_activations(ExpertActivations::Int8);
    const Tensor ref_int8 = ref->logits(all_tokens, global_shape);
    EXPECT_NE(std::memcmp(ref_exact.f32(), ref_int8.f32(), static_cast<size_t>(ref_int8.nbytes())),
              0);
    const std::unique_ptr<CausalLM> ep =
        make_causal_lm(cfg, std::make_shared<AllToAllDispatcher>(g_world));
    ep->init_weights(7);
    ep->set_expert_activations(ExpertActivations::Int8);
    const int64_t first = rank * local_shape.tokens();
    const Tensor tokens = slice_rows(all_tokens, first, local_shape.tokens());
    const Tensor ep_int8 = ep->logits(tokens, local_shape);
    EXPECT_EQ(std::memcmp(ep_int8.f32(), ref_int8.f32() + first * cfg.vocab_size,
                          static_cast<size_t>(ep_int8.nbytes())), 0)
        << "rank " << rank << " logits";
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// LoRA over a frozen MXFP4 base, adapter dropout on: every rank's adapters of its own experts
// (sharded like the experts), masks keyed by global token index, so the EP run equals one
// process on the union batch: logits bitwise, expert-adapter gradients bitwise, the rest to
// the re-association of the cross-rank sums.
void lora_over_mxfp4_matches_single_process(bool all_to_rank_0);

TEST(DistModel, LoraOverMxfp4MatchesSingleProcessOnUnionBatch) {
  lora_over_mxfp4_matches_single_process(false);
}

// Every token to experts 0 and 1 (rank 0's): the other ranks' expert adapters get zero rows,
// with dropout drawing masks for none of them.
TEST(DistModel, LoraOverMxfp4WithEveryTokenOnOneRank) {
  lora_over_mxfp4_matches_single_process(true);
}

void lora_over_mxfp4_matches_single_process(bool all_to_rank_0) {
  const int W = g_world->size(), rank = g_world->rank();
  ModelConfig cfg = resolve_model_config("debug");
  cfg.expert_format = "mxfp4";
  cfg.q_lora_rank = 16;
  LoraSettings lora;
  lora.dropout = 0.1;
  lora.expert_r = 4;
  const BatchShape local_shape{2, 24};
  const BatchShape global_shape{local_shape.batch * W, local_shape.seq};
  Tensor all_tokens = random_tokens(global_shape.tokens(), cfg.vocab_size, 103);
  Tensor all_targets = random_tokens(global_shape.tokens(), cfg.vocab_size, 204);
  auto prepare = [&](DeepSeekModel& m, int64_t row_offset) {
    m.init_weights(5);
    m.freeze_base();
    m.add_lora(lora, 6);
    for (Param* p : m.lora_params()) {  // B != 0, the same values by name on every rank
      Rng rng(fnv1a(p->name.c_str()));
      if (p->name.find("lora_B") != std::string::npos) fill_random(p->value, rng, 0.05f);
    }
    m.allocate_grads();
    if (all_to_rank_0)
      for (MoELayer* l : m.moe_layers()) {  // sigmoid scores < 1: the biases decide
        std::fill(l->gate_bias.w(), l->gate_bias.w() + cfg.n_routed_experts, 0.0f);
        l->gate_bias.w()[0] = l->gate_bias.w()[1] = 10.0f;
      }
    m.lora_runtime().seed = 17;
    m.lora_runtime().draw = 2;
    m.lora_runtime().row_offset = row_offset;
  };
  DeepSeekModel ref(cfg);
  prepare(ref, 0);
  const LossResult ref_loss = ref.forward(all_tokens, all_targets, global_shape, Pass::Train);
  ref.backward();

  auto dispatcher = std::make_shared<AllToAllDispatcher>(g_world);
  std::unique_ptr<Communicator> replicas = g_world->split(rank, 0);
  DeepSeekModel ep(cfg, dispatcher);
  const int64_t first = rank * local_shape.tokens();
  prepare(ep, first);
  Tensor tokens = slice_rows(all_tokens, first, local_shape.tokens());
  Tensor targets = slice_rows(all_targets, first, local_shape.tokens());
  {
    const Tensor ref_logits = ref.logits(all_tokens, global_shape);
    const Tensor ep_logits = ep.logits(tokens, local_shape);
    EXPECT_EQ(std::memcmp(ep_logits.f32(), ref_logits.f32() + first * cfg.vocab_size,
                          sizeof(float) * static_cast<size_t>(ep_logits.numel())), 0)
        << "rank " << rank << " logits";
  }
  LossOptions opts;
  opts.grad_scale = 1.0f / static_cast<float>(W);
  const LossResult r = ep.forward(tokens, targets, local_shape, Pass::Train, opts);
  ep.backward();
  reduce_gradients(ep, *g_world, *replicas);
  double loss = r.total() / W;
  g_world->all_reduce_sum(&loss, 1);
  EXPECT_LE(std::abs(loss - ref_loss.total()) / std::abs(ref_loss.total()), 1e-12);

  std::map<std::string, Param*> ref_lora;
  for (Param* p : ref.lora_params()) ref_lora[p->name] = p;
  int64_t expert_adapters = 0;
  double worst_shared = 0;
  for (Param* p : ep.lora_params()) {
    auto it = ref_lora.find(p->name);
    if (it == ref_lora.end()) {
      ADD_FAILURE() << "no reference adapter " << p->name;
      continue;
    }
    if (is_routed_expert_param(p->name)) {
      ++expert_adapters;
      EXPECT_EQ(std::memcmp(p->g(), it->second->g(), sizeof(float) * static_cast<size_t>(p->grad.numel())), 0)
          << p->name << " must be bitwise";
    } else {
      const double e = rel_err(p->g(), it->second->g(), p->grad.numel());
      worst_shared = std::max(worst_shared, e);
      EXPECT_LE(e, 1e-5) << p->name;
    }
  }
  // Each rank holds the adapters of its E / W experts: 3 projections x (A, B) per MoE layer.
  // (With every token on experts 0 and 1 only rank 0's have gradients; the rest are exactly 0.)
  EXPECT_EQ(expert_adapters, static_cast<int64_t>(ref.moe_layers().size()) * 3 * 2 *
                                 cfg.n_routed_experts / W);
  std::printf("[ EP %d LoRA/MXFP4 ] worst non-expert adapter grad rel err %.3g\n", W, worst_shared);
  EXPECT_EQ(routing_bytes(), 0);
  EXPECT_FALSE(ep.has_saved());
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

}  // namespace

int main(int argc, char** argv) { return moe::testing::run_mpi_tests(argc, argv); }
