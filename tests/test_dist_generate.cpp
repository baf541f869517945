// Generation under expert parallelism (issue 12): rank 0 runs the engine, every other rank serves
// its routed experts to rank 0's forwards (GenerationEngine + serve_experts). At EP = world size
// (1, 2 or 4 ranks) the generated ids equal one process's with every expert, with exact and with
// int8 expert activations; over 1,000 decode steps (MOE_MEMORY_STEPS) of a steady stream of
// requests no rank's tracked memory moves (per category) and RSS stays within 1%, so no dispatch
// handle or buffer outlives its step. (One sequence decoding 1,000 tokens legitimately grows by
// its own ids and text, a few bytes per token.)
//
// Collectives must line up on every rank, so no ASSERT between the engine's start and its
// shutdown; ctest's TIMEOUT turns a hang into a failure.
#include <gtest/gtest.h>


#include "infer/generation.h"
#include "model/causal_lm.h"
#include "model/model.h"
#include "io/model_spec.h"
#include "mpi_test_main.h"
#include "parallel/ep_training.h"

using namespace moe;
using namespace moe::testing;

namespace {

ModelConfig config(const std::string& preset = "debug") {
  ModelConfig c = resolve_model_config(preset);
  c.vocab_size = 264;
  c.max_position_embeddings = 1100;
  c.expert_format = "mxfp4";
  return c;
}

GenerationRequest request(int i, int64_t max_tokens) {
  GenerationRequest r;
  r.prompt = ByteTokenizer::encode("prompt number " + std::to_string(i) + std::string(i * 3, 'x'));
  r.max_tokens = max_tokens;
  r.seed = 50 + i;
  r.sampling.temperature = 0.8;
  return r;
}

struct Reading {
  MemSnapshot tracked;
  int64_t rss = -1;
};

}  // namespace

TEST(DistGenerate, ExpertParallelGenerationEqualsOneProcess) {
  const ModelConfig cfg = config();
  const ExpertParallelGroups groups =
      make_expert_parallel_groups(g_world, g_world->size(), cfg.n_routed_experts, "ep");
  DeepSeekModel model(cfg, make_dispatcher(groups));
  model.init_weights(4);
  const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  constexpr int kRequests = 4;
  if (g_world->rank() != 0) {
    serve_experts(model, *groups.ep_group);
    return;
  }
  std::vector<std::vector<int32_t>> split(kRequests), whole(kRequests);
  {
    EngineOptions o;
    o.max_sequences = 3;
    o.prefill_chunk = 8;
    GenerationEngine engine(model, *tok, o, groups.ep_group);
    for (int i = 0; i < kRequests; ++i)
      engine.submit(request(i, 20), [&split, i](const GenerationUpdate& u) {
        if (u.finished) split[static_cast<size_t>(i)] = u.completion_ids;
      });
    engine.run_until_idle();
    engine.shutdown();
  }
  DeepSeekModel local(cfg);
  local.init_weights(4);
  EngineOptions o;
  o.max_sequences = 3;
  o.prefill_chunk = 8;
  GenerationEngine engine(local, *tok, o);
  for (int i = 0; i < kRequests; ++i)
    engine.submit(request(i, 20), [&whole, i](const GenerationUpdate& u) {
      if (u.finished) whole[static_cast<size_t>(i)] = u.completion_ids;
    });
  engine.run_until_idle();
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_EQ(split[static_cast<size_t>(i)].size(), 20u);
    EXPECT_EQ(split[static_cast<size_t>(i)], whole[static_cast<size_t>(i)]) << "request " << i;
  }
}

// Int8 expert activations (inference only): each rank runs the int8 kernel on the rows its
// experts receive, so the split model generates what one process with every expert does, V3 and
// V4 (hash-routed layers included) alike.
class DistGenerateInt8 : public ::testing::TestWithParam<const char*> {};

TEST_P(DistGenerateInt8, ExpertParallelGenerationEqualsOneProcess) {
  const ModelConfig cfg = config(GetParam());
  const ExpertParallelGroups groups =
      make_expert_parallel_groups(g_world, g_world->size(), cfg.n_routed_experts, "ep");
  const std::unique_ptr<CausalLM> model = make_causal_lm(cfg, make_dispatcher(groups));
  model->init_weights(4);
  model->set_expert_activations(ExpertActivations::Int8);
  const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  constexpr int kRequests = 3;
  if (g_world->rank() != 0) {
    serve_experts(*model, *groups.ep_group);
    return;
  }
  auto generate = [&](CausalLM& m, std::shared_ptr<Communicator> ep_group) {
    std::vector<std::vector<int32_t>> ids(kRequests);
    EngineOptions o;
    o.max_sequences = 2;
    o.prefill_chunk = 8;
    GenerationEngine engine(m, *tok, o, std::move(ep_group));
    for (int i = 0; i < kRequests; ++i)
      engine.submit(request(i, 16), [&ids, i](const GenerationUpdate& u) {
        if (u.finished) ids[static_cast<size_t>(i)] = u.completion_ids;
      });
    engine.run_until_idle();
    engine.shutdown();
    return ids;
  };
  const auto split = generate(*model, groups.ep_group);
  const std::unique_ptr<CausalLM> local = make_causal_lm(cfg);
  local->init_weights(4);
  local->set_expert_activations(ExpertActivations::Int8);
  const auto whole = generate(*local, nullptr);
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_FALSE(split[static_cast<size_t>(i)].empty());
    EXPECT_EQ(split[static_cast<size_t>(i)], whole[static_cast<size_t>(i)]) << "request " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryFamily, DistGenerateInt8, ::testing::Values("debug", "debug-v4"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "debug" ? "V3" : "V4";
                         });

// DeepSeek-V3's latent cache and DeepSeek-V4's window/compressed cache alike.
class DistGenerateMemory : public ::testing::TestWithParam<const char*> {};

TEST_P(DistGenerateMemory, FlatOverAThousandDecodeStepsOnEveryRank) {
  const ModelConfig cfg = config(GetParam());
  const ExpertParallelGroups groups =
      make_expert_parallel_groups(g_world, g_world->size(), cfg.n_routed_experts, "ep");
  const std::unique_ptr<CausalLM> owned = make_causal_lm(cfg, make_dispatcher(groups));
  CausalLM& model = *owned;
  model.init_weights(5);
  const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  constexpr int64_t kWarmup = 10;
  const int64_t steps = memory_proof_steps();
  Reading warm, last;
  auto read = [&](Reading& r) {
    r.rss = rss_bytes();
    r.tracked = MemoryTracker::instance().snapshot();
  };
  if (g_world->rank() != 0) {
    serve_experts(model, *groups.ep_group, [&](int64_t n) {
      if (n == kWarmup) read(warm);
      if (n == steps) read(last);
    });
  } else {
    EngineOptions o;
    o.max_sequences = 2;
    o.context = 128;
    GenerationEngine engine(model, *tok, o, groups.ep_group);
    // Requests of 50 tokens keep both slots busy, a new one arriving as one finishes, as in
    // serving: readings at steps 10 and 1,000 see the same number of live sequences.
    int submitted = 0;
    for (int64_t n = 1; n <= steps; ++n) {
      while (engine.active() + engine.queued() < 2) engine.submit(request(submitted++ % 3, 50), nullptr);
      engine.step();
      if (n == kWarmup) read(warm);
      if (n == steps) read(last);
    }
    engine.run_until_idle();
    engine.shutdown();
  }
  for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c)
    EXPECT_EQ(warm.tracked.current[static_cast<size_t>(c)],
              last.tracked.current[static_cast<size_t>(c)])
        << "rank " << g_world->rank() << ": " << mem_category_name(static_cast<MemCategory>(c));
  EXPECT_EQ(last.tracked[MemCategory::Routing], 0) << "a dispatch handle outlived its step";
  EXPECT_FALSE(model.has_saved());
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine keeps freed blocks resident by design
  if (warm.rss > 0) {
    EXPECT_LT(static_cast<double>(last.rss - warm.rss), 0.01 * static_cast<double>(warm.rss))
        << "rank " << g_world->rank() << ": RSS " << warm.rss << " -> " << last.rss;
  }
#endif
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

INSTANTIATE_TEST_SUITE_P(EveryFamily, DistGenerateMemory, ::testing::Values("debug", "debug-v4"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "debug" ? "V3" : "V4";
                         });

int main(int argc, char** argv) { return moe::testing::run_mpi_tests(argc, argv); }
