// LoRA adapters: gradients against finite differences for every target kind (dense linears,
// kv_a_proj_with_mqa's split output, routed experts over fp32 and MXFP4 bases), PEFT's
// initialisation and names, target selection, dropout masks, determinism and zero-token experts.
#include <cstring>
#include <functional>
#include <set>

#include "core/memory.h"
#include "core/parallel.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "lora/peft_adapter.h"
#include "train/adamw.h"
#include "train/train_config.h"
#include "io/model_spec.h"
#include "model/model.h"
#include "moe/mxfp4_expert_weights.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

double linear_loss(Linear& lin, const Tensor& x, const Tensor& r) {
  Tensor y = lin.forward(x, Pass::Eval);
  return dot(y.f32(), r.f32(), y.numel());
}

// B starts at zero (PEFT), which leaves A without gradient: tests give B values.
void randomize_b(const ParamList& ps, uint64_t seed, float scale = 0.05f) {
  Rng rng(seed);
  for (Param* p : ps)
    if (p->name.find("lora_B") != std::string::npos) fill_random(p->value, rng, scale);
}

}  // namespace

TEST(LoraLinear, BackwardMatchesFiniteDifferencesWithAndWithoutDropout) {
  for (float dropout : {0.0f, 0.3f}) {
    SCOPED_TRACE(dropout);
    LoraRuntime rt;
    rt.dropout_active = true;
    rt.seed = 5;
    rt.draw = 3;
    rt.row_offset = 100;
    Linear lin;
    lin.init("model.layers.0.mlp.down_proj.weight", 24, 20);
    Rng rng(1);
    fill_random(lin.weight.value, rng, 0.2f);
    lin.lora = std::make_unique<LoraAdapter>();
    lin.lora->init(lin.module_name(), 24, 20, LoraShape{4, 1.5f, dropout}, &rt);
    lin.lora->init_weights(9);
    ParamList ps;
    lin.lora->collect(ps);
    randomize_b(ps, 2, 0.3f);
    lin.lora->allocate_grads();
    Tensor x = random_tensor({7, 24}, rng), r = random_tensor({7, 20}, rng);
    lin.forward(x, Pass::Train);
    Tensor dx = lin.backward(r);
    EXPECT_FALSE(lin.has_saved());
    auto loss = [&] { return linear_loss(lin, x, r); };
    EXPECT_LT(finite_difference_check(loss, x.f32(), dx.f32(), x.numel()), 1e-2);
    for (Param* p : ps)
      EXPECT_LT(finite_difference_check(loss, p->w(), p->g(), p->value.numel()), 1e-2) << p->name;
    if (dropout > 0) {
      // Dropout really drops: the delta changes with the micro-batch draw, not within one.
      Tensor y1 = lin.forward(x, Pass::Eval), y2 = lin.forward(x, Pass::Eval);
      EXPECT_EQ(std::memcmp(y1.f32(), y2.f32(), y1.nbytes()), 0);
      rt.draw = 4;
      Tensor y3 = lin.forward(x, Pass::Eval);
      EXPECT_NE(std::memcmp(y1.f32(), y3.f32(), y1.nbytes()), 0);
      rt.dropout_active = false;  // evaluation: no dropout, the plain adapter
      Tensor y4 = lin.forward(x, Pass::Eval);
      EXPECT_NE(std::memcmp(y1.f32(), y4.f32(), y1.nbytes()), 0);
    }
  }
}

TEST(LoraLinear, PeftNamesShapesAndInitialisation) {
  LoraAdapter a;
  a.init("model.layers.2.self_attn.o_proj", 48, 32, LoraShape{8, 2.0f, 0.0f}, nullptr);
  a.init_weights(1);
  EXPECT_EQ(a.A.name, "base_model.model.model.layers.2.self_attn.o_proj.lora_A.weight");
  EXPECT_EQ(a.B.name, "base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight");
  EXPECT_EQ(a.A.value.shape(), (Shape{8, 48}));
  EXPECT_EQ(a.B.value.shape(), (Shape{32, 8}));
  // kaiming_uniform(a = √5): U(-1/√in, 1/√in), spread over the range; B zero.
  const float bound = 1.0f / std::sqrt(48.0f);
  double lo = 0, hi = 0;
  for (int64_t i = 0; i < a.A.value.numel(); ++i) {
    EXPECT_LE(std::fabs(a.A.w()[i]), bound);
    lo = std::min(lo, double(a.A.w()[i])), hi = std::max(hi, double(a.A.w()[i]));
  }
  EXPECT_LT(lo, -0.8 * bound);
  EXPECT_GT(hi, 0.8 * bound);
  EXPECT_EQ(max_abs(a.B.w(), a.B.value.numel()), 0.0);
}

TEST(LoraSettings, ScalingRsLoraAndExpertRank) {
  LoraSettings s;
  s.r = 16, s.alpha = 32;
  EXPECT_FLOAT_EQ(s.shape_for(false).scale, 2.0f);
  s.rslora = true;
  EXPECT_FLOAT_EQ(s.shape_for(false).scale, 8.0f);
  s.rslora = false;
  s.expert_r = 4, s.expert_alpha = 4;
  EXPECT_EQ(s.shape_for(true).rank, 4);
  EXPECT_FLOAT_EQ(s.shape_for(true).scale, 1.0f);
  EXPECT_EQ(s.shape_for(false).rank, 16);
  s.dropout = 1.0;
  EXPECT_NE(error_of([&] { s.validate("lora"); }).find("lora.dropout = 1"), std::string::npos);
}

// ---------------------------------------------------------------- whole model

namespace {

ModelConfig lora_config(bool q_lora, const std::string& experts) {
  ModelConfig c = resolve_model_config("debug");
  c.q_lora_rank = q_lora ? 16 : 0;
  c.aux_loss_alpha = 0.01;
  c.expert_format = experts;
  return c;
}

struct LoraModel {
  explicit LoraModel(const ModelConfig& cfg, const LoraSettings& s = {}, uint64_t seed = 3)
      : model(cfg) {
    model.init_weights(seed);
    model.freeze_base();
    model.add_lora(s, seed + 1);
    randomize_b(model.lora_params(), seed + 2);
    model.allocate_grads();
  }
  DeepSeekModel model;
};

const BatchShape kShape{2, 11};

double model_loss(DeepSeekModel& m, const Tensor& tokens, const Tensor& targets) {
  return m.forward(tokens, targets, kShape, Pass::Eval).ce;
}

}  // namespace

TEST(LoraModel, AllLinearTargetsEveryProjectionAndFreezesTheBase) {
  for (bool q_lora : {false, true}) {
    LoraModel m(lora_config(q_lora, "fp32"));
    std::set<std::string> kinds;
    for (Param* p : m.model.lora_params()) {
      const std::string& n = p->name;
      ASSERT_EQ(n.rfind("base_model.model.model.layers.", 0), 0u) << n;
      const size_t end = n.find(".lora_");
      const std::string module = n.substr(0, end);
      kinds.insert(module.substr(module.rfind('.') + 1) +
                   (n.find("mlp.experts.") != std::string::npos ? "@expert"
                    : n.find("shared_experts") != std::string::npos ? "@shared" : ""));
    }
    std::set<std::string> want = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                  "gate_proj", "up_proj", "down_proj",
                                  "gate_proj@shared", "up_proj@shared", "down_proj@shared",
                                  "gate_proj@expert", "up_proj@expert", "down_proj@expert"};
    if (q_lora) want.insert({"q_a_proj", "q_b_proj"});
    else want.insert("q_proj");
    EXPECT_EQ(kinds, want);
    // Only adapters train: every base parameter is frozen and has no gradient buffer.
    EXPECT_EQ(m.model.trainable_params().size(), m.model.lora_params().size());
    for (Param* p : m.model.params()) {
      EXPECT_FALSE(p->trainable) << p->name;
      EXPECT_FALSE(p->grad.defined()) << p->name;
    }
    // Per-expert PEFT keys for every expert of every MoE layer: 8 experts x 3 projections x 2.
    int64_t expert_keys = 0;
    for (Param* p : m.model.lora_params()) expert_keys += p->name.find("mlp.experts.") != std::string::npos;
    EXPECT_EQ(expert_keys, 2 * 8 * 3 * 2);
  }
}

TEST(LoraModel, FreshAdaptersGiveTheBaseModelsLogits) {
  for (const std::string experts : {"fp32", "mxfp4"}) {
    const ModelConfig cfg = lora_config(true, experts);
    DeepSeekModel base(cfg);
    base.init_weights(3);
    DeepSeekModel adapted(cfg);
    adapted.init_weights(3);
    adapted.freeze_base();
    adapted.add_lora({}, 4);  // B = 0
    Tensor tokens = random_tokens(kShape.tokens(), 256, 1);
    Tensor a = base.logits(tokens, kShape), b = adapted.logits(tokens, kShape);
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.f32()[i], b.f32()[i]) << experts << " " << i;
  }
}

namespace {

// Directional derivative of `loss` along unit direction d over all of p's entries, by central
// differences, against <g, d>: one entry's derivative is too small for an fp32 model loss, a
// whole tensor's is not. Returns |fd - <g, d>| / |g|.

}  // namespace

// Biases decide the selection (sigmoid scores are < 1): every token of MoE layer l goes to
// experts 2l - 2 and 2l - 1 (one group: n_group 2, topk_group 1), so no perturbation of a
// finite-difference step can flip a routing decision; the routing weights still vary.
void pin_routing(DeepSeekModel& model) {
  int64_t l = 1;
  for (MoELayer* m : model.moe_layers()) {
    std::fill(m->gate_bias.w(), m->gate_bias.w() + 8, 0.0f);
    m->gate_bias.w()[2 * l - 2] = m->gate_bias.w()[2 * l - 1] = 10.0f;
    ++l;
  }
}

TEST(LoraModel, GradientsMatchFiniteDifferencesForEveryTargetKind) {
  // Every adapter tensor of the model along its gradient and along a random direction: dense
  // attention projections (q_proj or q_a/q_b, kv_a_proj_with_mqa's split output, kv_b, o), the
  // dense MLP, shared experts and the grouped routed-expert adapters over an fp32 and an MXFP4
  // base. Adapters before a MoE layer see its backward, LoRA input gradients included.
  for (const std::string experts : {"fp32", "mxfp4"}) {
    for (bool q_lora : {false, true}) {
      SCOPED_TRACE(experts + (q_lora ? " q_lora" : " q_proj"));
      LoraModel m(lora_config(q_lora, experts));
      pin_routing(m.model);
      Tensor tokens = random_tokens(kShape.tokens(), 256, 11);
      Tensor targets = random_tokens(kShape.tokens(), 256, 12);
      m.model.zero_grads();
      m.model.forward(tokens, targets, kShape, Pass::Train);
      m.model.backward();
      EXPECT_FALSE(m.model.has_saved());
      auto loss = [&] { return model_loss(m.model, tokens, targets); };
      int checked = 0;
      Rng rng(5);
      for (Param* p : m.model.lora_params()) {
        const std::string& n = p->name;
        const int64_t len = p->value.numel();
        if (max_abs(p->g(), len) == 0) continue;  // an expert without tokens
        std::vector<float> along_g = unit_vector(std::vector<float>(p->g(), p->g() + len));
        std::vector<float> random(static_cast<size_t>(len));
        for (float& x : random) x = rng.normal();
        EXPECT_LT(directional_error(loss, *p, along_g, 1e-2f), 1e-2) << n << " along g";
        EXPECT_LT(directional_error(loss, *p, unit_vector(random), 1e-2f), 1e-2) << n << " random";
        ++checked;
      }
      // 3 layers x 4-5 attention adapters, 3 MLP (dense or shared) adapters, 2 MoE layers x
      // 2 experts x 3 projections; 2 matrices each.
      EXPECT_EQ(checked, 2 * (3 * (q_lora ? 5 : 4) + 3 * 3 + 2 * 2 * 3));
    }
  }
}

TEST(LoraModel, ZeroTokenExpertsHaveExactlyZeroAdapterGradients) {
  ModelConfig cfg = lora_config(false, "mxfp4");
  LoraModel m(cfg);
  pin_routing(m.model);  // layer 1: experts 0 and 1 only, layer 2: 2 and 3
  Tensor tokens = random_tokens(kShape.tokens(), 256, 1), targets = random_tokens(kShape.tokens(), 256, 2);
  m.model.zero_grads();
  m.model.forward(tokens, targets, kShape, Pass::Train);
  m.model.backward();
  for (Param* p : m.model.lora_params()) {
    if (p->name.find("mlp.experts.") == std::string::npos) continue;
    const bool layer1 = p->name.find("layers.1.") != std::string::npos;
    const bool used = p->name.find(layer1 ? "experts.0." : "experts.2.") != std::string::npos ||
                      p->name.find(layer1 ? "experts.1." : "experts.3.") != std::string::npos;
    if (used) EXPECT_GT(max_abs(p->g(), p->grad.numel()), 0.0) << p->name;
    else EXPECT_EQ(max_abs(p->g(), p->grad.numel()), 0.0) << p->name;
  }
}

TEST(LoraModel, SameBitsForAnyThreadCountAndSimdTarget) {
  LoraSettings s;
  s.dropout = 0.1;
  auto run = [&](int threads) {
    set_num_threads(threads);
    LoraModel m(lora_config(true, "mxfp4"), s);
    m.model.lora_runtime().seed = 7;
    m.model.lora_runtime().draw = 1;
    Tensor tokens = random_tokens(kShape.tokens(), 256, 1), targets = random_tokens(kShape.tokens(), 256, 2);
    LossResult r = m.model.forward(tokens, targets, kShape, Pass::Train);
    m.model.backward();
    std::vector<float> bits = {static_cast<float>(r.total())};
    for (Param* p : m.model.lora_params()) bits.insert(bits.end(), p->g(), p->g() + p->grad.numel());
    set_num_threads(2);
    return bits;
  };
  const auto one = run(1), two = run(2);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
  expect_same_bits_on_every_target([&] { return run(2); });
}

TEST(LoraModel, DropoutMasksFollowGlobalTokenIndicesNotBatchLayout) {
  // The second sequence alone (row offset = its global index) trains exactly as it does inside
  // the two-sequence batch: what a rank holding only that sequence computes.
  LoraSettings s;
  s.dropout = 0.2;
  LoraModel m(lora_config(true, "fp32"), s);
  m.model.lora_runtime().seed = 9;
  m.model.lora_runtime().draw = 4;
  Tensor tokens = random_tokens(kShape.tokens(), 256, 1);
  const int64_t S = kShape.seq;
  Tensor targets = random_tokens(kShape.tokens(), 256, 2);
  // CE of sequence 2 alone, with sequence 1's targets ignored, inside the batch ...
  Tensor masked = targets.clone(MemCategory::Scratch);
  for (int64_t i = 0; i < S; ++i) masked.i32()[i] = -100;
  const double in_batch = m.model.forward(tokens, masked, kShape, Pass::Train).ce;
  m.model.backward();
  // ... and as a batch of its own at row offset S.
  Tensor t2 = Tensor::empty({S}, DType::I32, MemCategory::Scratch), g2 = t2.clone(MemCategory::Scratch);
  std::memcpy(t2.i32(), tokens.i32() + S, S * sizeof(int32_t));
  std::memcpy(g2.i32(), targets.i32() + S, S * sizeof(int32_t));
  m.model.lora_runtime().row_offset = S;
  const double alone = m.model.forward(t2, g2, BatchShape{1, S}, Pass::Train).ce;
  m.model.backward();
  EXPECT_EQ(in_batch, alone);
  // And dropout is on: at another offset the masks differ.
  m.model.lora_runtime().row_offset = 0;
  const double shifted = m.model.forward(t2, g2, BatchShape{1, S}, Pass::Train).ce;
  m.model.backward();
  EXPECT_NE(alone, shifted);
}

TEST(LoraModel, TargetSelectionFollowsPeftAndRejectsWhatMatchesNothing) {
  const ModelConfig cfg = lora_config(true, "fp32");
  auto count = [&](const LoraSettings& s) {
    DeepSeekModel m(cfg);
    m.freeze_base();
    return static_cast<int64_t>(m.add_lora(s, 1).size());
  };
  LoraSettings s;
  s.targets = {"q_a_proj", "o_proj"};
  EXPECT_EQ(count(s), 3 * 2 * 2);
  s.targets = {"self_attn.kv_a_proj_with_mqa"};
  EXPECT_EQ(count(s), 3 * 2);
  s.targets = {"shared_experts.down_proj"};
  EXPECT_EQ(count(s), 2 * 2);
  s.targets = {"experts.3.up_proj"};  // one expert of a grouped adapter: all or none
  EXPECT_NE(error_of([&] { count(s); }).find("select 1 of the 8 routed experts' up_proj"),
            std::string::npos);
  s.targets = {"q_a_proj", "wq"};
  EXPECT_NE(error_of([&] { count(s); }).find("lora.targets: \"wq\" matches no module"),
            std::string::npos);
  s.targets = {};
  s.target_regex = R"(model\.layers\.[12]\.mlp\.experts\.\d+\.(gate|up)_proj)";
  EXPECT_EQ(count(s), 2 * 8 * 2 * 2);
  s.target_regex = "nothing";
  EXPECT_NE(error_of([&] { count(s); }).find("matches no module"), std::string::npos);
  s.target_regex = "(";
  EXPECT_NE(error_of([&] { count(s); }).find("not a regular expression"), std::string::npos);
  s.target_regex.clear();
  s.targets = {"q_a_proj"};
  s.target_parameters = {"mlp.experts.gate_up_proj"};  // DeepSeek-V4's fused experts only
  EXPECT_NE(error_of([&] { count(s); }).find("target_parameters name DeepSeek-V4's fused"),
            std::string::npos);
}


TEST(LoraModel, LoadingAndFineTuningAnMxfp4BaseNeverHoldsAnFp32Expert) {
  // The base comes from an fp32 file (quantized row by row on load), adapters on every linear
  // including the routed experts train for three steps: no allocation of any category reaches
  // one fp32 expert, weights stay the packed store plus the fp32 non-expert tensors, and the
  // adapters' own memory is exactly their matrices, gradients and two AdamW moments.
  MemoryTracker& mem = MemoryTracker::instance();
  ModelConfig cfg = lora_config(true, "mxfp4");
  cfg.moe_intermediate_size = 256;
  ModelConfig fp32_cfg = cfg;
  fp32_cfg.expert_format = "fp32";
  const int64_t expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4;
  const std::filesystem::path dir = scratch_dir("test_lora_tmp");
  {
    DeepSeekModel dense(fp32_cfg);
    dense.init_weights(5);
    save_model(dir / "fp32", fp32_cfg, dense.params());
  }
  const int64_t weights_before = mem.current(MemCategory::Weights);
  mem.reset_peaks();
  {
    DeepSeekModel model(cfg);
    load_weights(dir / "fp32", model.params());
    model.freeze_base();
    LoraSettings s;
    s.dropout = 0.1;
    model.add_lora(s, 1);
    model.allocate_grads();
    AdamW opt(model.trainable_params(), AdamWConfig{});
    const Tensor tokens = random_tokens(2 * 16, cfg.vocab_size, 8);
    for (int step = 0; step < 3; ++step) {
      model.zero_grads();
      model.forward(tokens, tokens, {2, 16}, Pass::Train);
      model.backward();
      opt.step(1e-3);
      model.logits(tokens, {2, 16});
    }
    const MemSnapshot m = mem.snapshot();
    int64_t packed = 0, fp32 = 0, adapters = 0, largest_block = 0;
    for (MoELayer* l : model.moe_layers()) packed += l->mxfp4_experts()->bytes();
    for (Param* p : model.params())
      if (!p->packed()) fp32 += p->value.nbytes();
    for (Param* p : model.lora_params()) adapters += p->value.nbytes();
    for (MoELayer* l : model.moe_layers()) {
      const GroupedLoraAdapter& g = *l->expert_lora().gate;
      largest_block = std::max(largest_block, g.experts().count * g.shape().rank *
                                                  (g.in() + g.out()) * 4);
    }
    const auto at = [&](MemCategory c, bool peak = false) {
      return (peak ? m.peak : m.current)[static_cast<size_t>(c)];
    };
    EXPECT_LT(at(MemCategory::Weights, true) - weights_before, packed + fp32 + expert)
        << "weights stay packed (plus the RoPE table)";
    EXPECT_EQ(at(MemCategory::Grads), 0);
    EXPECT_EQ(at(MemCategory::Optimizer), 0);
    EXPECT_EQ(at(MemCategory::AdapterWeights), adapters);
    EXPECT_EQ(at(MemCategory::AdapterGrads), adapters);
    EXPECT_EQ(at(MemCategory::AdapterOptimizer), 2 * adapters);
    for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c) {
      const auto cat = static_cast<MemCategory>(c);
      // Workspace: the GEMM's packing panels, bounded by block sizes whatever the model (at this
      // toy size a panel can exceed an expert; at real sizes an expert is far larger).
      if (cat == MemCategory::Weights || cat == MemCategory::Workspace) continue;
      EXPECT_LT(m.largest_allocation[static_cast<size_t>(c)], expert) << mem_category_name(cat);
    }
    EXPECT_EQ(m.largest_allocation[static_cast<size_t>(MemCategory::AdapterWeights)], largest_block);
  }
}

TEST(FinetuneConfig, LoraSectionDefaultsAndErrors) {
  const auto ft = ConfigPurpose::Finetune;
  TrainConfig c = parse_train_config("[model]\nweights = \"base\"\n[lora]\nr = 4\nexpert_r = 2\n",
                                     "ft.toml", {{"lora.targets", "q_a_proj,o_proj"}}, ft);
  const LoraSettings s = lora_settings(c);
  EXPECT_EQ(s.r, 4);
  EXPECT_EQ(s.expert_r, 2);
  EXPECT_EQ(s.targets, (std::vector<std::string>{"q_a_proj", "o_proj"}));
  EXPECT_TRUE(c.finetune);
  EXPECT_EQ(c.optimizer.bias_update_rate, 0.0);  // a frozen base keeps its router biases
  EXPECT_EQ(c.model.preset, "");                   // the base's own config
  // The resolved config round-trips, [lora] included.
  const TrainConfig again = parse_train_config(train_config_to_toml(c), "saved", {}, ft);
  EXPECT_EQ(train_config_to_toml(again), train_config_to_toml(c));
  auto err = [&](const std::string& text, std::vector<ConfigOverride> o, ConfigPurpose p) {
    return error_of([&] { parse_train_config(text, "x.toml", o, p); });
  };
  EXPECT_NE(err("[lora]\nr = 4\n", {}, ConfigPurpose::Pretrain).find("[lora] configures `moe finetune`"),
            std::string::npos);
  EXPECT_NE(err("", {{"lora.r", "4"}}, ConfigPurpose::Pretrain).find("--lora.r: [lora] configures"),
            std::string::npos);
  EXPECT_NE(err("", {}, ft).find("model.weights: expected the base model's directory"),
            std::string::npos);
  EXPECT_NE(err("[model]\nweights = \"b\"\n[optimizer]\nbias_update_rate = 0.001\n", {}, ft)
                .find("bias_update_rate = 0.001: the base model is frozen"),
            std::string::npos);
  EXPECT_NE(err("[model]\nweights = \"b\"\n[lora]\nr = 0\n", {}, ft).find("lora.r"),
            std::string::npos);
  EXPECT_NE(err("[model]\nweights = \"b\"\n[lora]\ndropout = 1.0\n", {}, ft).find("lora.dropout"),
            std::string::npos);
  EXPECT_NE(err("[data]\nformat = \"chat\"\n", {}, ConfigPurpose::Pretrain)
                .find("data.format = \"chat\" is a fine-tuning format"),
            std::string::npos);
}

TEST(PeftAdapter, ConfigRoundTripAndUnsupportedFeaturesAreErrors) {
  LoraSettings s;
  s.r = 16, s.alpha = 32, s.dropout = 0.05, s.rslora = true, s.expert_r = 4, s.expert_alpha = 8;
  s.targets = {"q_a_proj", "o_proj", "gate_proj"};
  const nlohmann::json j = peft_adapter_config(s, "base/dir");
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["r"], 16);
  EXPECT_EQ(j["rank_pattern"][kExpertRankPattern], 4);
  const LoraSettings back = lora_settings_from_peft(j, "adapter_config.json");
  EXPECT_EQ(back.r, 16);
  EXPECT_EQ(back.alpha, 32);
  EXPECT_EQ(back.dropout, 0.05);
  EXPECT_TRUE(back.rslora);
  EXPECT_EQ(back.targets, s.targets);
  EXPECT_EQ(back.expert_r, 4);
  EXPECT_EQ(back.expert_alpha, 8);
  // "all-linear" and a regex are PEFT strings.
  s.targets = {"all-linear"};
  EXPECT_EQ(peft_adapter_config(s, "b")["target_modules"], "all-linear");
  nlohmann::json r = j;
  r["target_modules"] = R"(.*\.o_proj)";
  EXPECT_EQ(lora_settings_from_peft(r, "x").target_regex, R"(.*\.o_proj)");
  auto err = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json bad = j;
    bad[key] = value;
    return error_of([&] { lora_settings_from_peft(bad, "adapter_config.json"); });
  };
  EXPECT_NE(err("use_dora", true).find("'use_dora' = true: DoRA is not supported"), std::string::npos);
  EXPECT_NE(err("lora_bias", true).find("lora_bias"), std::string::npos);
  EXPECT_NE(err("exclude_modules", {"o_proj"}).find("exclude_modules"), std::string::npos);
  EXPECT_NE(err("layers_to_transform", {0, 1}).find("layer selection"), std::string::npos);
  // Fused expert parameters are DeepSeek-V4's (tests/test_v4_lora.cpp); other ones are refused.
  EXPECT_NE(err("target_parameters", {"mlp.experts.gate_up"}).find("target_parameters"),
            std::string::npos);
  EXPECT_NE(err("rank_pattern", {{"o_proj", 4}}).find("only {\""), std::string::npos);
  EXPECT_NE(err("peft_type", "LOHA").find("expected \"LORA\""), std::string::npos);
  EXPECT_EQ(err("lora_bias", false), "(no error)");
}

// Found by tests/fuzz/fuzz_adapter_config: a float where a rank belongs (r, rank_pattern) was
// cast to an integer, undefined beyond int64's range.
TEST(PeftAdapter, RanksOutOfRangeAreErrorsNotCasts) {
  const nlohmann::json good = {{"r", 4}, {"lora_alpha", 8.0}, {"target_modules", "all-linear"}};
  auto err = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json bad = good;
    bad[key] = value;
    return error_of([&] { lora_settings_from_peft(bad, "adapter_config.json"); });
  };
  EXPECT_NE(err("r", 1e300).find("field 'r': expected an integer"), std::string::npos);
  EXPECT_NE(err("r", int64_t{1} << 40).find("[1, 65536]"), std::string::npos);
  EXPECT_NE(err("rank_pattern", {{kExpertRankPattern, 1e300}}).find("rank_pattern"), std::string::npos);
  EXPECT_NE(err("rank_pattern", {{kExpertRankPattern, 2.5}}).find("integer rank"), std::string::npos);
  EXPECT_EQ(lora_settings_from_peft(good, "x").r, 4);
}

// Found by tests/fuzz/fuzz_train_config and fuzz_adapter_config: libstdc++'s std::regex read the
// back-reference \2222222222222222222 into a long and overflowed (UBSan), and matched ".**x" by
// backtracking for ever. Target regexes now run on PCRE2 with a match limit.
TEST(LoraSettings, TargetRegexWithBadNumbersOrRunawayBacktrackingIsAnError) {
  LoraSettings s;
  auto err = [&](const std::string& regex) {
    s.target_regex = regex;
    return error_of([&] { s.validate("lora"); });
  };
  EXPECT_EQ(err(R"(.*\2222222222222222222)"), "(no error)");  // PCRE2: an octal escape, then digits
  EXPECT_NE(err("a{99999999999999999999}").find("is not a regular expression"), std::string::npos);
  EXPECT_NE(err(std::string(2000, 'a')).find("at most 1024"), std::string::npos);
  EXPECT_EQ(err(R"(model\.layers\.\d{1,3}\.self_attn\.(q_a_proj|o_proj))"), "(no error)");
  LoraTargetMatcher matcher(s);
  EXPECT_TRUE(matcher.matches("model.layers.12.self_attn.o_proj"));
  EXPECT_FALSE(matcher.matches("model.layers.12.mlp.gate_proj"));
  s.target_regex = "(.*)*(.*)*(.*)*(.*)*s";
  LoraTargetMatcher runaway(s);
  EXPECT_NE(error_of([&] { runaway.matches("model.layers.12.self_attn.kv_a_proj_with_mqa"); }).find("backtracks"),
            std::string::npos);
}

TEST(PeftAdapter, SavedAdapterLoadsBackAndForeignTensorsAreErrors) {
  const std::filesystem::path dir = scratch_dir("test_lora_tmp");
  LoraModel m(lora_config(true, "mxfp4"));
  LoraSettings s;
  save_peft_adapter(dir / "a", m.model, s, "base");
  EXPECT_NE(read_file(dir / "a" / kAdapterWeightsFile).find("\"format\":\"pt\""), std::string::npos);
  DeepSeekModel again(lora_config(true, "mxfp4"));
  again.init_weights(3);
  again.freeze_base();
  apply_peft_adapter(dir / "a", again);
  ASSERT_EQ(again.lora_params().size(), m.model.lora_params().size());
  for (size_t i = 0; i < again.lora_params().size(); ++i) {
    const Param* a = again.lora_params()[i];
    const Param* b = m.model.lora_params()[i];
    EXPECT_EQ(a->name, b->name);
    EXPECT_EQ(std::memcmp(a->w(), b->w(), a->value.nbytes()), 0) << a->name;
  }
  // A lora_B bias (PEFT's lora_bias) next to the matrices: refused, naming the tensor.
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (Param* p : m.model.lora_params()) tensors.emplace_back(p->name, p->value);
  tensors.emplace_back("base_model.model.model.layers.0.self_attn.o_proj.lora_B.bias",
                       Tensor::zeros({64}, DType::F32, MemCategory::Scratch));
  write_safetensors(dir / "a" / kAdapterWeightsFile, tensors);
  DeepSeekModel third(lora_config(true, "mxfp4"));
  third.freeze_base();
  EXPECT_NE(error_of([&] { apply_peft_adapter(dir / "a", third); }).find("o_proj.lora_B.bias' is not a LoRA matrix"),
            std::string::npos);
}
