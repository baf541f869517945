// Cached inference over DeepSeek-V4 (model/v4/v4_cache.h, DeepSeekV4Model::forward_cached)
// against full recomputes, for every layer kind (sliding window only, CSA with its indexer, HCA),
// hash and top-k routing, fp32 and MXFP4 experts, DeepSeek's simulated FP8 / FP4 (the
// quantization_simulation option): the same logits bit for bit at every step and
// for every chunking, batching that never changes a sequence's bits, zero rows, nothing left
// behind, the cache's size, caches of the other family refused, and the generation engine.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/memory.h"
#include "data/tokenizer.h"
#include "infer/generation.h"
#include "infer/sampling.h"
#include "io/hf_config.h"
#include "io/model_spec.h"
#include "model/latent_kv_cache.h"
#include "model/model.h"
#include "model/v4/v4_cache.h"
#include "model/v4/v4_model.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

const std::filesystem::path kFixtures = std::filesystem::path(MOE_SOURCE_DIR) / "tests/fixtures/v4";

// The mtp fixture's tiny V4 (hidden 64, 4 heads of 32, window 8, index_topk 3) with four layers:
// sliding only, CSA (ratio 4), HCA at ratio 8 (so that entries complete within short sequences),
// CSA again; the first layer hash-routed. A 70-token sequence crosses 17 CSA windows (the
// indexer scores from position 15 on, where more than 3 entries are visible), 8 HCA windows, the
// window many times over, and three of the training forward's 32-row query blocks.
ModelConfig every_layer_kind() {
  ModelConfig c = read_hf_config(kFixtures / "mtp");
  c.num_hidden_layers = 4;
  c.compress_ratios = {0, 4, 8, 4, 0};
  c.num_hash_layers = 1;
  c.max_position_embeddings = 256;
  return c;
}

struct Variant {
  const char* name;
  void (*edit)(ModelConfig&);
  bool lora = false;
};

const Variant kVariants[] = {
    {"every layer kind", [](ModelConfig&) {}},
    {"MXFP4 experts", [](ModelConfig& c) { c.expert_format = "mxfp4"; }},
    {"MXFP4 experts + LoRA", [](ModelConfig& c) { c.expert_format = "mxfp4"; }, true},
    // 8 heads (16-row blocks), a 5-token window, top-2 picks, two hash layers, HCA first, no MTP.
    {"8 heads, window 5, no MTP", [](ModelConfig& c) {
       c.num_attention_heads = 8;
       c.o_groups = 4;
       c.sliding_window = 5;
       c.index_topk = 2;
       c.num_hash_layers = 2;
       c.compress_ratios = {8, 4, 0, 4};
       c.num_nextn_predict_layers = 0;
     }},
    // DeepSeek's reference forward's simulated precision: FP8 window rows and entries (head_dim
    // 80: one block of 64 non-RoPE features), Hadamard + FP4 indexer queries and keys.
    {"quantization simulation", [](ModelConfig& c) {
       c.head_dim = 80;
       c.quantization_simulation = "reference";
     }},
};

ModelConfig config_of(const Variant& v) {
  ModelConfig c = every_layer_kind();
  v.edit(c);
  c.validate("test config");
  return c;
}

// Adapters on every linear (attention, shared and routed experts), applied unmerged.
void maybe_add_lora(DeepSeekV4Model& model, const Variant& v) {
  if (!v.lora) return;
  LoraSettings s;
  s.r = 4;
  s.alpha = 8;
  model.add_lora(s, 5);
  // PEFT starts B at zero; random B makes every adapter change the logits.
  Rng rng(9);
  for (Param* p : model.lora_params()) fill_random(p->value, rng, 0.05f);
}

Tensor tokens_of(const std::vector<int32_t>& ids, size_t from = 0, size_t count = SIZE_MAX) {
  count = std::min(count, ids.size() - from);
  Tensor t = Tensor::empty({static_cast<int64_t>(count)}, DType::I32, MemCategory::Activations);
  std::copy_n(ids.begin() + static_cast<std::ptrdiff_t>(from), count, t.i32());
  return t;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  const Tensor t = random_tokens(n, vocab, seed);
  return {t.i32(), t.i32() + n};
}

// max |a - b| / max |b| over n values.
double rel_diff(const float* a, const float* b, int64_t n) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
    ref = std::max(ref, static_cast<double>(std::abs(b[i])));
  }
  return diff / ref;
}

bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

Tensor full_logits(DeepSeekV4Model& model, const std::vector<int32_t>& ids) {
  const int64_t L = static_cast<int64_t>(ids.size());
  return model.logits(tokens_of(ids), BatchShape{1, L});
}

// Runs a prompt through a cache in chunks of the given sizes (every row's logits), then decodes
// the rest of `seq` one token at a time; returns each forward's logits, concatenated.
std::vector<float> cached_run(DeepSeekV4Model& model, InferenceCache& cache, int64_t slot,
                              const std::vector<int32_t>& seq, const std::vector<int64_t>& chunks) {
  const int64_t V = model.config().vocab_size;
  std::vector<float> out;
  int64_t past = 0;
  for (int64_t n : chunks) {
    const CachedChunk c{slot, past, n};
    const Tensor l = model.forward_cached(tokens_of(seq, static_cast<size_t>(past), n), {&c, 1},
                                          cache, /*all_rows=*/true);
    out.insert(out.end(), l.f32(), l.f32() + n * V);
    past += n;
  }
  for (; past < static_cast<int64_t>(seq.size()); ++past) {
    const CachedChunk c{slot, past, 1};
    const Tensor l = model.forward_cached(tokens_of(seq, static_cast<size_t>(past), 1), {&c, 1},
                                          cache);
    out.insert(out.end(), l.f32(), l.f32() + V);
  }
  return out;
}

}  // namespace

TEST(V4CachedDecoding, LogitsEqualAFullRecomputeAtEveryStep) {
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    const ModelConfig cfg = config_of(v);
    DeepSeekV4Model model(cfg);
    model.init_weights(3);
    maybe_add_lora(model, v);
    const int64_t V = cfg.vocab_size;
    const std::vector<int32_t> seq = random_ids(72, V, 17);
    V4KvCache cache(cfg, 2, 80);
    const int64_t slot = 1;  // not slot 0, so slot offsets are exercised
    // A 13-token prompt (every row compared), then 59 decode steps.
    const int64_t prompt = 13;
    const CachedChunk first{slot, 0, prompt};
    Tensor l = model.forward_cached(tokens_of(seq, 0, prompt), {&first, 1}, cache, true);
    std::vector<int32_t> ids(seq.begin(), seq.begin() + prompt);
    const Tensor full = full_logits(model, ids);
    double worst = rel_diff(l.f32(), full.f32(), prompt * V);
    int64_t differing = same_bits(l.f32(), full.f32(), prompt * V) ? 0 : 1;
    for (int64_t past = prompt; past < static_cast<int64_t>(seq.size()); ++past) {
      const CachedChunk c{slot, past, 1};
      l = model.forward_cached(tokens_of(seq, static_cast<size_t>(past), 1), {&c, 1}, cache);
      ids.push_back(seq[static_cast<size_t>(past)]);
      const Tensor f = full_logits(model, ids);
      const float* want = f.f32() + past * V;
      worst = std::max(worst, rel_diff(l.f32(), want, V));
      differing += same_bits(l.f32(), want, V) ? 0 : 1;
    }
    std::printf("%-28s worst relative logits error %.2e, %lld of 60 forwards not bitwise\n",
                v.name, worst, static_cast<long long>(differing));
    // Every part computes a row as the whole-sequence forward does (v4_cached.cpp): the same bits.
    EXPECT_EQ(differing, 0);
    EXPECT_LT(worst, 1e-6);
    EXPECT_FALSE(model.has_saved());
  }
}

TEST(V4CachedDecoding, PromptChunksOfAnySizeEqualOneChunk) {
  for (const Variant& v : {kVariants[0], kVariants[4]}) {
    SCOPED_TRACE(v.name);
    const ModelConfig cfg = config_of(v);
    DeepSeekV4Model model(cfg);
    model.init_weights(5);
    const std::vector<int32_t> seq = random_ids(60, cfg.vocab_size, 23);
    V4KvCache a(cfg, 1, 64), b(cfg, 1, 64), c(cfg, 1, 64);
    // 45 prompt tokens: one chunk; odd pieces that end inside and across windows, blocks and the
    // sliding window; one token at a time. Then 15 decode steps each.
    const std::vector<float> one = cached_run(model, a, 0, seq, {45});
    const std::vector<float> odd = cached_run(model, b, 0, seq, {1, 6, 13, 2, 23});
    const std::vector<int64_t> singles(45, 1);
    const std::vector<float> single = cached_run(model, c, 0, seq, singles);
    ASSERT_EQ(one.size(), odd.size());
    ASSERT_EQ(one.size(), single.size());
    EXPECT_TRUE(same_bits(one.data(), odd.data(), static_cast<int64_t>(one.size())));
    EXPECT_TRUE(same_bits(one.data(), single.data(), static_cast<int64_t>(one.size())));
  }
}

TEST(V4CachedDecoding, BatchedSequencesOfDifferentLengthsEqualEachAlone) {
  for (const Variant& v : {kVariants[2], kVariants[3], kVariants[4]}) {
    SCOPED_TRACE(v.name);
    const ModelConfig cfg = config_of(v);
    DeepSeekV4Model model(cfg);
    model.init_weights(8);
    maybe_add_lora(model, v);
    const int64_t V = cfg.vocab_size, steps = 24;
    const std::vector<int64_t> prompt_len = {5, 23, 1, 17};
    std::vector<std::vector<int32_t>> seqs;
    for (size_t i = 0; i < prompt_len.size(); ++i)
      seqs.push_back(random_ids(prompt_len[i] + steps, V, 40 + i));
    // Alone: each sequence in its own cache, its prompt in one chunk, then single steps.
    std::vector<std::vector<float>> alone(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      V4KvCache cache(cfg, 1, 64);
      alone[i] = cached_run(model, cache, 0, seqs[i], {prompt_len[i]});
      // cached_run keeps every prompt row: keep the last one only, as the batched run does.
      alone[i].erase(alone[i].begin(),
                     alone[i].begin() + static_cast<std::ptrdiff_t>((prompt_len[i] - 1) * V));
    }
    // Batched: all prompts in one forward, then steps of four rows, in cache slots in reverse
    // order; one sequence joins a step late with its prompt beside the others' decode tokens.
    V4KvCache cache(cfg, 4, 64);
    std::vector<std::vector<float>> batched(seqs.size());
    std::vector<CachedChunk> chunks;
    std::vector<int32_t> ids;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t n = i == 3 ? 0 : prompt_len[i];  // the last one waits a step
      chunks.push_back({static_cast<int64_t>(3 - i), 0, n});
      ids.insert(ids.end(), seqs[i].begin(), seqs[i].begin() + n);
    }
    for (int step = 0; step <= steps + 1; ++step) {
      const Tensor l = model.forward_cached(tokens_of(ids), chunks, cache);
      int64_t out_row = 0;
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (chunks[i].count == 0) continue;
        batched[i].insert(batched[i].end(), l.f32() + out_row * V, l.f32() + (out_row + 1) * V);
        ++out_row;
      }
      ids.clear();
      for (size_t i = 0; i < seqs.size(); ++i) {
        CachedChunk& c = chunks[i];
        if (i == 3 && step == 0) {
          c.count = prompt_len[i];  // its prompt now
        } else {
          c.past += c.count;
          c.count = c.past < static_cast<int64_t>(seqs[i].size()) ? 1 : 0;
        }
        ids.insert(ids.end(), seqs[i].begin() + c.past, seqs[i].begin() + c.past + c.count);
      }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      ASSERT_EQ(alone[i].size(), batched[i].size()) << "sequence " << i;
      EXPECT_TRUE(same_bits(alone[i].data(), batched[i].data(),
                            static_cast<int64_t>(alone[i].size())))
          << "sequence " << i;
    }
  }
}

TEST(V4CachedDecoding, TakesZeroRowsLeavesNothingBehindAndKeepsMemoryFlat) {
  const ModelConfig cfg = config_of(kVariants[0]);
  DeepSeekV4Model model(cfg);
  model.init_weights(1);
  auto& mem = MemoryTracker::instance();
  const int64_t kv0 = mem.current(MemCategory::KvCache);
  V4KvCache cache(cfg, 2, 200);
  EXPECT_EQ(cache.bytes(), V4KvCache::bytes_for(cfg, 2, 200));
  EXPECT_EQ(mem.current(MemCategory::KvCache) - kv0, cache.bytes());
  model.reserve_positions(200);  // the RoPE tables (Weights) grow once, up front
  const std::vector<MemCategory> flat = {MemCategory::Activations, MemCategory::Routing,
                                         MemCategory::Scratch, MemCategory::KvCache,
                                         MemCategory::Weights};
  std::vector<int64_t> before;
  for (MemCategory m : flat) before.push_back(mem.current(m));
  // No rows at all (an expert-parallel rank without requests): no logits, no error; also a
  // forward whose only chunk is empty.
  const Tensor none = Tensor::empty({0}, DType::I32, MemCategory::Activations);
  EXPECT_EQ(model.forward_cached(none, {}, cache).dim(0), 0);
  const CachedChunk empty{0, 0, 0};
  EXPECT_EQ(model.forward_cached(none, {&empty, 1}, cache).dim(0), 0);
  // 190 decode steps of two sequences: far past the window and many windows of every ratio.
  const std::vector<int32_t> seq = random_ids(190, cfg.vocab_size, 2);
  for (int64_t past = 0; past < 190; ++past) {
    const CachedChunk c[2] = {{0, past, 1}, {1, past, 1}};
    const std::vector<int32_t> ids = {seq[static_cast<size_t>(past)],
                                      seq[static_cast<size_t>(189 - past)]};
    (void)model.forward_cached(tokens_of(ids), c, cache);
    EXPECT_FALSE(model.has_saved());
    for (size_t i = 0; i < flat.size(); ++i)
      ASSERT_EQ(mem.current(flat[i]), before[i]) << "category " << i << " at step " << past;
  }
}

TEST(V4CachedDecoding, TheCacheSizeIsWhatMoeInfoPrints) {
  const ModelConfig cfg = config_of(kVariants[0]);
  // A length that every ratio divides, past the window and every state ring: rings + entries.
  EXPECT_DOUBLE_EQ(static_cast<double>(V4KvCache::bytes_for(cfg, 1, 64)),
                   static_cast<double>(V4KvCache::ring_bytes_per_sequence(cfg)) +
                       64 * V4KvCache::entry_bytes_per_token(cfg));
  EXPECT_EQ(V4KvCache::bytes_for(cfg, 3, 64), 3 * V4KvCache::bytes_for(cfg, 1, 64));
  // A one-position cache (an expert-parallel rank's) keeps one row per ring and no entries.
  const int64_t window = 4 * 32;              // each layer's window row (head_dim 32)
  const int64_t csa = 2 * (2 * 64 + 2 * 64);  // two CSA layers: c and z of 64 features, twice
                                              // (compressor and indexer)
  const int64_t hca = 2 * 32;                 // the HCA layer's c and z
  EXPECT_EQ(V4KvCache::bytes_for(cfg, 1, 1), 4 * (window + csa + hca));
  const ModelConfig flash = resolve_model_config("deepseek-v4-flash");
  std::printf("deepseek-v4-flash: %.0f B per token (entries) + %lld B per sequence (rings); "
              "%lld B for one sequence of 4096\n",
              V4KvCache::entry_bytes_per_token(flash),
              static_cast<long long>(V4KvCache::ring_bytes_per_sequence(flash)),
              static_cast<long long>(V4KvCache::bytes_for(flash, 1, 4096)));
  // 21 CSA layers x (512 + 128) / 4 floats + 20 HCA layers x 512 / 128 floats per token.
  EXPECT_DOUBLE_EQ(V4KvCache::entry_bytes_per_token(flash), 21 * 640 + 20 * 16);
  // 43 windows of 128 x 512, 21 CSA rings of 8 x (1024 + 256) c and z, 20 HCA of 128 x 512.
  EXPECT_EQ(V4KvCache::ring_bytes_per_sequence(flash),
            4 * (43 * 128 * 512 + 21 * 2 * 8 * (1024 + 256) + 20 * 2 * 128 * 512));
}

TEST(V4CachedDecoding, ChunksOutsideTheCacheAndTheOtherFamilysCachesAreRefused) {
  const ModelConfig cfg = config_of(kVariants[0]);
  DeepSeekV4Model model(cfg);
  model.init_weights(1);
  V4KvCache cache(cfg, 2, 32);
  const CachedChunk too_far{0, 30, 4};
  std::string err = error_of([&] {
    model.forward_cached(random_tokens(4, 128, 1), {&too_far, 1}, cache);
  });
  EXPECT_NE(err.find("exceeds the cache's 32 positions"), std::string::npos) << err;
  const CachedChunk bad_slot{2, 0, 1};
  err = error_of([&] { model.forward_cached(random_tokens(1, 128, 1), {&bad_slot, 1}, cache); });
  EXPECT_NE(err.find("slot 2 is outside the cache's 2 slots"), std::string::npos) << err;
  const CachedChunk twice[2] = {{1, 0, 2}, {1, 2, 1}};
  err = error_of([&] { model.forward_cached(random_tokens(3, 128, 1), twice, cache); });
  EXPECT_NE(err.find("slot 1 has two chunks"), std::string::npos) << err;
  const CachedChunk short_chunk{0, 0, 2};
  err = error_of([&] { model.forward_cached(random_tokens(3, 128, 1), {&short_chunk, 1}, cache); });
  EXPECT_NE(err.find("the chunks hold 2 tokens but the input has 3 rows"), std::string::npos)
      << err;

  // A V3 cache in a V4 model and a V4 cache in a V3 model.
  const ModelConfig v3cfg = resolve_model_config("debug");
  DeepSeekModel v3(v3cfg);
  v3.init_weights(1);
  LatentKvCache latent(v3cfg, 1, 8);
  const CachedChunk c{0, 0, 1};
  err = error_of([&] { model.forward_cached(random_tokens(1, 128, 1), {&c, 1}, latent); });
  EXPECT_NE(err.find("the cache was not made by a deepseek_v4 model"), std::string::npos) << err;
  err = error_of([&] { v3.forward_cached(random_tokens(1, 128, 1), {&c, 1}, cache); });
  EXPECT_NE(err.find("the cache was not made by a deepseek_v3 model"), std::string::npos) << err;
  // And one of another V4 configuration.
  const ModelConfig other = config_of(kVariants[3]);
  V4KvCache foreign(other, 1, 8);
  err = error_of([&] { model.forward_cached(random_tokens(1, 128, 1), {&c, 1}, foreign); });
  EXPECT_NE(err.find("made for another deepseek_v4 configuration"), std::string::npos) << err;
  // make_cache is the model's own kind.
  EXPECT_NE(dynamic_cast<V4KvCache*>(model.make_cache(1, 4).get()), nullptr);
}

TEST(V4CachedDecoding, TheEngineGeneratesGreedilyAsAFullRecomputeAndBatchesExactly) {
  ModelConfig cfg = config_of(kVariants[0]);
  cfg.vocab_size = 264;  // the byte tokenizer's 257 ids, padded
  DeepSeekV4Model model(cfg);
  model.init_weights(21);
  const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  auto request = [](const std::string& prompt, int64_t max_tokens, uint64_t seed,
                    double temperature) {
    GenerationRequest r;
    r.prompt = ByteTokenizer::encode(prompt);
    r.max_tokens = max_tokens;
    r.seed = seed;
    r.sampling.temperature = temperature;
    r.sampling.top_k = 50;
    return r;
  };
  struct Outcome {
    std::vector<int32_t> ids;
    bool finished = false;
  };
  auto collect = [](Outcome& o) {
    return [&o](const GenerationUpdate& u) {
      if (u.finished) {
        o.finished = true;
        o.ids = u.completion_ids;
      }
    };
  };

  // Greedy through the engine equals greedy over full recomputes.
  EngineOptions options;
  options.context = 128;
  Outcome greedy;
  {
    GenerationEngine engine(model, *tok, options);
    engine.submit(request("And God said", 40, 0, 0.0), collect(greedy));
    engine.run_until_idle();
  }
  std::vector<int32_t> ids = ByteTokenizer::encode("And God said");
  const size_t prompt = ids.size();
  for (int n = 0; n < 40; ++n) {
    const Tensor logits = full_logits(model, ids);
    SamplingOptions s;
    s.temperature = 0;
    Rng rng(0);
    ids.push_back(sample_token(logits.f32() + (static_cast<int64_t>(ids.size()) - 1) * cfg.vocab_size,
                               257, s, rng));
    if (ids.back() == ByteTokenizer::kEndOfText) break;
  }
  ASSERT_TRUE(greedy.finished);
  EXPECT_EQ(greedy.ids,
            std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(prompt), ids.end()));

  // Sampled requests queued and batched (two slots, 8-token prompt chunks) get what they get
  // alone.
  const std::vector<std::string> prompts = {"In the beginning", "a",
                                            "Light was made on the first day"};
  std::vector<Outcome> alone(prompts.size()), together(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineOptions o = options;
    o.max_sequences = 1;
    GenerationEngine engine(model, *tok, o);
    engine.submit(request(prompts[i], 30, 100 + i, 0.9), collect(alone[i]));
    engine.run_until_idle();
  }
  EngineOptions o = options;
  o.max_sequences = 2;
  o.prefill_chunk = 8;
  o.max_step_tokens = 9;
  GenerationEngine engine(model, *tok, o);
  for (size_t i = 0; i < prompts.size(); ++i)
    engine.submit(request(prompts[i], 30, 100 + i, 0.9), collect(together[i]));
  engine.run_until_idle();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(alone[i].finished && together[i].finished) << prompts[i];
    EXPECT_EQ(alone[i].ids, together[i].ids) << prompts[i];
  }
  EXPECT_FALSE(model.has_saved());
}
