// Whole-model properties: thread-count determinism, memory released by every pass, zero-token
// experts, save/load round trips, the chunked loss, and the `moe logits` command.
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/parallel.h"
#include "core/simd.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/model_spec.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "train/adamw.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

const std::filesystem::path kTmp =
    std::filesystem::path(MOE_BINARY_DIR) / ("test_model_tmp" + forced_simd_suffix());

ModelConfig debug_config() {
  ModelConfig c = resolve_model_config("debug");
  c.aux_loss_alpha = 0.01;  // exercise the aux-loss path too
  return c;
}

std::vector<float> train_step_bits(int threads) {
  set_num_threads(threads);
  DeepSeekModel model(debug_config());
  model.init_weights(7);
  model.allocate_grads();
  const BatchShape shape{3, 37};
  Tensor tokens = random_tokens(shape.tokens(), 256, 1), targets = random_tokens(shape.tokens(), 256, 2);
  LossOptions opts;
  opts.z_loss = 1e-4;
  LossResult r = model.forward(tokens, targets, shape, Pass::Train, opts);
  model.backward();
  std::vector<float> bits = {static_cast<float>(r.total())};
  for (Param* p : model.trainable_params()) bits.insert(bits.end(), p->g(), p->g() + p->grad.numel());
  set_num_threads(2);
  return bits;
}

}  // namespace

TEST(Model, BitwiseIdenticalLossAndGradientsForOneAndTwoThreads) {
  const auto one = train_step_bits(1), two = train_step_bits(2);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
}

TEST(Model, TrainingStepsAreBitwiseTheSameOnEverySimdTarget) {
  // Loss, every gradient and the weights after two AdamW steps, on each target this CPU runs
  // (AVX-512, AVX2, scalar), with fp32 and with frozen MXFP4 experts: the matmuls are FMA chains
  // or fixed 16-lane sums, the row kernels lane-wise with fixed 16-lane sums, so nothing may
  // differ.
  auto run_with = [](const std::string& experts) {
    ModelConfig cfg = debug_config();
    cfg.expert_format = experts;  // fp32 (trained) or mxfp4 (frozen, packed)
    DeepSeekModel model(cfg);
    model.init_weights(11);
    model.allocate_grads();
    AdamW opt(model.trainable_params(), AdamWConfig{});
    const BatchShape shape{2, 19};
    std::vector<float> bits;
    for (int step = 0; step < 2; ++step) {
      Tensor tokens = random_tokens(shape.tokens(), 256, 20 + step);
      Tensor targets = random_tokens(shape.tokens(), 256, 30 + step);
      LossOptions opts;
      opts.z_loss = 1e-4;
      LossResult r = model.forward(tokens, targets, shape, Pass::Train, opts);
      model.backward();
      bits.push_back(static_cast<float>(r.total()));
      for (Param* p : model.trainable_params()) bits.insert(bits.end(), p->g(), p->g() + p->grad.numel());
      model.update_router_biases(1e-3);
      opt.step(1e-3, 1.0f);
      model.zero_grads();
    }
    for (Param* p : model.trainable_params()) bits.insert(bits.end(), p->w(), p->w() + p->value.numel());
    return bits;
  };
  expect_same_bits_on_every_target([&] { return run_with("fp32"); });
  expect_same_bits_on_every_target([&] { return run_with("mxfp4"); });
}

TEST(Model, EveryPassReleasesActivationsAndRouting) {
  auto& mem = MemoryTracker::instance();
  DeepSeekModel model(debug_config());
  model.init_weights(3);
  model.allocate_grads();
  const BatchShape shape{2, 16};
  Tensor tokens = random_tokens(shape.tokens(), 256, 3), targets = random_tokens(shape.tokens(), 256, 4);
  const int64_t act0 = mem.current(MemCategory::Activations), routing0 = mem.current(MemCategory::Routing);
  EXPECT_EQ(routing0, 0);
  for (int step = 0; step < 3; ++step) {
    model.forward(tokens, targets, shape, Pass::Eval);
    EXPECT_FALSE(model.has_saved());
    EXPECT_EQ(mem.current(MemCategory::Routing), 0);
    EXPECT_EQ(mem.current(MemCategory::Activations), act0);
    model.logits(tokens, shape);
    EXPECT_EQ(mem.current(MemCategory::Routing), 0);
    EXPECT_EQ(mem.current(MemCategory::Activations), act0);
    model.forward(tokens, targets, shape, Pass::Train);
    EXPECT_TRUE(model.has_saved());
    EXPECT_GT(mem.current(MemCategory::Routing), 0);  // handles kept for backward
    model.backward();
    EXPECT_FALSE(model.has_saved());
    EXPECT_EQ(mem.current(MemCategory::Routing), 0);
    EXPECT_EQ(mem.current(MemCategory::Activations), act0);
  }
}

TEST(Model, ExpertsWithoutTokensGetExactlyZeroGradient) {
  ModelConfig c = debug_config();
  c.n_routed_experts = 32;
  c.num_experts_per_tok = 1;
  c.n_group = 1;
  c.topk_group = 1;
  DeepSeekModel model(c);
  model.init_weights(5);
  model.allocate_grads();
  const BatchShape shape{1, 1};  // one token: 31 of 32 experts idle in every MoE layer
  Tensor tokens = random_tokens(1, 256, 5), targets = random_tokens(1, 256, 6);
  model.forward(tokens, targets, shape, Pass::Train);
  model.backward();
  for (MoELayer* layer : model.moe_layers()) {
    const auto& counts = layer->expert_counts();
    int used = 0;
    for (size_t e = 0; e < counts.size(); ++e) used += counts[e] > 0;
    EXPECT_EQ(used, 1);
  }
  int zero = 0, nonzero = 0;
  for (Param* p : model.trainable_params()) {
    if (p->name.find("mlp.experts.") == std::string::npos) continue;
    (max_abs(p->g(), p->grad.numel()) == 0.0 ? zero : nonzero)++;
  }
  EXPECT_EQ(nonzero, 3 * 2);   // gate/up/down of one expert in each of the 2 MoE layers
  EXPECT_EQ(zero, 3 * 31 * 2);
}

TEST(Model, SaveThenLoadIsBitwiseIdentical) {
  std::filesystem::remove_all(kTmp);
  DeepSeekModel a(debug_config());
  a.init_weights(11);
  save_model(kTmp / "f32", a.config(), a.params(), DType::F32);
  save_model(kTmp / "bf16", a.config(), a.params(), DType::BF16, /*max_shard_bytes=*/64 * 1024);
  DeepSeekModel b(read_hf_config(kTmp / "f32"));
  load_weights(kTmp / "f32", b.params());
  DeepSeekModel c(read_hf_config(kTmp / "bf16"));
  load_weights(kTmp / "bf16", c.params());
  EXPECT_TRUE(std::filesystem::exists(kTmp / "bf16" / "model.safetensors.index.json"));
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param* pa = a.params()[i];
    ASSERT_EQ(pa->name, b.params()[i]->name);
    EXPECT_EQ(std::memcmp(pa->w(), b.params()[i]->w(), static_cast<size_t>(pa->value.nbytes())), 0) << pa->name;
    const float* pc = c.params()[i]->w();
    for (int64_t j = 0; j < pa->value.numel(); ++j)
      ASSERT_EQ(pc[j], bf16_to_f32(f32_to_bf16(pa->w()[j]))) << pa->name;
  }
}

TEST(LMHeadLoss, ChunkedLossEqualsFullLogitsCrossEntropy) {
  Rng rng(9);
  LMHeadLoss head;
  const int64_t vocab = 3000, dim = 24, T = 2 * LMHeadLoss::chunk_rows(vocab, dim) + 5;
  head.init("lm_head.weight", dim, vocab);
  fill_random(head.weight.value, rng, 0.3f);
  head.weight.allocate_grad();
  Tensor h = random_tensor({T, dim}, rng);
  Tensor targets = random_tokens(T, vocab, 9);
  targets.i32()[3] = kIgnoreIndex;
  const double z = 1e-3;
  LossResult r = head.forward(h, targets, Pass::Train, z);
  Tensor dh = head.backward();
  Tensor logits = head.logits(h);
  double ce = 0, zl = 0;
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (targets.i32()[t] == kIgnoreIndex) continue;
    const float* row = logits.f32() + t * vocab;
    double mx = row[0], s = 0;
    for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, double(row[j]));
    for (int64_t j = 0; j < vocab; ++j) s += std::exp(row[j] - mx);
    const double lse = mx + std::log(s);
    ce += lse - row[targets.i32()[t]];
    zl += lse * lse;
    ++n;
  }
  EXPECT_EQ(r.tokens, n);
  EXPECT_NEAR(r.ce, ce / n, 1e-6 * ce / n);
  EXPECT_NEAR(r.z_loss, z * zl / n, 1e-6 * z * zl / n);
  // dh by finite differences of the chunked loss itself.
  auto loss = [&] {
    LossResult e = head.forward(h, targets, Pass::Eval, z);
    return e.total();
  };
  EXPECT_LT(finite_difference_check(loss, h.f32(), dh.f32(), h.numel(), 1e-2f, 48, 1e-4), 2e-2);
  // Chunks are as tall as memory allows (1,024 rows), within 16 MiB of logits or a quarter of
  // the head's weight: DeepSeek-V3's head (vocab 129,280, dim 7,168) keeps 1,024 of 4,096
  // tokens' logits and their gradient, V2-Lite's (102,400 x 2,048) 512 rows.
  EXPECT_EQ(LMHeadLoss::chunk_rows(129280, 7168), 1024);
  EXPECT_EQ(LMHeadLoss::bytes_saved(4096, 129280, 7168, true), int64_t{3072} * 129280 * 4 * 2);
  EXPECT_EQ(LMHeadLoss::chunk_rows(102400, 2048), 512);
  EXPECT_EQ(LMHeadLoss::chunk_rows(1 << 20, 64), 16);
  EXPECT_EQ(LMHeadLoss::chunk_rows(4096, 320), 1024);  // `small`: the 16 MiB floor
}

TEST(Cli, LogitsCommandWritesTheModelsLogits) {
  std::filesystem::remove_all(kTmp / "cli");
  DeepSeekModel model(debug_config());
  model.init_weights(21);
  save_model(kTmp / "cli", model.config(), model.params(), DType::F32);
  {
    std::ofstream ids(kTmp / "cli" / "ids.txt");
    ids << "1 2 3 4 5\n10 20 30 40 50\n";
  }
  const std::string exe = std::string(MOE_BINARY_DIR) + "/moe";
  const std::string cmd = exe + " --threads 1 logits --model " + (kTmp / "cli").string() + " --tokens " +
                          (kTmp / "cli" / "ids.txt").string() + " --out " +
                          (kTmp / "cli" / "logits.safetensors").string() + " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  SafetensorsReader out(kTmp / "cli" / "logits.safetensors");
  Tensor got = out.read("logits", DType::F32);
  EXPECT_EQ(got.shape(), (Shape{2, 5, 256}));
  const int32_t ids[10] = {1, 2, 3, 4, 5, 10, 20, 30, 40, 50};
  Tensor tokens = Tensor::empty({10}, DType::I32, MemCategory::Activations);
  std::memcpy(tokens.raw(), ids, sizeof(ids));
  Tensor want = model.logits(tokens, {2, 5});
  EXPECT_EQ(std::memcmp(got.raw(), want.raw(), static_cast<size_t>(want.nbytes())), 0);
  // A ragged token file is rejected with the line named.
  {
    std::ofstream ids(kTmp / "cli" / "bad.txt");
    ids << "1 2 3\n4 5\n";
  }
  const std::string bad = exe + " logits --model " + (kTmp / "cli").string() + " --tokens " +
                          (kTmp / "cli" / "bad.txt").string() + " --out /dev/null 2> " +
                          (kTmp / "cli" / "err.txt").string();
  EXPECT_NE(std::system(bad.c_str()), 0);
  std::ifstream err(kTmp / "cli" / "err.txt");
  std::string msg((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_NE(msg.find("bad.txt:2"), std::string::npos) << msg;
}
