// Cached inference (issue 12): the MLA latent cache and DeepSeekModel::forward_cached against a
// full recompute of the same prefix, at every step, for every router and attention variant;
// batching that never changes a sequence's bits; nothing left behind.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/memory.h"
#include "core/parallel.h"
#include "model/latent_kv_cache.h"
#include "io/model_spec.h"
#include "model/model.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

// max |a - b| / max |b| over one logits row.
double row_error(const float* a, const float* b, int64_t n) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
    ref = std::max(ref, static_cast<double>(std::abs(b[i])));
  }
  return diff / ref;
}

Tensor tokens_of(const std::vector<int32_t>& ids, size_t from = 0, size_t count = SIZE_MAX) {
  count = std::min(count, ids.size() - from);
  Tensor t = Tensor::empty({static_cast<int64_t>(count)}, DType::I32, MemCategory::Activations);
  std::copy_n(ids.begin() + static_cast<std::ptrdiff_t>(from), count, t.i32());
  return t;
}

void randomize_lora(DeepSeekModel& model) {
  LoraSettings s;
  s.r = 4;
  s.alpha = 8;
  model.add_lora(s, 5);
  // PEFT starts B at zero; random B makes every adapter change the logits.
  Rng rng(9);
  for (Param* p : model.lora_params()) fill_random(p->value, rng, 0.05f);
}

struct Variant {
  const char* name;
  void (*edit)(ModelConfig&);
  bool lora = false;
};

// Prefills a prompt in chunks of 16 (the expanded form), then decodes `steps` tokens one at a
// time (the absorbed form); at every step the cached logits must match model.logits over the
// whole sequence so far.
double worst_cached_vs_recompute(const Variant& v, int64_t steps) {
  ModelConfig cfg = resolve_model_config("debug");
  v.edit(cfg);
  cfg.max_position_embeddings = std::max<int64_t>(cfg.max_position_embeddings, 320);
  DeepSeekModel model(cfg);
  model.init_weights(3);
  if (v.lora) randomize_lora(model);
  LatentKvCache cache(cfg, 2, 320);
  const int64_t slot = 1;  // not slot 0, so slot offsets are exercised
  const int64_t V = cfg.vocab_size;
  std::vector<int32_t> seq;
  {
    const Tensor p = random_tokens(40, 256, 17);
    seq.assign(p.i32(), p.i32() + 40);
  }
  Tensor last;
  for (int64_t past = 0; past < 40; past += 16) {
    const CachedChunk chunk{slot, past, std::min<int64_t>(16, 40 - past)};
    last = model.forward_cached(tokens_of(seq, past, chunk.count), {&chunk, 1}, cache.layers());
  }
  double worst = 0;
  Rng rng(4);
  for (int64_t step = 0; step <= steps; ++step) {
    const int64_t L = static_cast<int64_t>(seq.size());
    const Tensor full = model.logits(tokens_of(seq), BatchShape{1, L});
    worst = std::max(worst, row_error(last.f32(), full.f32() + (L - 1) * V, V));
    if (step == steps) break;
    seq.push_back(static_cast<int32_t>(rng.next_u64() % 256));
    const CachedChunk chunk{slot, L, 1};
    last = model.forward_cached(tokens_of(seq, L, 1), {&chunk, 1}, cache.layers());
  }
  EXPECT_FALSE(model.has_saved());
  return worst;
}

const Variant kVariants[] = {
    {"sigmoid router", [](ModelConfig&) {}},
    {"softmax router, greedy", [](ModelConfig& c) {
       c.scoring_func = "softmax";
       c.topk_method = "greedy";
       c.n_group = 1, c.topk_group = 1;
     }},
    {"YaRN, q_lora_rank", [](ModelConfig& c) {
       c.rope_scaling.type = "yarn";
       c.rope_scaling.factor = 4.0;
       c.rope_scaling.original_max_position_embeddings = 64;
       c.rope_scaling.mscale = 1.0;
       c.rope_scaling.mscale_all_dim = 1.0;
       c.q_lora_rank = 24;
     }},
    {"MXFP4 experts", [](ModelConfig& c) { c.expert_format = "mxfp4"; }},
    {"MXFP4 experts + LoRA", [](ModelConfig& c) { c.expert_format = "mxfp4"; }, true},
};

}  // namespace

TEST(CachedDecoding, LogitsEqualAFullRecomputeAtEveryStepFor256Steps) {
  for (const Variant& v : kVariants) {
    const double err = worst_cached_vs_recompute(v, 256);
    std::printf("%-24s worst relative logits error %.2e\n", v.name, err);
    EXPECT_LT(err, 1e-5) << v.name;
    // Different summation orders, so not bitwise; but far from an unrelated row.
    EXPECT_GT(err, 0.0) << v.name << ": suspicious, the cached path may be the recompute";
  }
}

TEST(CachedDecoding, BatchedSequencesOfDifferentLengthsEqualEachAlone) {
  ModelConfig cfg = resolve_model_config("debug");
  cfg.expert_format = "mxfp4";
  DeepSeekModel model(cfg);
  model.init_weights(8);
  randomize_lora(model);
  const int64_t V = cfg.vocab_size;
  const std::vector<int64_t> prompt_len = {5, 23, 1};
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < prompt_len.size(); ++i) {
    const Tensor p = random_tokens(prompt_len[i] + 12, 256, 40 + i);
    seqs.emplace_back(p.i32(), p.i32() + p.numel());
  }
  // Alone: each sequence in its own cache, its prompt in one chunk, then 12 single steps.
  std::vector<std::vector<float>> alone(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    LatentKvCache cache(cfg, 1, 64);
    int64_t past = 0;
    const CachedChunk first{0, 0, prompt_len[i]};
    Tensor l = model.forward_cached(tokens_of(seqs[i], 0, prompt_len[i]), {&first, 1},
                                    cache.layers());
    alone[i].insert(alone[i].end(), l.f32(), l.f32() + V);
    past = prompt_len[i];
    for (int step = 0; step < 12; ++step, ++past) {
      const CachedChunk c{0, past, 1};
      l = model.forward_cached(tokens_of(seqs[i], past, 1), {&c, 1}, cache.layers());
      alone[i].insert(alone[i].end(), l.f32(), l.f32() + V);
    }
  }
  // Batched: all prompts in one forward (three chunks), then 12 steps of three rows, in three
  // cache slots in reverse order.
  LatentKvCache cache(cfg, 3, 64);
  std::vector<std::vector<float>> batched(seqs.size());
  std::vector<CachedChunk> chunks;
  std::vector<int32_t> ids;
  for (size_t i = 0; i < seqs.size(); ++i) {
    chunks.push_back({static_cast<int64_t>(2 - i), 0, prompt_len[i]});
    ids.insert(ids.end(), seqs[i].begin(), seqs[i].begin() + prompt_len[i]);
  }
  for (int step = 0; step <= 12; ++step) {
    const Tensor l = model.forward_cached(tokens_of(ids), chunks, cache.layers());
    for (size_t i = 0; i < seqs.size(); ++i)
      batched[i].insert(batched[i].end(), l.f32() + i * V, l.f32() + (i + 1) * V);
    if (step == 12) break;  // every token consumed
    ids.clear();
    for (size_t i = 0; i < seqs.size(); ++i) {
      chunks[i].past += chunks[i].count;
      chunks[i].count = 1;
      ids.push_back(seqs[i][static_cast<size_t>(chunks[i].past)]);
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_EQ(alone[i].size(), batched[i].size());
    EXPECT_EQ(std::memcmp(alone[i].data(), batched[i].data(), alone[i].size() * sizeof(float)), 0)
        << "sequence " << i;
  }
}

TEST(CachedDecoding, LeavesNothingBehindAndTakesZeroRows) {
  ModelConfig cfg = resolve_model_config("debug");
  DeepSeekModel model(cfg);
  model.init_weights(1);
  LatentKvCache cache(cfg, 2, 32);
  EXPECT_EQ(MemoryTracker::instance().current(MemCategory::KvCache) >= cache.bytes(), true);
  EXPECT_EQ(cache.bytes(), 2 * 32 * LatentKvCache::bytes_per_token(cfg));
  const int64_t act = MemoryTracker::instance().current(MemCategory::Activations);
  const int64_t routing = MemoryTracker::instance().current(MemCategory::Routing);
  for (int64_t past = 0; past < 8; ++past) {
    const CachedChunk c{1, past, 1};
    (void)model.forward_cached(random_tokens(1, 256, past), {&c, 1}, cache.layers());
    EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Activations), act);
    EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Routing), routing);
    EXPECT_FALSE(model.has_saved());
  }
  // No rows at all (an expert-parallel rank without requests): no logits, no error.
  const Tensor none = Tensor::empty({0}, DType::I32, MemCategory::Activations);
  const Tensor l = model.forward_cached(none, {}, cache.layers());
  EXPECT_EQ(l.dim(0), 0);
  // A chunk past the cache's end is an error naming the positions.
  const CachedChunk too_far{0, 30, 4};
  const std::string err = error_of([&] {
    model.forward_cached(random_tokens(4, 256, 1), {&too_far, 1}, cache.layers());
  });
  EXPECT_NE(err.find("exceeds the cache's 32 positions"), std::string::npos) << err;
}

TEST(CachedDecoding, ShortChunksRunAbsorbedAndLongPrefillsExpanded) {
  // The tests above rely on both forms running: 16-token prefill chunks expanded, single
  // decode tokens absorbed (debug config: kv_lora_rank 32, nope 16, rope 8, v 16).
  MLAttention a;
  a.init("model.layers.0.self_attn.", resolve_model_config("debug"));
  EXPECT_FALSE(a.absorbed_for(16, 0));
  EXPECT_TRUE(a.absorbed_for(8, 32));
  EXPECT_TRUE(a.absorbed_for(1, 10));
  EXPECT_TRUE(a.absorbed_for(1, 300));
  EXPECT_TRUE(a.absorbed_for(2, 40));
}

TEST(CachedDecoding, SlotsAreHandedOutAndTakenBack) {
  ModelConfig cfg = resolve_model_config("debug");
  LatentKvCache cache(cfg, 2, 8);
  EXPECT_EQ(cache.acquire(), 0);
  EXPECT_EQ(cache.acquire(), 1);
  EXPECT_EQ(cache.acquire(), -1);
  cache.release(0);
  EXPECT_EQ(cache.free_slots(), 1);
  EXPECT_EQ(cache.acquire(), 0);
  EXPECT_NE(error_of([&] { cache.release(5); }).find("not in use"), std::string::npos);
}
