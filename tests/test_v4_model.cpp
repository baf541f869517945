// The DeepSeek-V4 model (model/v4/v4_model.h) end to end: the PyTorch reference's whole-model
// fixtures (tests/fixtures/v4/{mtp,hash_csa}, README there) for logits, losses and every
// parameter gradient; determinism over threads and SIMD targets; memory released by every pass;
// a few AdamW steps; the deepseek_v4 config.json fields and their errors; the released layout's
// I64 hash tables on load and save.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/memory.h"
#include "core/parallel.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/model_spec.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/v4/v4_model.h"
#include "train/adamw.h"
#include "train/train_config.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
using json = nlohmann::json;

namespace {

const std::filesystem::path kFixtures = std::filesystem::path(MOE_SOURCE_DIR) / "tests/fixtures/v4";

json read_json(const std::filesystem::path& p) { return json::parse(read_file(p)); }

// Relative norm-wise error of an engine tensor against a fixture tensor.
double rel(const float* got, const Tensor& want) {
  return rel_error(got, want.f32(), want.numel(), 1e-30);
}

bool is_indexer(const std::string& name) { return name.find(".attn.indexer.") != std::string::npos; }
// The hyper-connections' scale and base gradients are sums over every token of small products
// that largely cancel (README of the fixtures: torch's own float32 run of the reference is off
// by ~1e-5 there, 3e-6 elsewhere), so fp32 rounding alone reaches about 1.2e-5 on them.
bool is_hc_scale_or_base(const std::string& name) {
  return name.find("hc_") != std::string::npos &&
         (name.ends_with("_scale") || name.ends_with("_base"));
}

struct FixtureResult {
  double logits = 0, loss = 0, ce = 0, mtp_logits = 0, mtp_ce = 0;
  double worst_grad = 0, worst_hc_grad = 0;
  std::string worst_grad_name, worst_hc_grad_name;
};

FixtureResult run_fixture(const std::string& name) {
  FixtureResult out;
  const std::filesystem::path dir = kFixtures / name;
  const json fx = read_json(dir / "fixture.json");
  const ModelConfig cfg = read_hf_config(dir);
  DeepSeekV4Model model(cfg);
  load_weights(dir, model.params());
  model.allocate_grads();
  SafetensorsReader ex(dir / "expected.safetensors");
  const Tensor tokens3 = ex.read("tokens", DType::I32, MemCategory::Scratch);
  const Tensor targets3 = ex.read("targets", DType::I32, MemCategory::Scratch);
  const BatchShape shape{fx["batch"].get<int64_t>(), fx["seq"].get<int64_t>()};
  const Tensor tokens = tokens3.view({shape.tokens()});
  const Tensor targets = targets3.view({shape.tokens()});
  auto scalar = [&](const char* key) { return static_cast<double>(ex.read(key, DType::F32).f32()[0]); };

  LossOptions opts;
  opts.mtp_loss_scale = fx["mtp_loss_scale"].get<double>();
  const LossResult r = model.forward(tokens, targets, shape, Pass::Train, opts);
  out.loss = std::fabs(r.total() - scalar("loss")) / std::fabs(scalar("loss"));
  out.ce = std::fabs(r.ce - scalar("ce_loss")) / std::fabs(scalar("ce_loss"));
  if (model.has_mtp()) out.mtp_ce = std::fabs(r.mtp_ce - scalar("mtp_ce_loss")) / scalar("mtp_ce_loss");
  model.backward();
  EXPECT_FALSE(model.has_saved());

  std::map<std::string, Param*> by_name;
  for (Param* p : model.params()) by_name[p->name] = p;
  int compared = 0;
  for (const SafetensorsEntry& e : ex.entries()) {
    if (!e.name.starts_with("grad.")) continue;
    const std::string key = e.name.substr(5);
    EXPECT_TRUE(by_name.count(key)) << name << ": the model has no parameter " << key;
    if (!by_name.count(key)) continue;
    const Param* p = by_name.at(key);
    const Tensor want = ex.read(e.name, DType::F32, MemCategory::Scratch);
    if (is_indexer(key)) {
      // Integer picks carry no gradient: the fixture's are zero, and the engine has none at all.
      EXPECT_FALSE(p->grad.defined()) << key;
      EXPECT_FALSE(p->trainable) << key;
      EXPECT_EQ(max_abs(want.f32(), want.numel()), 0.0) << key;
      continue;
    }
    EXPECT_TRUE(p->grad.defined()) << key;
    if (!p->grad.defined()) continue;
    ++compared;
    if (max_abs(want.f32(), want.numel()) == 0.0) {
      // An expert no token chose: exactly zero here as well.
      EXPECT_EQ(max_abs(p->g(), p->grad.numel()), 0.0) << key;
      continue;
    }
    const double err = rel(p->g(), want);
    if (is_hc_scale_or_base(key)) {
      if (err > out.worst_hc_grad) out.worst_hc_grad = err, out.worst_hc_grad_name = key;
    } else if (err > out.worst_grad) {
      out.worst_grad = err, out.worst_grad_name = key;
    }
  }
  // Every trainable parameter has a fixture gradient (gate.bias only selects: none).
  int trainable = 0;
  for (Param* p : model.trainable_params()) trainable += !p->name.ends_with("gate.bias");
  EXPECT_EQ(compared, trainable) << name;

  Tensor mtp_logits;
  const Tensor logits = model.logits(tokens, shape, model.has_mtp() ? &mtp_logits : nullptr);
  out.logits = rel(logits.f32(), ex.read("logits", DType::F32, MemCategory::Scratch));
  if (model.has_mtp())
    out.mtp_logits = rel(mtp_logits.f32(), ex.read("mtp_logits", DType::F32, MemCategory::Scratch));
  EXPECT_FALSE(model.has_saved());
  return out;
}

void expect_fixture(const std::string& name) {
  const FixtureResult r = run_fixture(name);
  std::printf("[%s] logits %.2e  loss %.2e  ce %.2e  mtp logits %.2e  mtp ce %.2e  grads %.2e (%s)  "
              "hc scale/base %.2e (%s)\n",
              name.c_str(), r.logits, r.loss, r.ce, r.mtp_logits, r.mtp_ce, r.worst_grad,
              r.worst_grad_name.c_str(), r.worst_hc_grad, r.worst_hc_grad_name.c_str());
  EXPECT_LT(r.logits, 1e-5);
  EXPECT_LT(r.loss, 1e-5);
  EXPECT_LT(r.ce, 1e-5);
  EXPECT_LT(r.mtp_logits, 1e-5);
  EXPECT_LT(r.mtp_ce, 1e-5);
  EXPECT_LT(r.worst_grad, 1e-5) << r.worst_grad_name;
  // See is_hc_scale_or_base: cancellation, not a different gradient.
  EXPECT_LT(r.worst_hc_grad, 5e-5) << r.worst_hc_grad_name;
}

// A small V4 config covering every layer kind (the mtp fixture's: CSA, HCA, sliding window, a
// hash layer, MTP), for the property tests.
ModelConfig small_config() { return read_hf_config(kFixtures / "mtp"); }

struct Batch {
  BatchShape shape;
  Tensor tokens, targets;
};

Batch random_batch(const ModelConfig& c, BatchShape shape, uint64_t seed) {
  return {shape, random_tokens(shape.tokens(), c.vocab_size, seed),
          random_tokens(shape.tokens(), c.vocab_size, seed + 1)};
}

// Loss and every gradient of one training step, then the weights after two AdamW steps.
std::vector<float> train_bits(const ModelConfig& cfg, int threads) {
  const int saved = num_threads();
  set_num_threads(threads);
  DeepSeekV4Model model(cfg);
  model.init_weights(17);
  model.allocate_grads();
  AdamW opt(model.trainable_params(), AdamWConfig{});
  std::vector<float> bits;
  for (int step = 0; step < 2; ++step) {
    const Batch b = random_batch(cfg, {2, 37}, 40 + 2 * step);
    const LossResult r = model.forward(b.tokens, b.targets, b.shape, Pass::Train);
    model.backward();
    bits.push_back(static_cast<float>(r.total()));
    for (Param* p : model.trainable_params()) bits.insert(bits.end(), p->g(), p->g() + p->grad.numel());
    model.update_router_biases(1e-3);
    opt.step(1e-3);
    model.zero_grads();
  }
  for (Param* p : model.params())  // packed experts are frozen: their bytes cannot change
    if (!p->packed()) bits.insert(bits.end(), p->w(), p->w() + p->value.numel());
  set_num_threads(saved);
  return bits;
}

}  // namespace

// ---------------------------------------------------------------- PyTorch reference fixtures

TEST(V4ModelFixtures, Mtp) { expect_fixture("mtp"); }
TEST(V4ModelFixtures, HashCsa) { expect_fixture("hash_csa"); }

// quantization_simulation "reference": DeepSeek's reference forward's FP8 KV and entries and its
// Hadamard + FP4 indexer, with the straight-through KV gradient (fixture qsim; every quantized
// value of it is > 2e-6 of its block's amax from a rounding or scale decision, 4.8x the largest
// displacement float32 rounding causes in torch's own float32 run: fixture.json "margins").
TEST(V4ModelFixtures, QuantizationSimulation) {
  EXPECT_EQ(read_hf_config(kFixtures / "qsim").quantization_simulation, "reference");
  expect_fixture("qsim");
}

namespace {

// Logits, loss and every gradient of one training step on a fixture's batch.
std::vector<float> fixture_step_bits(const ModelConfig& cfg, const std::string& name) {
  const std::filesystem::path dir = kFixtures / name;
  const json fx = read_json(dir / "fixture.json");
  DeepSeekV4Model model(cfg);
  load_weights(dir, model.params());
  model.allocate_grads();
  SafetensorsReader ex(dir / "expected.safetensors");
  const BatchShape shape{fx["batch"].get<int64_t>(), fx["seq"].get<int64_t>()};
  const Tensor tokens = ex.read("tokens", DType::I32, MemCategory::Scratch).view({shape.tokens()});
  const Tensor targets = ex.read("targets", DType::I32, MemCategory::Scratch).view({shape.tokens()});
  LossOptions opts;
  opts.mtp_loss_scale = fx["mtp_loss_scale"].get<double>();
  const LossResult r = model.forward(tokens, targets, shape, Pass::Train, opts);
  model.backward();
  std::vector<float> bits = {static_cast<float>(r.total())};
  for (Param* p : model.trainable_params()) bits.insert(bits.end(), p->g(), p->g() + p->grad.numel());
  const Tensor logits = model.logits(tokens, shape);
  bits.insert(bits.end(), logits.f32(), logits.f32() + logits.numel());
  return bits;
}

}  // namespace

// The option off is the engine as it was: a config that says "none" computes the fixtures'
// runs (whose config.json has no such field) bit for bit.
TEST(V4ModelFixtures, SimulationNoneIsTheDefaultBitForBit) {
  for (const char* name : {"mtp", "hash_csa"}) {
    const ModelConfig plain = read_hf_config(kFixtures / name);
    EXPECT_EQ(plain.quantization_simulation, "none") << name;
    json j = read_json(kFixtures / name / "config.json");
    j["quantization_simulation"] = "none";
    const ModelConfig none = parse_hf_config(j, "none");
    const std::vector<float> a = fixture_step_bits(plain, name), b = fixture_step_bits(none, name);
    ASSERT_EQ(a.size(), b.size()) << name;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << name;
  }
}

// The qsim fixture tells the two apart: without the simulation its logits are far off.
TEST(V4ModelFixtures, TheSimulationFixtureFailsWithoutTheSimulation) {
  ModelConfig cfg = read_hf_config(kFixtures / "qsim");
  cfg.quantization_simulation = "none";
  DeepSeekV4Model model(cfg);
  load_weights(kFixtures / "qsim", model.params());
  SafetensorsReader ex(kFixtures / "qsim" / "expected.safetensors");
  const Tensor tokens = ex.read("tokens", DType::I32, MemCategory::Scratch);
  const Tensor logits = model.logits(tokens.view({tokens.numel()}), BatchShape{1, tokens.numel()});
  const double err = rel(logits.f32(), ex.read("logits", DType::F32, MemCategory::Scratch));
  std::printf("qsim fixture without the simulation: logits off by %.2e\n", err);
  EXPECT_GT(err, 1e-3);
}

// ---------------------------------------------------------------- structure

TEST(V4Model, ParamsHaveTheReleasedNamesInCheckpointOrder) {
  const ModelConfig cfg = small_config();
  DeepSeekV4Model model(cfg);
  std::vector<std::string> names;
  for (Param* p : model.params()) names.push_back(p->name);
  // Exactly the fixture checkpoint's tensors, no more, no fewer.
  SafetensorsReader st(kFixtures / "mtp" / "model.safetensors");
  std::vector<std::string> file;
  for (const SafetensorsEntry& e : st.entries()) file.push_back(e.name);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  std::sort(file.begin(), file.end());
  EXPECT_EQ(sorted, file);
  // Checkpoint order: embedding first, the layers in order, the head, then MTP.
  EXPECT_EQ(names.front(), "embed.weight");
  auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  EXPECT_LT(at("layers.0.hc_attn_fn"), at("layers.0.attn_norm.weight"));
  EXPECT_LT(at("layers.0.attn.attn_sink"), at("layers.0.hc_ffn_fn"));
  EXPECT_LT(at("layers.1.attn.compressor.wkv.weight"), at("layers.1.attn.indexer.wq_b.weight"));
  EXPECT_LT(at("layers.2.ffn.shared_experts.w2.weight"), at("hc_head_fn"));
  EXPECT_LT(at("hc_head_scale"), at("norm.weight"));
  EXPECT_LT(at("norm.weight"), at("head.weight"));
  EXPECT_LT(at("head.weight"), at("mtp.0.enorm.weight"));
  EXPECT_EQ(names.back(), "mtp.0.norm.weight");
  // What never trains: the hash table, the indexers; the router bias moves by balancing only.
  for (Param* p : model.params()) {
    const bool frozen = p->name.ends_with("gate.tid2eid") || is_indexer(p->name) ||
                        p->name.ends_with("gate.bias");
    EXPECT_EQ(p->trainable, !frozen) << p->name;
  }
}

TEST(V4Model, ParameterCountsMatchTheModel) {
  for (const char* name : {"mtp", "hash_csa"}) {
    const ModelConfig cfg = read_hf_config(kFixtures / name);
    DeepSeekV4Model model(cfg);
    int64_t main = 0, mtp = 0, experts = 0;
    for (Param* p : model.params()) {
      if (p->id_bound > 0) continue;  // the hash tables are integer buffers
      (p->name.starts_with("mtp.") ? mtp : main) += p->value.numel();
      if (!p->name.starts_with("mtp.") && p->name.find(".ffn.experts.") != std::string::npos)
        experts += p->value.numel();
    }
    const ParamCounts c = count_params(cfg);
    EXPECT_EQ(c.total, main) << name;
    EXPECT_EQ(c.mtp, mtp) << name;
    EXPECT_EQ(c.routed_expert, experts) << name;
  }
  // The released V4-Flash: 284B total, 13B active (SPEC §6).
  const ParamCounts flash = count_params(resolve_model_config("deepseek-v4-flash"));
  EXPECT_NEAR(static_cast<double>(flash.total) / 1e9, 284.3, 0.1);
  EXPECT_NEAR(static_cast<double>(flash.active_per_token) / 1e9, 13.3, 0.1);
}

// ---------------------------------------------------------------- determinism

TEST(V4Model, BitwiseIdenticalForOneAndTwoThreads) {
  const ModelConfig cfg = small_config();
  const auto one = train_bits(cfg, 1), two = train_bits(cfg, 2);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
}

TEST(V4Model, TrainingStepsAreBitwiseTheSameOnEverySimdTarget) {
  // fp32 experts (trained) and frozen MXFP4 experts (packed, decoded inside the matmuls).
  ModelConfig cfg = small_config();
  expect_same_bits_on_every_target([&] { return train_bits(cfg, 2); });
  cfg.expert_format = "mxfp4";
  expect_same_bits_on_every_target([&] { return train_bits(cfg, 2); });
}

TEST(V4Model, TheSimulationIsBitwiseTheSameForAnyThreadCountAndSimdTarget) {
  const ModelConfig cfg = read_hf_config(kFixtures / "qsim");  // quantization_simulation on
  const auto one = train_bits(cfg, 1), two = train_bits(cfg, 2);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
  expect_same_bits_on_every_target([&] { return train_bits(cfg, 2); });
}

TEST(V4Model, Mxfp4ExpertsKeepTheReleasedNamesAndStayFrozen) {
  ModelConfig cfg = small_config();
  cfg.expert_format = "mxfp4";
  DeepSeekV4Model model(cfg);
  model.init_weights(5);
  model.allocate_grads();
  std::map<std::string, Param*> by_name;
  for (Param* p : model.params()) by_name[p->name] = p;
  for (const char* w : {"w1", "w2", "w3"}) {
    const std::string key = std::string("layers.2.ffn.experts.7.") + w;
    ASSERT_TRUE(by_name.count(key + ".weight")) << key;
    ASSERT_TRUE(by_name.count(key + ".scale")) << key;
    EXPECT_EQ(by_name.at(key + ".weight")->format, ParamFormat::Mxfp4Data);
    EXPECT_FALSE(by_name.at(key + ".weight")->grad.defined());
  }
  const Batch b = random_batch(cfg, {2, 21}, 3);
  const LossResult r = model.forward(b.tokens, b.targets, b.shape, Pass::Train);
  EXPECT_TRUE(std::isfinite(r.total()));
  model.backward();
  EXPECT_FALSE(model.has_saved());
  EXPECT_GT(max_abs(by_name.at("layers.2.ffn.shared_experts.w1.weight")->g(), 32 * 64), 0.0);
}

// ---------------------------------------------------------------- memory

TEST(V4Model, EveryPassReleasesActivationsAndRouting) {
  auto& mem = MemoryTracker::instance();
  for (const char* name : {"mtp", "hash_csa"}) {
    SCOPED_TRACE(name);
    const ModelConfig cfg = read_hf_config(kFixtures / name);
    DeepSeekV4Model model(cfg);
    model.init_weights(3);
    model.allocate_grads();
    const Batch b = random_batch(cfg, {2, 45}, 5);
    model.reserve_positions(b.shape.seq);  // the RoPE tables (Weights) grow once, up front
    const int64_t act0 = mem.current(MemCategory::Activations);
    const int64_t routing0 = mem.current(MemCategory::Routing);
    for (int step = 0; step < 2; ++step) {
      for (Pass pass : {Pass::Eval, Pass::Inference}) {
        model.forward(b.tokens, b.targets, b.shape, pass);
        EXPECT_FALSE(model.has_saved());
        EXPECT_EQ(mem.current(MemCategory::Routing), routing0);
        EXPECT_EQ(mem.current(MemCategory::Activations), act0);
      }
      {
        Tensor mtp;
        const Tensor logits = model.logits(b.tokens, b.shape, model.has_mtp() ? &mtp : nullptr);
      }
      EXPECT_FALSE(model.has_saved());
      EXPECT_EQ(mem.current(MemCategory::Activations), act0);
      model.forward(b.tokens, b.targets, b.shape, Pass::Train);
      EXPECT_TRUE(model.has_saved());
      EXPECT_GT(mem.current(MemCategory::Routing), routing0);  // handles and picks kept
      EXPECT_GT(mem.current(MemCategory::Activations), act0);
      model.backward();
      EXPECT_FALSE(model.has_saved());
      EXPECT_EQ(mem.current(MemCategory::Routing), routing0);
      EXPECT_EQ(mem.current(MemCategory::Activations), act0);
    }
  }
}

// ---------------------------------------------------------------- training

TEST(V4Model, AdamWLowersTheLossOnARepeatedBatch) {
  const ModelConfig cfg = small_config();
  DeepSeekV4Model model(cfg);
  model.init_weights(23);
  model.allocate_grads();
  AdamW opt(model.trainable_params(), AdamWConfig{.lr = 3e-3, .weight_decay = 0.0});
  const Batch b = random_batch(cfg, {2, 40}, 9);
  std::vector<double> losses;
  for (int step = 0; step < 8; ++step) {
    const LossResult r = model.forward(b.tokens, b.targets, b.shape, Pass::Train);
    model.backward();
    losses.push_back(r.total());
    ASSERT_TRUE(std::isfinite(r.total()));
    EXPECT_GT(r.mtp_ce, 0.0);
    model.update_router_biases(1e-3);
    opt.step(3e-3);
    model.zero_grads();
  }
  // An untrained model predicts near-uniformly: ln(vocab) for the CE, plus 0.1 of it for MTP.
  EXPECT_NEAR(losses.front(), 1.1 * std::log(static_cast<double>(cfg.vocab_size)), 0.1);
  EXPECT_LT(losses.back(), losses.front() - 0.5) << "first " << losses.front() << " last " << losses.back();
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]) << "step " << i;
}

// ---------------------------------------------------------------- loading and saving

TEST(V4Model, SaveThenLoadIsBitwiseIdenticalWithI64HashTables) {
  const ModelConfig cfg = small_config();
  DeepSeekV4Model a(cfg);
  a.init_weights(31);
  // A table other than the default one, to see it travel.
  MoELayer& hash = a.blocks()[0]->ffn;
  ASSERT_EQ(hash.selection(), ExpertSelection::Hash);
  for (int64_t i = 0; i < hash.tid2eid.value.numel(); ++i)
    hash.tid2eid.w()[i] = static_cast<float>((i * 5 + 3) % cfg.n_routed_experts);
  const std::filesystem::path dir = scratch_dir("test_v4_model_tmp");
  save_model(dir, cfg, a.params(), DType::F32);
  // The released layout: the table is I64 on disk.
  SafetensorsReader st(dir / "model.safetensors");
  EXPECT_EQ(st.entry("layers.0.ffn.gate.tid2eid").dtype, "I64");
  EXPECT_EQ(read_hf_config(dir).compress_ratios, cfg.compress_ratios);
  DeepSeekV4Model b(read_hf_config(dir));
  load_weights(dir, b.params());
  ASSERT_EQ(a.params().size(), b.params().size());
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param* p = a.params()[i];
    const Param* q = b.params()[i];
    ASSERT_EQ(p->name, q->name);
    EXPECT_EQ(std::memcmp(p->value.raw(), q->value.raw(), p->value.nbytes()), 0) << p->name;
  }
}

TEST(V4Model, HashTableOutsideTheExpertsIsALoadErrorNamingIt) {
  const ModelConfig cfg = small_config();
  DeepSeekV4Model model(cfg);
  model.init_weights(1);
  const std::filesystem::path dir = scratch_dir("test_v4_model_tmp");
  std::vector<SafetensorsWriteItem> items;
  for (Param* p : model.params()) {
    Tensor t = p->value;
    if (p->id_bound > 0) {
      t = p->value.clone(MemCategory::Scratch);
      t.f32()[3 * cfg.num_experts_per_tok + 1] = static_cast<float>(cfg.n_routed_experts);  // 8: one too far
    }
    items.push_back({p->name, t, p->id_bound > 0 ? "I64" : "F32"});
  }
  write_safetensors_with_dtypes(dir / "model.safetensors", items);
  const float before = model.params().front()->w()[0];
  const std::string err = error_of([&] { load_weights(dir, model.params()); });
  EXPECT_NE(err.find("layers.0.ffn.gate.tid2eid"), std::string::npos) << err;
  EXPECT_NE(err.find("holds 8 at [3, 1]"), std::string::npos) << err;
  EXPECT_NE(err.find("[0, 8)"), std::string::npos) << err;
  EXPECT_EQ(model.params().front()->w()[0], before);  // checked before any value is written
}

// ---------------------------------------------------------------- config.json

namespace {

json v4_json() { return read_json(kFixtures / "mtp" / "config.json"); }

std::string parse_error(const json& j) {
  return error_of([&] { parse_hf_config(j, "cfg.json"); });
}

}  // namespace

TEST(V4Config, ParsesTheFixtureConfigs) {
  const ModelConfig c = parse_hf_config(v4_json(), "cfg.json");
  EXPECT_TRUE(c.is_v4());
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.o_groups, 2);
  EXPECT_EQ(c.o_lora_rank, 16);
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.compress_ratios, (std::vector<int64_t>{0, 4, 16, 0}));
  EXPECT_EQ(c.compress_rope_theta, 160000.0);
  EXPECT_EQ(c.index_n_heads, 8);
  EXPECT_EQ(c.index_head_dim, 32);
  EXPECT_EQ(c.index_topk, 3);
  EXPECT_EQ(c.num_hash_layers, 1);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.hc_eps, 1e-6);
  EXPECT_EQ(c.scoring_func, "sqrtsoftplus");
  EXPECT_EQ(c.swiglu_limit, 2.5);
  EXPECT_TRUE(c.rope_scaling.is_yarn());
  EXPECT_EQ(c.rope_scaling.factor, 16.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 65536);
  // The MLA / dense fields of V2 and V3 do not exist in V4.
  EXPECT_EQ(c.kv_lora_rank, 0);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(read_hf_config(kFixtures / "hash_csa").num_nextn_predict_layers, 0);
}

TEST(V4Config, RoundTripsThroughModelConfigToJson) {
  for (const char* name : {"mtp", "hash_csa"}) {
    const ModelConfig a = read_hf_config(kFixtures / name);
    const json j = model_config_to_json(a);
    EXPECT_EQ(j["model_type"], "deepseek_v4");
    EXPECT_EQ(j["architectures"][0], "DeepseekV4ForCausalLM");
    const ModelConfig b = parse_hf_config(j, "round trip");
    EXPECT_EQ(model_config_to_json(b), j) << name;
    EXPECT_EQ(b.compress_ratios, a.compress_ratios);
    EXPECT_EQ(b.hc_eps, a.hc_eps);
    EXPECT_EQ(b.swiglu_limit, a.swiglu_limit);
  }
}

TEST(V4Config, DefaultsAreTheReleasedValues) {
  json j = v4_json();
  for (const char* key : {"hc_sinkhorn_iters", "hc_eps", "compress_rope_theta", "swiglu_limit",
                          "scoring_func", "routed_scaling_factor", "num_nextn_predict_layers"})
    j.erase(key);
  const ModelConfig c = parse_hf_config(j, "cfg.json");
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.hc_eps, 1e-6);
  EXPECT_EQ(c.compress_rope_theta, 160000.0);
  EXPECT_EQ(c.swiglu_limit, 10.0);
  EXPECT_EQ(c.scoring_func, "sqrtsoftplus");
  EXPECT_EQ(c.routed_scaling_factor, 1.5);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
}

TEST(V4Config, ErrorsNameTheFieldAndTheExpectedValue) {
  struct Case {
    std::function<void(json&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j.erase("compress_ratios"); }, "field 'compress_ratios' is required"},
      {[](json& j) { j["compress_ratios"] = {0, 4, 16}; },
       "field 'compress_ratios' must have num_hidden_layers + num_nextn_predict_layers = 4 entries"},
      {[](json& j) { j["compress_ratios"] = "0,4"; }, "field 'compress_ratios' must be a list of integers"},
      {[](json& j) { j["compress_ratios"] = {0, -4, 16, 0}; }, "field 'compress_ratios[1]' must be >= 0"},
      {[](json& j) { j.erase("head_dim"); }, "field 'head_dim' is required"},
      {[](json& j) { j.erase("hc_mult"); }, "field 'hc_mult' is required"},
      {[](json& j) { j.erase("num_hash_layers"); }, "field 'num_hash_layers' is required"},
      {[](json& j) { j.erase("index_topk"); }, "field 'index_topk' is required"},
      {[](json& j) { j["num_key_value_heads"] = 2; }, "field 'num_key_value_heads' must be 1"},
      {[](json& j) { j["scoring_func"] = "sigmoid"; },
       "field 'scoring_func' must be \"sqrtsoftplus\" for deepseek_v4, got \"sigmoid\""},
      {[](json& j) { j["topk_method"] = "greedy"; }, "field 'topk_method' must be \"noaux_tc\""},
      {[](json& j) { j["n_group"] = 2; }, "fields 'n_group' / 'topk_group' must be 1"},
      {[](json& j) { j["o_groups"] = 3; }, "field 'o_groups' must divide num_attention_heads=4, got 3"},
      {[](json& j) { j["qk_rope_head_dim"] = 15; }, "field 'qk_rope_head_dim' must be even"},
      {[](json& j) { j["num_nextn_predict_layers"] = 2; j["compress_ratios"] = {0, 4, 16, 0, 0}; },
       "field 'num_nextn_predict_layers' must be 0 or 1"},
      {[](json& j) { j["num_hash_layers"] = 4; }, "field 'num_hash_layers' must be in [0, num_hidden_layers=3]"},
      {[](json& j) { j["hc_sinkhorn_iters"] = 0; }, "field 'hc_sinkhorn_iters' must be a positive integer"},
      {[](json& j) { j["hc_eps"] = -1.0; }, "field 'hc_eps' must be a finite number >= 0"},
      {[](json& j) { j["rope_scaling"]["mscale"] = 0.707; },
       "fields 'rope_scaling.mscale' / 'rope_scaling.mscale_all_dim' must be absent"},
      {[](json& j) { j["index_head_dim"] = 8; }, "field 'index_head_dim' must be positive and at least qk_rope_head_dim=16"},
      {[](json& j) { j["swiglu_limit"] = -1.0; }, "field 'swiglu_limit' must be a finite number >= 0"},
      {[](json& j) { j["model_type"] = "deepseek_v5"; },
       "field 'model_type' must be \"deepseek_v3\", \"deepseek_v2\" or \"deepseek_v4\""},
      {[](json& j) { j["quantization_simulation"] = "fp8"; },
       "field 'quantization_simulation' must be \"none\" or \"reference\", got \"fp8\""},
      {[](json& j) { j["quantization_simulation"] = true; },
       "field 'quantization_simulation' must be a string, got boolean true"},
      {[](json& j) { j["quantization_simulation"] = "reference"; },
       "quantization_simulation \"reference\" quantizes the non-RoPE features of the KV in "
       "blocks of 64, so head_dim - qk_rope_head_dim must be a multiple of 64, got 32 - 16 = 16"},
      {[](json& j) {
         j["quantization_simulation"] = "reference";
         j["head_dim"] = 80;
         j["index_head_dim"] = 48;
       },
       "index_head_dim must be a power of two >= 32, got 48"},
  };
  for (const Case& c : cases) {
    json j = v4_json();
    c.edit(j);
    const std::string err = parse_error(j);
    EXPECT_NE(err.find(c.expect), std::string::npos) << "expected \"" << c.expect << "\", got: " << err;
    EXPECT_NE(err.find("cfg.json"), std::string::npos) << err;
  }
  // Without a CSA layer the indexer's sizes are optional.
  json j = v4_json();
  j["compress_ratios"] = {0, 16, 16, 0};
  for (const char* key : {"index_n_heads", "index_head_dim", "index_topk"}) j.erase(key);
  EXPECT_NO_THROW(parse_hf_config(j, "cfg.json"));
  // Entries beyond the layers (as the released list keeps for MTP with MTP switched off) are fine.
  j = v4_json();
  j["num_nextn_predict_layers"] = 0;
  EXPECT_EQ(parse_hf_config(j, "cfg.json").compress_ratios.size(), 4u);
}

TEST(V4Config, QuantizationSimulationIsWrittenOnlyWhenOn) {
  // Absent at "none", so a config.json stays what transformers writes.
  const json plain = model_config_to_json(read_hf_config(kFixtures / "mtp"));
  EXPECT_FALSE(plain.contains("quantization_simulation"));
  const ModelConfig on = read_hf_config(kFixtures / "qsim");
  EXPECT_TRUE(on.simulates_reference_quantization());
  const json j = model_config_to_json(on);
  EXPECT_EQ(j["quantization_simulation"], "reference");
  EXPECT_EQ(parse_hf_config(j, "round trip").quantization_simulation, "reference");
  // A V2/V3 config has nothing of V4's to simulate.
  json v3 = model_config_to_json(resolve_model_config("debug"));
  v3["quantization_simulation"] = "reference";
  const std::string err = error_of([&] { parse_hf_config(v3, "v3.json"); });
  EXPECT_NE(err.find("v3.json: field 'quantization_simulation' must be \"none\" for deepseek_v3"),
            std::string::npos) << err;
}

// [model] quantization_simulation in a training TOML and --model.quantization_simulation on
// the command line reach the model like the config.json fields, though the preset's
// config.json lacks the field.
TEST(V4Config, QuantizationSimulationIsATrainingOverride) {
  const std::string toml = "[model]\npreset = \"deepseek-v4-flash\"\n";
  TrainConfig t = parse_train_config(toml + "quantization_simulation = \"reference\"\n", "t.toml");
  EXPECT_EQ(resolve_train_model(t, 1024, 1).quantization_simulation, "reference");
  t = parse_train_config(toml, "t.toml", {{"model.quantization_simulation", "reference"}});
  EXPECT_EQ(resolve_train_model(t, 1024, 1).quantization_simulation, "reference");
  EXPECT_EQ(parse_train_config(train_config_to_toml(t), "saved").model.overrides, t.model.overrides);
  t = parse_train_config(toml, "t.toml");
  EXPECT_EQ(resolve_train_model(t, 1024, 1).quantization_simulation, "none");
  t = parse_train_config(toml, "t.toml", {{"model.quantization_simulation", "fp4"}});
  const std::string err = error_of([&] { resolve_train_model(t, 1024, 1); });
  EXPECT_NE(err.find("field 'quantization_simulation' must be \"none\" or \"reference\", got "
                     "\"fp4\""), std::string::npos) << err;
}

TEST(V4Config, TheV3ModelRefusesAV4Config) {
  const ModelConfig c = small_config();
  const std::string err = error_of([&] { DeepSeekModel m(c); });
  EXPECT_NE(err.find("deepseek_v4"), std::string::npos) << err;
  ModelConfig v3 = c;
  v3.model_type = "deepseek_v3";
  EXPECT_THROW(DeepSeekV4Model m(v3), Error);
}
