// LoRA over DeepSeek-V4 (model/v4/v4_lora.h): targets are Hugging Face deepseek_v4 module names,
// and o_a_proj, the compressor, the indexer and the MTP layer are never adapted; every adapter
// gradient against finite differences over fp32 and MXFP4 experts; fresh adapters give the base
// model bitwise; the routed experts' PEFT fused ParamWrapper layout checked against PEFT's
// get_delta_weight arithmetic written out from SPEC §8.1, loaded back bitwise, and its errors;
// merging; `moe finetune`'s trainer on a tiny V4 model with MXFP4 experts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/parallel.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "lora/merge.h"
#include "lora/peft_adapter.h"
#include "model/v4/v4_lora.h"
#include "model/v4/v4_model.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kFixtures = fs::path(MOE_SOURCE_DIR) / "tests/fixtures/v4";

// The mtp fixture's model: a hash layer, a CSA and an HCA layer, MTP; 8 experts top-2, hidden 64,
// expert width 32. index_topk is raised so that at the test lengths every visible compressed
// entry is picked: the wq_a adapter feeds the indexer, and a finite-difference step must not
// flip one of its (integer) decisions.
ModelConfig v4_config(const std::string& experts = "fp32") {
  ModelConfig c = read_hf_config(kFixtures / "mtp");
  c.index_topk = 8;
  c.expert_format = experts;
  return c;
}

const BatchShape kShape{2, 24};
constexpr int64_t kLayers = 3, kExperts = 8, kHidden = 64, kExpertWidth = 32;

// B starts at zero (PEFT), which leaves A without gradient: tests give B values.
void randomize_b(const ParamList& ps, uint64_t seed, float scale = 0.05f) {
  Rng rng(seed);
  for (Param* p : ps)
    if (p->name.find("lora_B") != std::string::npos) fill_random(p->value, rng, scale);
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
  DeepSeekV4Model model;
};

// "base_model.model.<module>.lora_A.weight" -> <module>.
std::string module_of(const std::string& key) {
  const std::string head = "base_model.model.";
  return key.substr(head.size(), key.find(".lora_") - head.size());
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

// Logits of the main and the MTP head.
std::pair<Tensor, Tensor> both_logits(DeepSeekV4Model& m, const Tensor& tokens) {
  Tensor mtp;
  Tensor main = m.logits(tokens, kShape, &mtp);
  return {main, mtp};
}

// Biases decide the selection of every top-k layer (sqrtsoftplus scores are about 1): layer 1
// routes every token to experts 0 and 1, layer 2 to 2 and 3, MTP to 4 and 5, so no
// finite-difference step can flip a routing decision; the routing weights still vary. Layer 0
// routes by token id (hash).
void pin_routing(DeepSeekV4Model& model) {
  int64_t pair = 0;
  for (MoELayer* m : model.moe_layers()) {
    if (m->selection() != ExpertSelection::TopK) continue;
    std::fill(m->gate_bias.w(), m->gate_bias.w() + kExperts, 0.0f);
    m->gate_bias.w()[2 * pair] = m->gate_bias.w()[2 * pair + 1] = 10.0f;
    ++pair;
  }
}

// Directional derivative of `loss` along unit direction d over all of p's entries, by central
// differences, against <g, d>; returns |fd - <g, d>| / |g|.

}  // namespace

// ---------------------------------------------------------------- targets

TEST(V4Lora, AllLinearAdaptsTheHuggingFaceModulesAndFreezesTheBase) {
  LoraModel m(v4_config());
  std::set<std::string> kinds;
  for (Param* p : m.model.lora_params()) {
    const std::string module = module_of(p->name);
    ASSERT_EQ(module.rfind("model.layers.", 0), 0u) << p->name;
    for (const char* never : {"o_a_proj", "compressor", "indexer", "mtp"})
      EXPECT_EQ(module.find(never), std::string::npos) << p->name;
    std::string kind = module.substr(module.find('.', std::strlen("model.layers.")) + 1);
    if (kind.starts_with("mlp.experts.")) kind = "mlp.experts.N" + kind.substr(kind.find('.', 12));
    kinds.insert(kind);
    // Each adapter's module is a weight of the model under its released name.
    const std::string weight = v4_weight_of_hf_module(module);
    ASSERT_FALSE(weight.empty()) << module;
    EXPECT_EQ(v4_hf_module_of(weight.substr(0, weight.size() - 7)), module);
    bool found = false;
    for (Param* w : m.model.params()) found |= w->name == weight;
    EXPECT_TRUE(found) << weight;
  }
  const std::set<std::string> want = {
      "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
      "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
      "mlp.experts.N.gate_proj", "mlp.experts.N.up_proj", "mlp.experts.N.down_proj"};
  EXPECT_EQ(kinds, want);
  EXPECT_EQ(m.model.lora_params().size(), static_cast<size_t>(kLayers * (7 + 3 * kExperts) * 2));
  EXPECT_EQ(v4_weight_of_hf_module("model.layers.2.mlp.experts.5.gate_proj"),
            "layers.2.ffn.experts.5.w1.weight");
  EXPECT_EQ(v4_weight_of_hf_module("model.layers.1.self_attn.kv_proj"), "layers.1.attn.wkv.weight");
  EXPECT_EQ(v4_weight_of_hf_module("model.layers.1.self_attn.o_a_proj"), "");
  EXPECT_EQ(v4_weight_of_hf_module("model.layers.1.self_attn.compressor.kv_proj"), "");
  // Only adapters train: no base parameter trains or has a gradient buffer.
  EXPECT_EQ(m.model.trainable_params().size(), m.model.lora_params().size());
  for (Param* p : m.model.params()) {
    EXPECT_FALSE(p->trainable) << p->name;
    EXPECT_FALSE(p->grad.defined()) << p->name;
  }
}

TEST(V4Lora, TargetSelectionAndWhatIsNeverAdapted) {
  const ModelConfig cfg = v4_config();
  auto count = [&](const LoraSettings& s) {
    DeepSeekV4Model m(cfg);
    m.freeze_base();
    return static_cast<int64_t>(m.add_lora(s, 1).size());
  };
  auto err = [&](const LoraSettings& s) { return error_of([&] { count(s); }); };
  LoraSettings s;
  // A suffix that PEFT would also apply to the compressor's kv_proj adapts the attention's only.
  s.targets = {"kv_proj"};
  EXPECT_EQ(count(s), kLayers * 2);
  s.targets = {"q_a_proj", "o_b_proj"};
  EXPECT_EQ(count(s), kLayers * 2 * 2);
  s.targets = {"shared_experts.down_proj"};
  EXPECT_EQ(count(s), kLayers * 2);
  s.targets = {"gate_proj", "up_proj"};  // shared and routed experts
  EXPECT_EQ(count(s), kLayers * 2 * 2 + kLayers * 2 * kExperts * 2);
  s.targets = {};
  s.target_parameters = {"mlp.experts.gate_up_proj"};
  EXPECT_EQ(count(s), kLayers * 2 * kExperts * 2);
  s.target_parameters = {"model.layers.1.mlp.experts.down_proj"};
  EXPECT_EQ(count(s), kExperts * 2);
  s.target_parameters = {"mlp.experts.gate_proj"};
  EXPECT_NE(err(s).find("lora.target_parameters: \"mlp.experts.gate_proj\" matches no parameter"),
            std::string::npos) << err(s);
  s.target_parameters.clear();

  s.targets = {"o_a_proj"};
  std::string e = err(s);
  EXPECT_NE(e.find("model.layers.0.self_attn.o_a_proj"), std::string::npos) << e;
  EXPECT_NE(e.find("grouped linear"), std::string::npos) << e;
  s.targets = {};
  s.target_regex = R"(model\.layers\.\d+\.self_attn\.o_.*)";
  EXPECT_NE(err(s).find("o_a_proj"), std::string::npos) << err(s);
  s.target_regex.clear();
  s.targets = {"compressor.kv_proj"};
  e = err(s);
  EXPECT_NE(e.find("\"compressor.kv_proj\" reaches only modules moe does not adapt, such as "
                   "model.layers.1.self_attn.compressor.kv_proj"), std::string::npos) << e;
  s.targets = {"indexer.q_b_proj"};
  EXPECT_NE(err(s).find("model.layers.1.self_attn.compressor.indexer.q_b_proj"), std::string::npos);
  s.targets = {"e_proj"};  // MTP has no Hugging Face name
  e = err(s);
  EXPECT_NE(e.find("lora.targets: \"e_proj\" matches no module"), std::string::npos) << e;
  EXPECT_NE(e.find("deepseek_v4"), std::string::npos) << e;
  s.targets = {"experts.3.up_proj"};
  EXPECT_NE(err(s).find("select 1 of the 8 routed experts' up_proj"), std::string::npos);
  s.targets = {"gate_proj"};  // routed gate without up: one fused parameter in HF
  e = err(s);
  EXPECT_NE(e.find("gate_proj but not up_proj"), std::string::npos) << e;
  EXPECT_NE(e.find("mlp.experts.gate_up_proj"), std::string::npos) << e;

  // A refused target leaves the model without adapters.
  DeepSeekV4Model m(cfg);
  m.freeze_base();
  s.targets = {"q_a_proj", "compressor.kv_proj"};
  EXPECT_NE(error_of([&] { m.add_lora(s, 1); }), "(no error)");
  EXPECT_FALSE(m.has_lora());
  EXPECT_EQ(m.blocks()[0]->attn.wq_a.lora, nullptr);
  EXPECT_EQ(m.add_lora({}, 1).size(), static_cast<size_t>(kLayers * (7 + 3 * kExperts) * 2));
}

// ---------------------------------------------------------------- forward and gradients

TEST(V4Lora, FreshAdaptersGiveTheBaseModelsLogitsAndLossBitwise) {
  for (const std::string experts : {"fp32", "mxfp4"}) {
    SCOPED_TRACE(experts);
    const ModelConfig cfg = v4_config(experts);
    DeepSeekV4Model base(cfg);
    base.init_weights(3);
    DeepSeekV4Model adapted(cfg);
    adapted.init_weights(3);
    adapted.freeze_base();
    adapted.add_lora({}, 4);  // B = 0
    const Tensor tokens = random_tokens(kShape.tokens(), cfg.vocab_size, 1);
    const Tensor targets = random_tokens(kShape.tokens(), cfg.vocab_size, 2);
    const auto [a, a_mtp] = both_logits(base, tokens);
    const auto [b, b_mtp] = both_logits(adapted, tokens);
    EXPECT_TRUE(same_bits(a, b));
    EXPECT_TRUE(same_bits(a_mtp, b_mtp));
    const LossResult la = base.forward(tokens, targets, kShape, Pass::Eval);
    const LossResult lb = adapted.forward(tokens, targets, kShape, Pass::Eval);
    EXPECT_EQ(la.total(), lb.total());
  }
}

TEST(V4Lora, GradientsMatchFiniteDifferencesForEveryTargetKind) {
  // Every adapter tensor along its gradient and along a random direction: the attention's
  // q_a / q_b / kv / o_b projections, the shared experts and the grouped routed-expert adapters
  // over fp32 and MXFP4 experts, with the MTP loss in the objective (its block sees the main
  // model's final streams, so it reaches every adapter).
  for (const std::string experts : {"fp32", "mxfp4"}) {
    SCOPED_TRACE(experts);
    LoraModel m(v4_config(experts));
    pin_routing(m.model);
    const Tensor tokens = random_tokens(kShape.tokens(), 128, 11);
    const Tensor targets = random_tokens(kShape.tokens(), 128, 12);
    m.model.zero_grads();
    const LossResult r = m.model.forward(tokens, targets, kShape, Pass::Train);
    EXPECT_GT(r.mtp_ce, 0.0);
    m.model.backward();
    EXPECT_FALSE(m.model.has_saved());
    for (Param* p : m.model.params()) EXPECT_FALSE(p->grad.defined()) << p->name;
    auto loss = [&] { return m.model.forward(tokens, targets, kShape, Pass::Eval).total(); };
    int checked = 0;
    double worst = 0;
    Rng rng(5);
    for (Param* p : m.model.lora_params()) {
      const int64_t len = p->value.numel();
      // Only a routed expert without tokens has no gradient: in the pinned layers those other
      // than the two picked (layer 1: experts 0 and 1, layer 2: 2 and 3).
      const std::string& n = p->name;
      const bool expert = n.find("mlp.experts.") != std::string::npos;
      const bool unrouted = (n.find("layers.1.mlp.experts.") != std::string::npos &&
                             n.find("experts.0.") == std::string::npos &&
                             n.find("experts.1.") == std::string::npos) ||
                            (n.find("layers.2.mlp.experts.") != std::string::npos &&
                             n.find("experts.2.") == std::string::npos &&
                             n.find("experts.3.") == std::string::npos);
      if (max_abs(p->g(), len) == 0) {
        EXPECT_TRUE(expert && !unrouted ? n.find("layers.0.") != std::string::npos : unrouted)
            << n << " has no gradient";
        continue;
      }
      EXPECT_FALSE(unrouted) << n << " has a gradient without tokens";
      std::vector<float> random(static_cast<size_t>(len));
      for (float& x : random) x = rng.normal();
      const double along_g =
          directional_error(loss, *p, unit_vector(std::vector<float>(p->g(), p->g() + len)), 1e-2f);
      const double along_random = directional_error(loss, *p, unit_vector(random), 1e-2f);
      EXPECT_LT(along_g, 1e-2) << n << " along g";
      EXPECT_LT(along_random, 1e-2) << n << " random";
      worst = std::max({worst, along_g, along_random});
      ++checked;
    }
    // Per layer 7 dense adapters; routed experts: the pinned layers 1 and 2 use 2 experts each,
    // the hash layer 0 the experts its tokens map to (at least 2).
    EXPECT_GE(checked, 2 * (kLayers * 7 + 3 * (2 + 2 + 2)));
    std::printf("[%s] %d adapter matrices, worst directional error %.2e\n", experts.c_str(),
                checked, worst);
  }
}

TEST(V4Lora, DropoutOnlyWhileTrainingAndSameBitsOnEveryThreadCountAndTarget) {
  LoraSettings s;
  s.dropout = 0.2;
  auto run = [&](int threads) {
    set_num_threads(threads);
    LoraModel m(v4_config("mxfp4"), s);
    m.model.lora_runtime().seed = 7;
    m.model.lora_runtime().draw = 1;
    const Tensor tokens = random_tokens(kShape.tokens(), 128, 1);
    const Tensor targets = random_tokens(kShape.tokens(), 128, 2);
    const LossResult r = m.model.forward(tokens, targets, kShape, Pass::Train);
    m.model.backward();
    const double eval1 = m.model.forward(tokens, targets, kShape, Pass::Eval).total();
    const double eval2 = m.model.forward(tokens, targets, kShape, Pass::Eval).total();
    EXPECT_EQ(eval1, eval2);
    EXPECT_NE(r.total(), eval1) << "dropout is on in a training forward only";
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

// ---------------------------------------------------------------- PEFT layout

namespace {

// What PEFT's ParamWrapper.get_delta_weight computes for a 3-D parameter [E, out, in] (PEFT >=
// 0.19.1, not is_transposed; SPEC §8.1 step 4), written out from that description:
//   A3 = A.reshape(E, R, in); B3 = B.reshape(out, R, E);
//   delta = einsum("o r e, e r i -> e o i", B3, A3) * scaling.
std::vector<double> peft_delta(const Tensor& A, const Tensor& B, int64_t E, double scaling) {
  const int64_t R = A.dim(0) / E, in = A.dim(1), out = B.dim(0);
  std::vector<double> d(static_cast<size_t>(E * out * in), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t r = 0; r < R; ++r) {
        const double b = B.f32()[(o * R + r) * E + e];
        for (int64_t i = 0; i < in; ++i)
          d[static_cast<size_t>((e * out + o) * in + i)] += b * A.f32()[(e * R + r) * in + i];
      }
  for (double& v : d) v *= scaling;
  return d;
}

// The engine's own delta of expert e, projection adapter g: s·B_e·A_e [out, in], written into
// rows [row0, row0 + out) of a [rows, in] block of `delta`.
void engine_delta(const GroupedLoraAdapter& g, int64_t e, int64_t row0, int64_t rows,
                  std::vector<double>& delta) {
  const Param& A = g.A(e);
  const Param& B = g.B(e);
  const int64_t r = A.value.dim(0), in = A.value.dim(1), out = B.value.dim(0);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double v = 0;
      for (int64_t k = 0; k < r; ++k) v += double(B.w()[o * r + k]) * A.w()[k * in + i];
      delta[static_cast<size_t>((e * rows + row0 + o) * in + i)] = g.shape().scale * v;
    }
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0, scale = 0;
  for (double v : b) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst / scale;
}

}  // namespace

TEST(V4PeftAdapter, RoutedExpertsAreSavedInPeftsFusedLayoutWithTheSameDeltas) {
  for (bool rslora : {false, true}) {
    SCOPED_TRACE(rslora ? "rsLoRA" : "alpha / r");
    const fs::path dir = scratch_dir("test_v4_lora_tmp");
    LoraSettings s;
    s.r = 4, s.alpha = 8, s.expert_r = 2, s.expert_alpha = 3, s.rslora = rslora;
    LoraModel m(v4_config(), s);
    save_peft_adapter(dir, m.model, s, "base");
    const json cfg = json::parse(read_file(dir / kAdapterConfigFile));
    const SafetensorsReader st(dir / kAdapterWeightsFile);

    // Every adapted module by its full path (no suffix PEFT could apply elsewhere), the fused
    // parameters as target_parameters, their rank and alpha as patterns.
    std::vector<std::string> modules = cfg["target_modules"];
    EXPECT_EQ(modules.size(), static_cast<size_t>(kLayers * 7));
    EXPECT_EQ(modules.front(), "model.layers.0.self_attn.q_a_proj");
    std::vector<std::string> params = cfg["target_parameters"];
    EXPECT_EQ(params.size(), static_cast<size_t>(kLayers * 2));
    EXPECT_EQ(params.front(), "model.layers.0.mlp.experts.gate_up_proj");
    EXPECT_EQ(cfg["rank_pattern"][kFusedGateUpPattern], 4);
    EXPECT_EQ(cfg["rank_pattern"][kFusedDownPattern], 2);
    EXPECT_DOUBLE_EQ(cfg["alpha_pattern"][kFusedGateUpPattern].get<double>(),
                     rslora ? 3 * std::sqrt(2.0) : 6.0);
    EXPECT_EQ(cfg["alpha_pattern"][kFusedDownPattern], 3.0);
    EXPECT_EQ(cfg["peft_version"], "0.19.1");
    for (const SafetensorsEntry& e : st.entries())
      EXPECT_EQ(e.name.find("mlp.experts.0"), std::string::npos) << "per-expert key " << e.name;
    EXPECT_EQ(st.entries().size(), static_cast<size_t>(kLayers * (7 + 2) * 2));

    const std::vector<MoELayer*> layers = m.model.moe_layers();
    for (int64_t l = 0; l < kLayers; ++l) {
      SCOPED_TRACE(l);
      const std::string head = "base_model.model.model.layers." + std::to_string(l) + ".mlp.experts.";
      const MoELayer::ExpertLora& lora = layers[static_cast<size_t>(l)]->expert_lora();
      // gate_up_proj [E, 2I, H]: the inner wrapper's keys, rank 2·2.
      const Tensor A = st.read(head + "base_layer.lora_A.weight", DType::F32, MemCategory::Scratch);
      const Tensor B = st.read(head + "base_layer.lora_B.weight", DType::F32, MemCategory::Scratch);
      EXPECT_EQ(A.shape(), (Shape{4 * kExperts, kHidden}));
      EXPECT_EQ(B.shape(), (Shape{2 * kExpertWidth, 4 * kExperts}));
      const double r_gu = cfg["rank_pattern"][kFusedGateUpPattern].get<double>();
      const double a_gu = cfg["alpha_pattern"][kFusedGateUpPattern].get<double>();
      const std::vector<double> peft =
          peft_delta(A, B, kExperts, rslora ? a_gu / std::sqrt(r_gu) : a_gu / r_gu);
      std::vector<double> ours(peft.size());
      for (int64_t e = 0; e < kExperts; ++e) {
        engine_delta(*lora.gate, e, 0, 2 * kExpertWidth, ours);  // gate rows first
        engine_delta(*lora.up, e, kExpertWidth, 2 * kExpertWidth, ours);
      }
      EXPECT_LT(max_rel_diff(peft, ours), 1e-6);
      // down_proj [E, H, I]: the outer wrapper's keys.
      const Tensor Ad = st.read(head + "lora_A.weight", DType::F32, MemCategory::Scratch);
      const Tensor Bd = st.read(head + "lora_B.weight", DType::F32, MemCategory::Scratch);
      EXPECT_EQ(Ad.shape(), (Shape{2 * kExperts, kExpertWidth}));
      EXPECT_EQ(Bd.shape(), (Shape{kHidden, 2 * kExperts}));
      const double r_d = cfg["rank_pattern"][kFusedDownPattern].get<double>();
      const double a_d = cfg["alpha_pattern"][kFusedDownPattern].get<double>();
      const std::vector<double> peft_down =
          peft_delta(Ad, Bd, kExperts, rslora ? a_d / std::sqrt(r_d) : a_d / r_d);
      std::vector<double> ours_down(peft_down.size());
      for (int64_t e = 0; e < kExperts; ++e) engine_delta(*lora.down, e, 0, kHidden, ours_down);
      EXPECT_LT(max_rel_diff(peft_down, ours_down), 1e-6);
    }
  }
}

TEST(V4PeftAdapter, SavedAdaptersLoadBackBitwise) {
  struct Case {
    const char* name;
    LoraSettings s;
  };
  std::vector<Case> cases(3);
  cases[0].name = "all-linear";
  cases[0].s.dropout = 0.1, cases[0].s.expert_r = 2, cases[0].s.rslora = true;
  cases[1].name = "gate_up only";  // the fused gate_up under the outer wrapper's keys
  cases[1].s.targets = {"q_a_proj"}, cases[1].s.target_parameters = {"mlp.experts.gate_up_proj"};
  cases[2].name = "down only";
  cases[2].s.targets = {}, cases[2].s.target_parameters = {"mlp.experts.down_proj"};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = scratch_dir("test_v4_lora_tmp");
    const ModelConfig cfg = v4_config("mxfp4");
    LoraModel m(cfg, c.s);
    save_peft_adapter(dir / "adapter", m.model, c.s, "base");
    const Tensor tokens = random_tokens(kShape.tokens(), 128, 5);
    const auto [want, want_mtp] = both_logits(m.model, tokens);
    DeepSeekV4Model again(cfg);
    again.init_weights(3);
    again.freeze_base();
    // attach_peft_adapter also checks that every tensor of the file was used.
    const AttachedAdapter a = attach_peft_adapter(dir / "adapter", dir, again);
    EXPECT_EQ(a.settings.rank_for(true), c.s.rank_for(true));
    EXPECT_EQ(a.settings.shape_for(true).scale, c.s.shape_for(true).scale);
    ASSERT_EQ(again.lora_params().size(), m.model.lora_params().size());
    for (size_t i = 0; i < again.lora_params().size(); ++i) {
      const Param* x = again.lora_params()[i];
      const Param* y = m.model.lora_params()[i];
      EXPECT_EQ(x->name, y->name);
      EXPECT_TRUE(same_bits(x->value, y->value)) << x->name;
    }
    const auto [got, got_mtp] = both_logits(again, tokens);
    EXPECT_TRUE(same_bits(got, want));
    EXPECT_TRUE(same_bits(got_mtp, want_mtp));
  }
}

TEST(V4PeftAdapter, LoadErrorsNameTheTensorOrField) {
  const fs::path dir = scratch_dir("test_v4_lora_tmp");
  LoraSettings s;
  s.r = 2;
  const ModelConfig cfg = v4_config();
  LoraModel m(cfg, s);
  save_peft_adapter(dir / "ok", m.model, s, "base");

  // A gate_up B that couples a gate row with an up rank: no separate gate / up adapters.
  const std::string key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight";
  {
    const SafetensorsReader st(dir / "ok" / kAdapterWeightsFile);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const SafetensorsEntry& e : st.entries())
      tensors.emplace_back(e.name, st.read(e.name, DType::F32, MemCategory::Scratch));
    for (auto& [name, t] : tensors)
      if (name == key) t.f32()[0 * t.dim(1) + 2 * kExperts + 3] = 0.5f;  // row 0, up rank 0, expert 3
    fs::create_directories(dir / "coupled");
    fs::copy_file(dir / "ok" / kAdapterConfigFile, dir / "coupled" / kAdapterConfigFile);
    write_safetensors(dir / "coupled" / kAdapterWeightsFile, tensors);
  }
  DeepSeekV4Model base(cfg);
  base.freeze_base();
  std::string e = error_of([&] { apply_peft_adapter(dir / "coupled", base); });
  EXPECT_NE(e.find(key + "' is not block-diagonal"), std::string::npos) << e;
  EXPECT_NE(e.find("expert 3"), std::string::npos) << e;
  // An adapter for 8 experts on a model with 4.
  ModelConfig four = cfg;
  four.n_routed_experts = 4;
  DeepSeekV4Model small(four);
  small.freeze_base();
  e = error_of([&] { apply_peft_adapter(dir / "ok", small); });
  EXPECT_NE(e.find("the fused gate_up_proj adapter of 4 experts"), std::string::npos) << e;

  // adapter_config.json fields the fused layout needs.
  const json good = json::parse(read_file(dir / "ok" / kAdapterConfigFile));
  auto config_error = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return error_of([&] { lora_settings_from_peft(j, "adapter_config.json"); });
  };
  EXPECT_EQ(config_error([](json&) {}), "(no error)");
  e = config_error([](json& j) { j["rank_pattern"][kFusedGateUpPattern] = 3; });
  EXPECT_NE(e.find("expected an even rank"), std::string::npos) << e;
  e = config_error([](json& j) { j["rank_pattern"][kFusedGateUpPattern] = 8; });
  EXPECT_NE(e.find("gate_up must have rank 2r"), std::string::npos) << e;
  e = config_error([](json& j) { j["target_parameters"] = {"model.layers.0.mlp.experts.foo"}; });
  EXPECT_NE(e.find("'target_parameters': \"model.layers.0.mlp.experts.foo\" is not supported"),
            std::string::npos) << e;
  // Read back, the config rebuilds the same adapters.
  const LoraSettings back = lora_settings_from_peft(good, "adapter_config.json");
  DeepSeekV4Model rebuilt(cfg);
  rebuilt.freeze_base();
  rebuilt.add_lora(back, 1);
  ASSERT_EQ(rebuilt.lora_params().size(), m.model.lora_params().size());
  for (size_t i = 0; i < rebuilt.lora_params().size(); ++i)
    EXPECT_EQ(rebuilt.lora_params()[i]->name, m.model.lora_params()[i]->name);
}

// ---------------------------------------------------------------- merge

TEST(V4LoraMerge, MergesIntoTheReleasedWeightsFp32AndMxfp4) {
  const Tensor tokens = random_tokens(kShape.tokens(), 128, 9);
  {
    LoraModel m(v4_config("fp32"));
    const auto [want, want_mtp] = both_logits(m.model, tokens);
    const MergeReport r = merge_lora_into_base(m.model, {});
    EXPECT_FALSE(m.model.has_lora());
    EXPECT_EQ(r.matrices, kLayers * (7 + 3 * kExperts));
    const auto [got, got_mtp] = both_logits(m.model, tokens);
    const double err = rel_error(got.f32(), want.f32(), got.numel());
    const double err_mtp = rel_error(got_mtp.f32(), want_mtp.f32(), got.numel());
    std::printf("fp32 merge vs unmerged: logits %.2e, MTP logits %.2e\n", err, err_mtp);
    EXPECT_LT(err, 1e-5);
    EXPECT_LT(err_mtp, 1e-5);
    DeepSeekV4Model base(v4_config("fp32"));
    base.init_weights(3);
    EXPECT_GT(rel_error(base.logits(tokens, kShape).f32(), want.f32(), got.numel()), 1e-3)
        << "the adapters change the model";
  }
  {
    LoraModel m(v4_config("mxfp4"));
    const MergeReport r = merge_lora_into_base(m.model, {});
    ASSERT_EQ(r.requantized.size(), static_cast<size_t>(kLayers));
    for (const MergeLayerStats& st : r.requantized) {
      EXPECT_EQ(st.matrices, 3 * kExperts);
      EXPECT_GT(st.rel_delta, 0.0);
      EXPECT_LE(st.rel_rms_error, st.rel_delta) << "layer " << st.layer;
    }
  }
  // The released expert keys are routed experts to the MXFP4 helpers too.
  DeepSeekV4Model fp32(v4_config("fp32"));
  fp32.init_weights(3);
  std::map<std::string, std::vector<float>> before;
  for (Param* p : fp32.params()) before[p->name].assign(p->w(), p->w() + p->value.numel());
  round_experts_through_mxfp4(fp32.params());
  for (Param* p : fp32.params()) {
    const bool changed = std::memcmp(before[p->name].data(), p->w(), p->value.nbytes()) != 0;
    EXPECT_EQ(changed, p->name.find(".ffn.experts.") != std::string::npos) << p->name;
  }
}

TEST(V4LoraMerge, MoeMergeWritesTheMergedReleasedLayout) {
  // An MXFP4 base and its adapter through `moe merge`: --experts f32 decodes the experts exactly
  // and merges there (the unmerged model's logits to fp32 rounding), --experts mxfp4 re-quantizes
  // in place (what merge_lora_into_base does in memory, bitwise).
  const fs::path dir = scratch_dir("test_v4_lora_tmp");
  const ModelConfig cfg = v4_config("mxfp4");
  LoraModel m(cfg, {}, 3);
  save_model(dir / "base", cfg, m.model.params());
  save_peft_adapter(dir / "adapter", m.model, {}, (dir / "base").string());
  const Tensor tokens = random_tokens(kShape.tokens(), 128, 21);
  const Tensor unmerged = m.model.logits(tokens, kShape);
  auto merged_logits = [&](const fs::path& out) {
    DeepSeekV4Model merged(read_hf_config(out));
    load_weights(out, merged.params());
    return merged.logits(tokens, kShape);
  };
  const std::string moe = std::string(MOE_BINARY_DIR) + "/moe --threads 2 merge --model " +
                          (dir / "base").string() + " --adapter " + (dir / "adapter").string();
  CommandResult r = run_command(moe + " --out " + (dir / "f32").string() + " --experts f32 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_FALSE(read_hf_config(dir / "f32").mxfp4_experts());
  const double err = rel_error(merged_logits(dir / "f32").f32(), unmerged.f32(), unmerged.numel());
  std::printf("moe merge --experts f32 vs unmerged: %.2e\n", err);
  EXPECT_LT(err, 1e-5);
  r = run_command(moe + " --out " + (dir / "q").string() + " --experts mxfp4 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(read_hf_config(dir / "q").mxfp4_experts());
  merge_lora_into_base(m.model, {});
  EXPECT_TRUE(same_bits(merged_logits(dir / "q"), m.model.logits(tokens, kShape)));
}

// ---------------------------------------------------------------- moe finetune

TEST(V4LoraFinetune, TrainerTunesMxfp4ExpertsSavesPeftAndReloadsBitwise) {
  const fs::path dir = scratch_dir("test_v4_lora_tmp");
  ModelConfig cfg = v4_config("fp32");
  cfg.vocab_size = 320;  // room for the byte tokenizer's 257 ids
  {
    DeepSeekV4Model base(cfg);
    base.init_weights(11);
    save_model(dir / "base", cfg, base.params(), DType::F32);
  }
  std::string jsonl;
  for (int i = 0; i < 48; ++i)
    jsonl += fmt::format("{{\"prompt\": \"count after {}:\", \"completion\": \" {}\"}}\n", i % 6,
                         i % 6 + 1);
  write_text(dir / "pc.jsonl", jsonl);
  TrainRequest req;
  req.config = parse_train_config(
      "", "test",
      {{"model.weights", (dir / "base").string()}, {"model.experts", "mxfp4"},
       {"data.path", (dir / "pc.jsonl").string()}, {"data.seq_len", "24"},
       {"data.batch_size", "4"}, {"optimizer.lr", "1e-2"}, {"schedule.steps", "8"},
       {"schedule.warmup_steps", "1"}, {"schedule.decay", "constant"},
       {"checkpoint.every", "3"}, {"checkpoint.keep_last", "5"}, {"logging.progress", "none"},
       {"lora.r", "4"}, {"lora.expert_r", "2"}, {"lora.dropout", "0.1"}, {"run.seed", "5"},
       {"run.out_dir", (dir / "ft").string()}},
      ConfigPurpose::Finetune);
  const Tensor tokens = random_tokens(kShape.tokens(), 256, 3);
  Tensor at_step6;
  req.hooks.before_step = [&](int64_t step, CausalLM& model) {
    if (step == 6) at_step6 = model.logits(tokens, kShape);  // the weights of checkpoint step_6
  };
  const TrainResult r = train(req);
  ASSERT_EQ(r.steps_done, 8);
  ASSERT_TRUE(at_step6.defined());
  const double first = (r.losses[0] + r.losses[1]) / 2, last = (r.losses[6] + r.losses[7]) / 2;
  std::printf("losses: first two %.4f, last two %.4f\n", first, last);
  EXPECT_LT(last, first - 0.1);

  const fs::path ckpt = dir / "ft" / "checkpoints" / "step_6";
  const json cfg_json = json::parse(read_file(ckpt / kAdapterConfigFile));
  EXPECT_EQ(cfg_json["target_parameters"].size(), static_cast<size_t>(kLayers * 2));
  EXPECT_EQ(cfg_json["rank_pattern"][kFusedGateUpPattern], 4);
  const SafetensorsReader st(ckpt / kAdapterWeightsFile);
  EXPECT_TRUE(st.contains("base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight"));
  EXPECT_TRUE(st.contains("base_model.model.model.layers.2.self_attn.o_b_proj.lora_B.weight"));
  // The checkpoint records the MXFP4 experts the adapter was trained against.
  const ModelConfig trained = config_for_adapter(cfg, ckpt, nullptr);
  EXPECT_TRUE(trained.mxfp4_experts());
  DeepSeekV4Model model(trained);
  load_weights(dir / "base", model.params());
  apply_peft_adapter(ckpt, model);
  EXPECT_TRUE(same_bits(model.logits(tokens, kShape), at_step6));
}
