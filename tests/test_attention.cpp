// MLA attention and RoPE/YaRN against plain double-precision references written from the
// formulas (SPEC §2), finite differences for every gradient, thread-count bit-equality and
// activation-memory accounting.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "model/attention.h"
#include "model/rope.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

struct Case {
  int64_t q_lora = 0, nope = 4, rope = 4, v = 6, heads = 3, kv_lora = 8;
  bool yarn = false;
  int64_t batch = 1, seq = 5;
};

constexpr int64_t kHidden = 16;

ModelConfig make_config(const Case& c) {
  ModelConfig cfg;
  cfg.hidden_size = kHidden;
  cfg.num_attention_heads = c.heads;
  cfg.q_lora_rank = c.q_lora;
  cfg.kv_lora_rank = c.kv_lora;
  cfg.qk_nope_head_dim = c.nope;
  cfg.qk_rope_head_dim = c.rope;
  cfg.v_head_dim = c.v;
  cfg.rms_norm_eps = 1e-6;
  if (c.yarn) {
    // A small base and original context so that the ramp blends several dims and the test
    // sequences run past original_max_position_embeddings.
    cfg.rope_theta = 100.0;
    cfg.rope_scaling.type = "yarn";
    cfg.rope_scaling.factor = 4.0;
    cfg.rope_scaling.original_max_position_embeddings = 64;
    cfg.rope_scaling.beta_fast = 32.0;
    cfg.rope_scaling.beta_slow = 1.0;
    cfg.rope_scaling.mscale = 1.0;
    cfg.rope_scaling.mscale_all_dim = 0.8;
  }
  return cfg;
}

// ---------------------------------------------------------------- independent RoPE formulas

double ref_yarn_mscale(double f, double a) { return f <= 1 ? 1.0 : 0.1 * a * std::log(f) + 1.0; }

struct RefRope {
  std::vector<double> inv_freq;
  double m = 1.0;
};

RefRope ref_rope(const ModelConfig& cfg) {
  RefRope r;
  const int64_t d = cfg.qk_rope_head_dim;
  for (int64_t i = 0; i < d / 2; ++i)
    r.inv_freq.push_back(std::pow(cfg.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(d)));
  const RopeScaling& s = cfg.rope_scaling;
  if (s.is_yarn()) {
    const double two_pi = 2 * std::numbers::pi, ln_base = std::log(cfg.rope_theta);
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    double low = std::floor(static_cast<double>(d) * std::log(orig / (s.beta_fast * two_pi)) / (2 * ln_base));
    double high = std::ceil(static_cast<double>(d) * std::log(orig / (s.beta_slow * two_pi)) / (2 * ln_base));
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(d - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < d / 2; ++i) {
      double ramp = (static_cast<double>(i) - low) / (high - low);
      ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
      const double mask = 1 - ramp;
      const double f = r.inv_freq[static_cast<size_t>(i)];
      r.inv_freq[static_cast<size_t>(i)] = (f / s.factor) * (1 - mask) + f * mask;
    }
    r.m = ref_yarn_mscale(s.factor, s.mscale) / ref_yarn_mscale(s.factor, s.mscale_all_dim);
  }
  return r;
}

double ref_scale(const ModelConfig& cfg) {
  double s = std::pow(static_cast<double>(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), -0.5);
  if (cfg.rope_scaling.is_yarn() && cfg.rope_scaling.mscale_all_dim != 0) {
    const double m = ref_yarn_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

void ref_rotate(const RefRope& r, double* v, int64_t pos) {
  for (size_t i = 0; i < r.inv_freq.size(); ++i) {
    const double a = static_cast<double>(pos) * r.inv_freq[i];
    const double c = std::cos(a) * r.m, s = std::sin(a) * r.m;
    const double x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = x0 * c - x1 * s;
    v[2 * i + 1] = x0 * s + x1 * c;
  }
}

// ---------------------------------------------------------------- reference MLA forward

std::vector<double> matvec(const float* W, const double* x, int64_t in, int64_t out) {
  std::vector<double> y(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    double s = 0;
    for (int64_t i = 0; i < in; ++i) s += static_cast<double>(W[o * in + i]) * x[i];
    y[static_cast<size_t>(o)] = s;
  }
  return y;
}

std::vector<double> rmsnorm(const double* x, const float* w, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  std::vector<double> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = x[i] * r * w[i];
  return y;
}

std::vector<double> reference_forward(const MLAttention& a, const ModelConfig& cfg, const float* x,
                                      int64_t B, int64_t S) {
  const int64_t T = B * S, H = cfg.num_attention_heads, D = cfg.hidden_size;
  const int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim;
  const int64_t qk = dn + dr, kvr = cfg.kv_lora_rank;
  const RefRope rr = ref_rope(cfg);
  const double scale = ref_scale(cfg);
  std::vector<std::vector<double>> q(T), kv(T), kpe(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = t % S;
    std::vector<double> xt(x + t * D, x + (t + 1) * D);
    if (cfg.q_lora_rank > 0) {
      auto qa = matvec(a.q_a_proj.weight.w(), xt.data(), D, cfg.q_lora_rank);
      auto qn = rmsnorm(qa.data(), a.q_a_layernorm.weight.w(), cfg.q_lora_rank, cfg.rms_norm_eps);
      q[t] = matvec(a.q_b_proj.weight.w(), qn.data(), cfg.q_lora_rank, H * qk);
    } else {
      q[t] = matvec(a.q_proj.weight.w(), xt.data(), D, H * qk);
    }
    for (int64_t h = 0; h < H; ++h) ref_rotate(rr, q[t].data() + h * qk + dn, pos);
    auto kva = matvec(a.kv_a_proj.w(), xt.data(), D, kvr + dr);
    auto ckv = rmsnorm(kva.data(), a.kv_a_layernorm.weight.w(), kvr, cfg.rms_norm_eps);
    kv[t] = matvec(a.kv_b_proj.weight.w(), ckv.data(), kvr, H * (dn + dv));
    kpe[t].assign(kva.begin() + kvr, kva.end());
    ref_rotate(rr, kpe[t].data(), pos);
  }
  std::vector<double> attn(static_cast<size_t>(T * H * dv), 0.0);
  std::vector<double> p(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s) {
        const double* qs = q[b * S + s].data() + h * qk;
        double mx = -1e300;
        for (int64_t t = 0; t <= s; ++t) {
          const double* kn = kv[b * S + t].data() + h * (dn + dv);
          const double* kp = kpe[b * S + t].data();
          double dot = 0;
          for (int64_t i = 0; i < dn; ++i) dot += qs[i] * kn[i];
          for (int64_t i = 0; i < dr; ++i) dot += qs[dn + i] * kp[i];
          p[t] = dot * scale;
          mx = std::max(mx, p[t]);
        }
        double sum = 0;
        for (int64_t t = 0; t <= s; ++t) sum += (p[t] = std::exp(p[t] - mx));
        double* o = attn.data() + (b * S + s) * H * dv + h * dv;
        for (int64_t t = 0; t <= s; ++t) {
          const double* v = kv[b * S + t].data() + h * (dn + dv) + dn;
          for (int64_t j = 0; j < dv; ++j) o[j] += p[t] / sum * v[j];
        }
      }
  std::vector<double> y(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t) {
    auto yt = matvec(a.o_proj.weight.w(), attn.data() + t * H * dv, H * dv, D);
    std::copy(yt.begin(), yt.end(), y.begin() + t * D);
  }
  return y;
}

}  // namespace

namespace {

struct Setup {
  ModelConfig cfg;
  MLAttention attn;
  BatchShape shape;
  Tensor x;
  ParamList params;
};

// Weights ~ N(0, 1.5/sqrt(in)) so scores are O(1) and the softmax is neither flat nor one-hot;
// norm weights around 1 so their gradients are exercised.
std::unique_ptr<Setup> make_setup(const Case& c, uint64_t seed) {
  auto s = std::make_unique<Setup>();
  s->cfg = make_config(c);
  s->attn.init("model.layers.3.self_attn.", s->cfg);
  s->attn.collect(s->params);
  s->shape = BatchShape{c.batch, c.seq};
  Rng rng(seed);
  for (Param* p : s->params) {
    float* w = p->w();
    if (p->value.ndim() == 1) {
      for (int64_t i = 0; i < p->value.numel(); ++i) w[i] = 1.0f + 0.2f * rng.normal();
    } else {
      fill_random(p->value, rng, 1.5f / std::sqrt(static_cast<float>(p->value.dim(1))));
    }
  }
  s->x = random_tensor({s->shape.tokens(), kHidden}, rng);
  return s;
}

std::string describe(const Case& c) {
  return fmt::format("q_lora={} nope={} rope={} v={} heads={} kv_lora={} yarn={} batch={} seq={}",
                     c.q_lora, c.nope, c.rope, c.v, c.heads, c.kv_lora, c.yarn, c.batch, c.seq);
}

// YaRN configs use original_max_position_embeddings = 64, so seq 70 and 80 run past it; seq 70,
// 80 and 130 span several 64-row attention blocks.
const std::vector<Case>& forward_cases() {
  static const std::vector<Case> cases = {
      {.q_lora = 0, .nope = 4, .rope = 4, .v = 6, .heads = 3, .kv_lora = 8, .yarn = false, .batch = 3, .seq = 5},
      {.q_lora = 8, .nope = 0, .rope = 8, .v = 4, .heads = 1, .kv_lora = 6, .yarn = true, .batch = 1, .seq = 80},
      {.q_lora = 6, .nope = 6, .rope = 2, .v = 6, .heads = 3, .kv_lora = 8, .yarn = true, .batch = 3, .seq = 1},
      {.q_lora = 0, .nope = 3, .rope = 8, .v = 5, .heads = 2, .kv_lora = 4, .yarn = false, .batch = 2, .seq = 130},
      {.q_lora = 8, .nope = 5, .rope = 4, .v = 7, .heads = 3, .kv_lora = 8, .yarn = true, .batch = 2, .seq = 70},
      {.q_lora = 0, .nope = 2, .rope = 2, .v = 3, .heads = 1, .kv_lora = 4, .yarn = false, .batch = 1, .seq = 1},
  };
  return cases;
}

double dot_ref(const std::vector<double>& y, const float* r) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * static_cast<double>(r[i]);
  return s;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

}  // namespace

// ---------------------------------------------------------------- RoPE / YaRN tables

TEST(Rope, PlainTableMatchesFormula) {
  Case c;
  c.rope = 8;
  ModelConfig cfg = make_config(c);
  cfg.rope_theta = 10000.0;
  RopeTable t(cfg, 50);
  EXPECT_EQ(t.mscale(), 1.0);
  ASSERT_EQ(t.inv_freq().size(), 4u);
  for (int64_t i = 0; i < 4; ++i) {
    const double f = std::pow(10000.0, -2.0 * static_cast<double>(i) / 8.0);
    EXPECT_NEAR(t.inv_freq()[i], f, 1e-15 * f);
    for (int64_t pos : {0, 1, 17, 49}) {
      EXPECT_NEAR(t.cos_row(pos)[i], std::cos(static_cast<double>(pos) * f), 1e-7);
      EXPECT_NEAR(t.sin_row(pos)[i], std::sin(static_cast<double>(pos) * f), 1e-7);
    }
  }
  EXPECT_NEAR(mla_softmax_scale(cfg), 1.0 / std::sqrt(12.0), 1e-15);
}

TEST(Rope, YarnTableMatchesFormula) {
  // Hand-derived for d = 8, base 100, original context 64, beta 32/1: the correction range is
  // low = floor(8 ln(64/(64π)) / (2 ln 100)) -> 0 and high = ceil(8 ln(64/2π) / (2 ln 100)) = 3,
  // so ramp = i/3 and inv_freq[i] = f_i (1 - ramp) + f_i / factor * ramp.
  Case c;
  c.rope = 8;
  c.yarn = true;
  const ModelConfig cfg = make_config(c);
  RopeTable t(cfg, 200);
  const double factor = 4.0;
  for (int64_t i = 0; i < 4; ++i) {
    const double f = std::pow(100.0, -static_cast<double>(i) / 4.0), ramp = static_cast<double>(i) / 3.0;
    EXPECT_NEAR(t.inv_freq()[i], f * (1 - ramp) + f / factor * ramp, 1e-15) << i;
  }
  const double m = (0.1 * std::log(4.0) + 1) / (0.1 * 0.8 * std::log(4.0) + 1);
  EXPECT_NEAR(t.mscale(), m, 1e-15);
  const RefRope rr = ref_rope(cfg);
  for (int64_t pos = 0; pos < 200; ++pos)
    for (int64_t i = 0; i < 4; ++i) {
      const double a = static_cast<double>(pos) * rr.inv_freq[i];
      EXPECT_NEAR(t.cos_row(pos)[i], std::cos(a) * rr.m, 1e-7);
      EXPECT_NEAR(t.sin_row(pos)[i], std::sin(a) * rr.m, 1e-7);
    }
  const double sm = 0.1 * 0.8 * std::log(4.0) + 1;
  EXPECT_NEAR(mla_softmax_scale(cfg), sm * sm / std::sqrt(12.0), 1e-15);
}

TEST(Rope, DeepSeekV3AndDegenerateRamp) {
  // The 671B settings: m = 1 (mscale == mscale_all_dim) while the softmax scale gains mscale².
  ModelConfig v3;
  v3.qk_nope_head_dim = 128;
  v3.qk_rope_head_dim = 64;
  v3.rope_theta = 10000.0;
  v3.rope_scaling = RopeScaling{.type = "yarn", .factor = 40, .original_max_position_embeddings = 4096,
                                .beta_fast = 32, .beta_slow = 1, .mscale = 1, .mscale_all_dim = 1};
  RopeTable t(v3, 8);
  const RefRope rr = ref_rope(v3);
  for (size_t i = 0; i < rr.inv_freq.size(); ++i)
    EXPECT_NEAR(t.inv_freq()[i], rr.inv_freq[i], 1e-15 * rr.inv_freq[i]) << i;
  EXPECT_EQ(t.mscale(), 1.0);
  const double ms = 0.1 * std::log(40.0) + 1;
  EXPECT_NEAR(mla_softmax_scale(v3), ms * ms / std::sqrt(192.0), 1e-15);
  // low == high == 0 takes the +0.001 branch: dim 0 keeps its frequency.
  ModelConfig tiny = v3;
  tiny.qk_rope_head_dim = 2;
  tiny.rope_scaling.original_max_position_embeddings = 4;
  RopeTable t2(tiny, 4);
  EXPECT_EQ(t2.inv_freq()[0], 1.0);
  EXPECT_EQ(t2.inv_freq()[0], ref_rope(tiny).inv_freq[0]);
}

TEST(Rope, GrowthKeepsValuesAndRotationTransposes) {
  Case c;
  c.rope = 8;
  c.yarn = true;
  const ModelConfig cfg = make_config(c);
  RopeTable grown(cfg, 3), fresh(cfg, 300);
  grown.ensure(10);
  grown.ensure(300);
  ASSERT_GE(grown.max_len(), 300);
  EXPECT_EQ(std::memcmp(grown.cos_row(0), fresh.cos_row(0), 300 * 4 * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(grown.sin_row(0), fresh.sin_row(0), 300 * 4 * sizeof(float)), 0);

  // Decode-style explicit positions on strided heads; <R x, g> == <x, Rᵀ g>.
  Rng rng(5);
  const int64_t rows = 4, heads = 3, stride = 40, hstride = 12;
  Tensor x = random_tensor({rows, stride}, rng), g = random_tensor({rows, stride}, rng);
  Tensor rx = x.clone(MemCategory::Scratch), rg = g.clone(MemCategory::Scratch);
  const int32_t pos[rows] = {7, 250, 0, 99};
  rope_forward(fresh, rx.f32() + 2, rows, heads, stride, hstride, pos);
  rope_backward(fresh, rg.f32() + 2, rows, heads, stride, hstride, pos);
  const RefRope rr = ref_rope(cfg);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = r * stride + 2 + h * hstride;
      std::vector<double> v(x.f32() + off, x.f32() + off + 8);
      ref_rotate(rr, v.data(), pos[r]);
      EXPECT_LT(rel_error(rx.f32() + off, v.data(), 8), 1e-6);
    }
  EXPECT_NEAR(dot(rx.f32(), g.f32(), x.numel()), dot(x.f32(), rg.f32(), x.numel()), 1e-4);
  const int32_t bad[1] = {300};
  EXPECT_THROW(rope_forward(fresh, rx.f32(), 1, 1, 8, 0, bad), Error);
}

// ---------------------------------------------------------------- MLA forward

TEST(MLAttention, ParameterNamesAndShapes) {
  Case c{.q_lora = 8, .nope = 4, .rope = 4, .v = 6, .heads = 3, .kv_lora = 8};
  auto s = make_setup(c, 1);
  std::vector<std::string> names;
  for (Param* p : s->params) names.push_back(p->name);
  const std::string pre = "model.layers.3.self_attn.";
  EXPECT_EQ(names, (std::vector<std::string>{pre + "q_a_proj.weight", pre + "q_a_layernorm.weight",
                                             pre + "q_b_proj.weight", pre + "kv_a_proj_with_mqa.weight",
                                             pre + "kv_a_layernorm.weight", pre + "kv_b_proj.weight",
                                             pre + "o_proj.weight"}));
  EXPECT_EQ(s->attn.q_b_proj.weight.value.shape(), (Shape{3 * 8, 8}));
  EXPECT_EQ(s->attn.kv_a_proj.value.shape(), (Shape{8 + 4, kHidden}));
  EXPECT_EQ(s->attn.kv_b_proj.weight.value.shape(), (Shape{3 * (4 + 6), 8}));
  EXPECT_EQ(s->attn.o_proj.weight.value.shape(), (Shape{kHidden, 3 * 6}));
  auto s0 = make_setup(Case{}, 1);
  EXPECT_EQ(s0->params.front()->name, pre + "q_proj.weight");
  EXPECT_EQ(s0->params.size(), 5u);
}

TEST(MLAttention, ForwardMatchesDoubleReference) {
  uint64_t seed = 10;
  for (const Case& c : forward_cases()) {
    auto s = make_setup(c, seed++);
    Tensor y = s->attn.forward(s->x, s->shape, Pass::Inference);
    EXPECT_FALSE(s->attn.has_saved());
    const auto ref = reference_forward(s->attn, s->cfg, s->x.f32(), c.batch, c.seq);
    EXPECT_LT(rel_error(y.f32(), ref.data(), y.numel()), 1e-5) << describe(c);
    // Training writes P to its saved buffer instead of scratch: the same bits either way.
    Tensor y_train = s->attn.forward(s->x, s->shape, Pass::Train);
    EXPECT_TRUE(same_bits(y, y_train)) << describe(c);
    EXPECT_TRUE(s->attn.has_saved());
  }
}

TEST(MLAttention, SequencesAreIndependent) {
  // Three copies of one sequence in a batch give three copies of its single-batch output.
  Case c{.q_lora = 0, .nope = 4, .rope = 4, .v = 6, .heads = 3, .kv_lora = 8, .yarn = true, .batch = 1, .seq = 9};
  auto s = make_setup(c, 3);
  Tensor y1 = s->attn.forward(s->x, s->shape, Pass::Eval);
  Tensor x3 = Tensor::empty({27, kHidden}, DType::F32, MemCategory::Scratch);
  for (int b = 0; b < 3; ++b) std::memcpy(x3.f32() + b * 9 * kHidden, s->x.f32(), 9 * kHidden * sizeof(float));
  Tensor y3 = s->attn.forward(x3, BatchShape{3, 9}, Pass::Eval);
  // Bitwise: a row's matmul results never depend on how many rows share the call.
  for (int b = 0; b < 3; ++b)
    EXPECT_EQ(std::memcmp(y3.f32() + b * 9 * kHidden, y1.f32(), 9 * kHidden * sizeof(float)), 0) << b;
}

// ---------------------------------------------------------------- MLA backward

namespace {

struct GradCheck {
  double worst = 0;
  std::string where;
};

// Every parameter gradient and dx of one config against central differences of the double
// reference forward with loss = dot(y, r). Returns the worst relative error found.
GradCheck check_gradients(const Case& c, uint64_t seed, int64_t checks_per_tensor) {
  auto s = make_setup(c, seed);
  for (Param* p : s->params) p->allocate_grad();
  Rng rng(seed + 100);
  Tensor r = random_tensor({s->shape.tokens(), kHidden}, rng);
  Tensor y = s->attn.forward(s->x, s->shape, Pass::Train);
  Tensor dx = s->attn.backward(r);
  auto loss = [&] { return dot_ref(reference_forward(s->attn, s->cfg, s->x.f32(), c.batch, c.seq), r.f32()); };
  GradCheck out;
  // A power-of-two step keeps x ± eps close to exact in fp32; the double forward makes the
  // differences accurate to ~eps² (about 1e-5 relative).
  const float eps = 1.0f / 2048;
  auto check = [&](const std::string& name, float* v, const float* g, int64_t n) {
    const double floor = 1e-3 * std::max(max_abs(g, n), 1e-6);
    const double e = finite_difference_check(loss, v, g, n, eps, checks_per_tensor, floor);
    if (e > out.worst) out = {e, name};
  };
  for (Param* p : s->params) check(p->name, p->w(), p->g(), p->value.numel());
  check("dx", s->x.f32(), dx.f32(), dx.numel());
  return out;
}

const std::vector<Case>& backward_cases() {
  static const std::vector<Case> cases = {
      {.q_lora = 0, .nope = 4, .rope = 4, .v = 6, .heads = 3, .kv_lora = 8, .yarn = false, .batch = 3, .seq = 5},
      {.q_lora = 8, .nope = 0, .rope = 8, .v = 4, .heads = 1, .kv_lora = 6, .yarn = true, .batch = 1, .seq = 80},
      {.q_lora = 6, .nope = 6, .rope = 2, .v = 6, .heads = 3, .kv_lora = 8, .yarn = true, .batch = 3, .seq = 1},
      {.q_lora = 8, .nope = 5, .rope = 4, .v = 7, .heads = 2, .kv_lora = 8, .yarn = true, .batch = 2, .seq = 70},
  };
  return cases;
}

}  // namespace

TEST(MLAttention, BackwardMatchesFiniteDifferences) {
  uint64_t seed = 40;
  for (const Case& c : backward_cases()) {
    const GradCheck g = check_gradients(c, seed++, 24);
    EXPECT_LT(g.worst, 2e-3) << describe(c) << " worst at " << g.where;
  }
}

TEST(MLAttention, BitwiseSameForOneAndTwoThreads) {
  const int saved_threads = num_threads();
  Case c{.q_lora = 8, .nope = 3, .rope = 8, .v = 5, .heads = 3, .kv_lora = 8, .yarn = true, .batch = 2, .seq = 150};
  std::vector<std::vector<Tensor>> runs;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    auto s = make_setup(c, 7);
    for (Param* p : s->params) p->allocate_grad();
    Rng rng(8);
    Tensor r = random_tensor({s->shape.tokens(), kHidden}, rng);
    Tensor y = s->attn.forward(s->x, s->shape, Pass::Train);
    Tensor dx = s->attn.backward(r);
    std::vector<Tensor>& outs = runs.emplace_back();
    outs.reserve(s->params.size() + 2);
    outs.push_back(y);
    outs.push_back(dx);
    for (Param* p : s->params) outs.push_back(p->grad);
  }
  set_num_threads(saved_threads);
  ASSERT_EQ(runs[0].size(), runs[1].size());
  for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_TRUE(same_bits(runs[0][i], runs[1][i])) << i;
}

TEST(MLAttention, ActivationsReturnToBaseline) {
  Case c{.q_lora = 8, .nope = 4, .rope = 4, .v = 6, .heads = 3, .kv_lora = 8, .yarn = true, .batch = 2, .seq = 70};
  auto s = make_setup(c, 9);
  for (Param* p : s->params) p->allocate_grad();
  Rng rng(10);
  Tensor r = random_tensor({s->shape.tokens(), kHidden}, rng);
  auto& tracker = MemoryTracker::instance();
  s->attn.forward(s->x, s->shape, Pass::Eval);  // grows the RoPE table (Weights) once
  const int64_t before = tracker.current(MemCategory::Activations);
  for (Pass pass : {Pass::Eval, Pass::Inference}) {
    {
      Tensor y = s->attn.forward(s->x, s->shape, pass);
      EXPECT_FALSE(s->attn.has_saved());
    }
    EXPECT_EQ(tracker.current(MemCategory::Activations), before);
  }
  {
    Tensor y = s->attn.forward(s->x, s->shape, Pass::Train);
    EXPECT_TRUE(s->attn.has_saved());
    y.reset();
    // Exactly what backward needs, no [B, H, S, S] probabilities and no kv: q, k_pe, the
    // per-row softmax stats, c_kv (+ rstd) for kv_a_layernorm, a (+ rstd) and its norm for the
    // q LoRA path, and o_proj's input. x belongs to the caller.
    const int64_t T = s->shape.tokens(), H = c.heads, B = c.batch, S = c.seq;
    const int64_t saved_floats = T * (H * (c.nope + c.rope) + c.rope + c.kv_lora + 1 +
                                      2 * c.q_lora + 1 + H * c.v) +
                                 B * H * S * 2;
    EXPECT_EQ(tracker.current(MemCategory::Activations) - before,
              saved_floats * static_cast<int64_t>(sizeof(float)));
    Tensor dx = s->attn.backward(r);
    EXPECT_FALSE(s->attn.has_saved());
    for (Param* p : s->params) EXPECT_FALSE(p->name.empty());
  }
  EXPECT_EQ(tracker.current(MemCategory::Activations), before);
  EXPECT_FALSE(s->attn.q_a_proj.has_saved() || s->attn.q_b_proj.has_saved() ||
               s->attn.q_a_layernorm.has_saved() || s->attn.kv_a_layernorm.has_saved() ||
               s->attn.kv_b_proj.has_saved() || s->attn.o_proj.has_saved());
}

TEST(MLAttention, EmptyBatchIsOrdinary) {
  auto s = make_setup(Case{}, 12);
  Tensor x = Tensor::zeros({0, kHidden}, DType::F32, MemCategory::Scratch);
  Tensor y = s->attn.forward(x, BatchShape{0, 5}, Pass::Train);
  EXPECT_EQ(y.shape(), (Shape{0, kHidden}));
  EXPECT_EQ(s->attn.backward(y).shape(), (Shape{0, kHidden}));
  EXPECT_FALSE(s->attn.has_saved());
}

TEST(MLAttention, RejectsMisuse) {
  auto s = make_setup(Case{}, 11);
  Tensor dy = Tensor::zeros({5, kHidden}, DType::F32, MemCategory::Scratch);
  EXPECT_THROW(s->attn.backward(dy), Error);
  EXPECT_THROW(s->attn.forward(s->x, BatchShape{2, 5}, Pass::Eval), Error);
}
