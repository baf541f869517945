// The continuous-batching engine (infer/generation.h): batched and queued requests give each
// request the tokens it gets alone, greedy decoding equals a full recompute's, every way a
// request ends, cancellation, a full queue, and memory that stays flat over many requests.
#include <atomic>
#include <deque>
#include <thread>
#include <map>

#include "core/memory.h"
#include "core/parallel.h"
#include "infer/generation.h"
#include "model/model.h"
#include "infer/inference_model.h"
#include "io/checkpoint.h"
#include "io/model_spec.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

ModelConfig config() {
  ModelConfig c = resolve_model_config("debug");
  c.vocab_size = 264;  // the byte tokenizer's 257 ids, padded
  return c;
}

struct Outcome {
  std::string text;
  FinishReason reason = FinishReason::Stop;
  int64_t prompt_tokens = 0, completion_tokens = 0, updates = 0;
  std::vector<int32_t> ids;
  bool finished = false;
};

UpdateSink collect(Outcome& o) {
  return [&o](const GenerationUpdate& u) {
    EXPECT_FALSE(o.finished) << "an update after the final one";
    o.text += u.text;
    ++o.updates;
    if (u.finished) {
      o.finished = true;
      o.reason = u.reason;
      o.prompt_tokens = u.prompt_tokens;
      o.completion_tokens = u.completion_tokens;
      o.ids = u.completion_ids;
    }
  };
}

GenerationRequest request(const std::string& prompt, int64_t max_tokens, uint64_t seed,
                          double temperature = 0.9) {
  GenerationRequest r;
  r.prompt = ByteTokenizer::encode(prompt);
  r.max_tokens = max_tokens;
  r.seed = seed;
  r.sampling.temperature = temperature;
  r.sampling.top_k = 50;
  return r;
}

struct Fixture {
  ModelConfig cfg = config();
  DeepSeekModel model{cfg};
  std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  Fixture() { model.init_weights(21); }
};

}  // namespace

TEST(Generation, QueuedAndBatchedRequestsGetTheTokensTheyGetAlone) {
  Fixture f;
  const std::vector<std::string> prompts = {"In the beginning", "a", "Light was made on the first day",
                                            "and the evening and the morning"};
  std::vector<Outcome> alone(prompts.size()), together(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineOptions o;
    o.max_sequences = 1;
    GenerationEngine engine(f.model, *f.tok, o);
    engine.submit(request(prompts[i], 24, 100 + i), collect(alone[i]));
    engine.run_until_idle();
  }
  // Two slots for four requests, 8-token prompt chunks and at most 9 rows per forward: requests
  // wait for slots and prompts wait for room, in every combination with decode tokens.
  EngineOptions o;
  o.max_sequences = 2;
  o.prefill_chunk = 8;
  o.max_step_tokens = 9;
  GenerationEngine engine(f.model, *f.tok, o);
  for (size_t i = 0; i < prompts.size(); ++i)
    engine.submit(request(prompts[i], 24, 100 + i), collect(together[i]));
  engine.run_until_idle();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(alone[i].finished && together[i].finished);
    EXPECT_EQ(alone[i].ids, together[i].ids) << prompts[i];
    EXPECT_EQ(alone[i].text, together[i].text) << prompts[i];
    EXPECT_EQ(together[i].completion_tokens, 24);
    EXPECT_EQ(together[i].reason, FinishReason::Length);
    EXPECT_EQ(together[i].prompt_tokens, static_cast<int64_t>(prompts[i].size()));
  }
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.generated_tokens, 4 * 24);
  int64_t prompt_total = 0;
  for (const auto& p : prompts) prompt_total += static_cast<int64_t>(p.size());
  EXPECT_EQ(s.prompt_tokens, prompt_total);
  EXPECT_EQ(s.requests_finished, 4);
}

TEST(Generation, GreedyDecodingEqualsAFullRecompute) {
  Fixture f;
  Outcome o;
  GenerationEngine engine(f.model, *f.tok, EngineOptions{});
  engine.submit(request("And God said", 40, 0, /*temperature=*/0.0), collect(o));
  engine.run_until_idle();
  const std::vector<int32_t> prompt = ByteTokenizer::encode("And God said");
  std::vector<int32_t> ids = prompt;
  for (int n = 0; n < 40; ++n) {
    Tensor t = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::I32, MemCategory::Activations);
    std::copy(ids.begin(), ids.end(), t.i32());
    const Tensor logits = f.model.logits(t, {1, t.numel()});
    SamplingOptions greedy;
    greedy.temperature = 0;
    Rng rng(0);
    ids.push_back(sample_token(logits.f32() + (t.numel() - 1) * f.cfg.vocab_size, 257, greedy, rng));
    if (ids.back() == ByteTokenizer::kEndOfText) break;
  }
  ASSERT_EQ(o.completion_tokens, 40);
  EXPECT_EQ(o.ids, std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(prompt.size()), ids.end()));
}

TEST(Generation, StopStringsStopIdsMaxTokensAndTheContext) {
  Fixture f;
  // Find what greedy decoding says, then stop on a piece of it.
  Outcome free_run;
  {
    GenerationEngine e(f.model, *f.tok, EngineOptions{});
    e.submit(request("Let there be", 30, 0, 0.0), collect(free_run));
    e.run_until_idle();
  }
  ASSERT_GE(free_run.text.size(), 10u);
  // The random model's text is mostly replacement characters: stop on its third code point.
  size_t begin = 0, n = 0;
  while (n < 2) begin += 1 + (static_cast<unsigned char>(free_run.text[begin]) >= 0x80 ? 2 : 0), ++n;
  const size_t len = static_cast<unsigned char>(free_run.text[begin]) >= 0x80 ? 3 : 1;
  const std::string stop = free_run.text.substr(begin, len);
  const size_t at = free_run.text.find(stop);
  Outcome stopped;
  {
    GenerationEngine e(f.model, *f.tok, EngineOptions{});
    GenerationRequest r = request("Let there be", 30, 0, 0.0);
    r.stop = {stop};
    e.submit(r, collect(stopped));
    e.run_until_idle();
  }
  EXPECT_EQ(stopped.reason, FinishReason::Stop);
  EXPECT_EQ(stopped.text, free_run.text.substr(0, at));

  // A stop id: the first generated byte itself.
  Outcome by_id;
  {
    GenerationEngine e(f.model, *f.tok, EngineOptions{});
    GenerationRequest r = request("Let there be", 30, 0, 0.0);
    r.stop_ids = {static_cast<unsigned char>(free_run.text[0])};
    e.submit(r, collect(by_id));
    e.run_until_idle();
  }
  EXPECT_EQ(by_id.reason, FinishReason::Stop);
  EXPECT_EQ(by_id.text, "");
  EXPECT_EQ(by_id.completion_tokens, 1);

  // The context: 20 positions, a 12-token prompt: 8 tokens fit, whatever max_tokens says.
  Outcome ctx;
  {
    EngineOptions o;
    o.context = 20;
    GenerationEngine e(f.model, *f.tok, o);
    e.submit(request("Let there be", 100, 0, 0.0), collect(ctx));
    e.run_until_idle();
    EXPECT_NE(error_of([&] { e.submit(request(std::string(20, 'x'), 1, 0), nullptr); })
                  .find("leaves no room in the context of 20"),
              std::string::npos);
    EXPECT_NE(error_of([&] { e.submit(request("", 1, 0), nullptr); }).find("at least one"),
              std::string::npos);
    GenerationRequest bad = request("x", 1, 0);
    bad.sampling.top_p = 0;
    EXPECT_NE(error_of([&] { e.submit(bad, nullptr); }).find("top_p"), std::string::npos);
  }
  EXPECT_EQ(ctx.reason, FinishReason::Length);
  EXPECT_EQ(ctx.completion_tokens, 8);
}

TEST(Generation, CancelFreesTheSlotAndAFullQueueRefuses) {
  Fixture f;
  EngineOptions o;
  o.max_sequences = 1;
  o.max_queued = 1;
  GenerationEngine engine(f.model, *f.tok, o);
  Outcome a, b;
  const int64_t ia = engine.submit(request("first", 1000, 1), collect(a));
  const int64_t ib = engine.submit(request("second", 5, 2), collect(b));
  EXPECT_GE(ia, 0);
  EXPECT_GE(ib, 0);
  Outcome c;
  EXPECT_EQ(engine.submit(request("third", 5, 3), collect(c)), -1);  // one active, one waiting
  for (int i = 0; i < 5; ++i) engine.step();
  EXPECT_FALSE(a.finished);
  EXPECT_EQ(engine.active(), 1);
  engine.cancel(ia);
  engine.run_until_idle();
  EXPECT_TRUE(a.finished);
  EXPECT_EQ(a.reason, FinishReason::Cancelled);
  EXPECT_TRUE(b.finished);
  EXPECT_EQ(b.reason, FinishReason::Length);
  EXPECT_EQ(engine.cache().free_slots(), 1);
  engine.cancel(ia);  // finished already: nothing happens
  EXPECT_FALSE(engine.step());
}

TEST(Generation, TrackedMemoryIsFlatOverManyRequests) {
  Fixture f;
  EngineOptions o;
  o.max_sequences = 3;
  GenerationEngine engine(f.model, *f.tok, o);
  std::map<int, MemSnapshot> at;
  std::deque<Outcome> outcomes;  // the sinks write into them until their requests finish
  for (int n = 1; n <= 300; ++n) {
    engine.submit(request("memory " + std::to_string(n), 1 + n % 4, n), collect(outcomes.emplace_back()));
    if (n % 3 == 0) engine.run_until_idle();
    if (n == 30 || n == 300) {
      engine.run_until_idle();
      at[n] = MemoryTracker::instance().snapshot();
    }
  }
  for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c)
    EXPECT_EQ(at[30].current[static_cast<size_t>(c)], at[300].current[static_cast<size_t>(c)])
        << mem_category_name(static_cast<MemCategory>(c));
  EXPECT_FALSE(f.model.has_saved());
}

TEST(Generation, AModelDirectoryStopsAtGenerationConfigEosIds) {
  ModelConfig cfg = config();
  DeepSeekModel model(cfg);
  model.init_weights(2);
  const std::filesystem::path dir = scratch_dir("test_generation_tmp") / "model";
  save_model(dir, cfg, model.params());
  write_text(dir / "generation_config.json", R"({"eos_token_id": [40, 41]})");
  const InferenceModel m = load_inference_model(dir);
  const std::vector<int32_t> ids = stop_ids(m);
  EXPECT_EQ(ids, (std::vector<int32_t>{ByteTokenizer::kEndOfText, 40, 41}));
  write_text(dir / "generation_config.json", R"({"eos_token_id": 7})");
  EXPECT_EQ(stop_ids(load_inference_model(dir)),
            (std::vector<int32_t>{ByteTokenizer::kEndOfText, 7}));
  write_text(dir / "generation_config.json", R"({"eos_token_id": [1.5]})");
  EXPECT_NE(error_of([&] { load_inference_model(dir); }).find("eos_token_id"), std::string::npos);
}

TEST(Generation, Int8ExpertActivationsDecodeAsAFullRecomputeAtAnyThreadCount) {
  // The int8 kernel's bits depend on the shapes only (not on the rows in one call), so a cached
  // decode of one token equals the full recompute, batching changes nothing, and neither does the
  // thread count.
  ModelConfig cfg = config();
  cfg.expert_format = "mxfp4";
  DeepSeekModel model(cfg);
  model.init_weights(21);
  model.set_expert_activations(ExpertActivations::Int8);
  const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  const int threads = num_threads();
  auto generate = [&](int n, int64_t slots) {
    set_num_threads(n);
    EngineOptions o;
    o.max_sequences = slots;
    o.prefill_chunk = 8;
    o.max_step_tokens = 8 + slots - 1;
    GenerationEngine engine(model, *tok, o);
    std::deque<Outcome> out(3);
    engine.submit(request("And God said", 32, 0, /*temperature=*/0.0), collect(out[0]));
    engine.submit(request("Let there be light", 32, 1), collect(out[1]));
    engine.submit(request("and there was", 32, 2), collect(out[2]));
    engine.run_until_idle();
    set_num_threads(threads);
    std::vector<std::vector<int32_t>> ids;
    for (const Outcome& o2 : out) ids.push_back(o2.ids);
    return ids;
  };
  const auto one = generate(1, 1), two = generate(2, 3);
  EXPECT_EQ(one, two);
  ASSERT_FALSE(one[0].empty());
  std::vector<int32_t> ids = ByteTokenizer::encode("And God said");
  const size_t prompt = ids.size();
  while (ids.size() < prompt + 32 && ids.back() != ByteTokenizer::kEndOfText) {
    const int64_t n = static_cast<int64_t>(ids.size());
    Tensor t = Tensor::empty({n}, DType::I32, MemCategory::Activations);
    std::copy(ids.begin(), ids.end(), t.i32());
    const Tensor logits = model.logits(t, {1, n});
    SamplingOptions greedy;
    greedy.temperature = 0;
    Rng rng(0);
    ids.push_back(sample_token(logits.f32() + (t.numel() - 1) * cfg.vocab_size, 257, greedy, rng));
  }
  if (ids.back() == ByteTokenizer::kEndOfText) ids.pop_back();  // a stop id is not a completion id
  const std::vector<int32_t> completion(ids.begin() + static_cast<std::ptrdiff_t>(prompt),
                                       ids.end());
  EXPECT_EQ(one[0], completion);
}

TEST(Generation, Int8ExpertActivationsNeedAModelWithMxfp4Experts) {
  ModelConfig cfg = config();
  DeepSeekModel model(cfg);
  model.init_weights(2);
  const std::filesystem::path dir = scratch_dir("test_generation_tmp") / "fp32_experts";
  save_model(dir, cfg, model.params());
  EXPECT_NE(error_of([&] { load_inference_model(dir, {}, nullptr, ExpertActivations::Int8); })
                .find("--expert-activations int8 needs routed experts in MXFP4 (config.json "
                      "quantization_config.quant_method \"mxfp4\""),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_inference_model(dir, {}, nullptr, ExpertActivations::Int8); })
                .find(dir.string() + "'s routed experts are fp32; use --expert-activations fp32"),
            std::string::npos);
  // The same directory with its experts packed: every MoE layer switched.
  cfg.expert_format = "mxfp4";
  DeepSeekModel packed(cfg);
  packed.init_weights(2);
  const std::filesystem::path packed_dir = scratch_dir("test_generation_tmp") / "mxfp4_experts";
  save_model(packed_dir, cfg, packed.params());
  const InferenceModel m = load_inference_model(packed_dir, {}, nullptr, ExpertActivations::Int8);
  ASSERT_FALSE(m.model->moe_layers().empty());
  for (MoELayer* layer : m.model->moe_layers())
    EXPECT_EQ(layer->expert_activations(), ExpertActivations::Int8);
  // Held in a variable: a range-for over a temporary's member keeps only the member's result.
  const InferenceModel exact = load_inference_model(packed_dir);
  for (MoELayer* layer : exact.model->moe_layers())
    EXPECT_EQ(layer->expert_activations(), ExpertActivations::Fp32);
}

TEST(Generation, SubmitAndCancelFromOtherThreadsWhileStepping) {
  // The server's pattern: HTTP threads submit and cancel, the main thread steps.
  Fixture f;
  EngineOptions o;
  o.max_sequences = 3;
  o.max_queued = 100;
  GenerationEngine engine(f.model, *f.tok, o);
  constexpr int kRequests = 60;
  std::vector<Outcome> out(kRequests);
  std::atomic<int> submitted{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 3; ++t)
    clients.emplace_back([&, t] {
      for (int i = t; i < kRequests; i += 3) {
        const int64_t id = engine.submit(request("thread " + std::to_string(i), 6, i), collect(out[i]));
        ++submitted;
        if (i % 4 == 0) engine.cancel(id);
      }
    });
  while (submitted.load() < kRequests || !engine.idle()) {
    if (!engine.step()) engine.wait_for_work(std::chrono::milliseconds(5));
  }
  for (auto& c : clients) c.join();
  engine.run_until_idle();
  int cancelled = 0;
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_TRUE(out[i].finished) << i;
    cancelled += out[i].reason == FinishReason::Cancelled;
    if (i % 4 != 0) {
      EXPECT_EQ(out[i].reason, FinishReason::Length) << i;
    }
  }
  EXPECT_LE(cancelled, kRequests / 4);
  EXPECT_EQ(engine.stats().requests_finished, kRequests);
  EXPECT_EQ(engine.cache().free_slots(), 3);
}
