// MXFP4-resident frozen experts (issue 5): the packed store against decode-then-fp32 GEMMs, the
// model with packed experts against the fp32 model it quantizes, frozen training, passthrough
// load/save, the missing-scale error, `moe quantize`, and the memory accounting that proves no
// full-precision expert ever exists. Int8 expert activations (issue 17, inference only): every
// routed expert output, and a model's logits, within bounds derived from the int8 kernel's
// documented error bound; every MoE layer of a V3 and a V4 model (hash-routed layers included)
// switched; the same bits at any thread count and SIMD target; never in a training forward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/model_spec.h"
#include "io/quantize_model.h"
#include "io/safetensors.h"
#include "kernels/activations.h"
#include "kernels/mxfp4.h"
#include "kernels/mxfp4_gemm_q8.h"
#include "model/model.h"
#include "model/v4/v4_model.h"
#include "moe/mxfp4_expert_weights.h"
#include "test_util.h"
#include "train/adamw.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;

namespace {

// The debug preset with wider experts (hidden 256 > vocab 264·dim 64 / dim... see below) and
// MXFP4 experts. One fp32 expert (gate + up + down, 3·256·64·4 = 192 KiB) is larger than any
// other single allocation of this model at batch 2 x 16, so "no allocation the size of an fp32
// expert" is checkable from the tracker's largest-allocation marks.
ModelConfig packed_config() {
  ModelConfig c = resolve_model_config("debug");
  c.moe_intermediate_size = 256;
  c.expert_format = "mxfp4";
  c.validate("test");
  return c;
}

ModelConfig fp32_of(ModelConfig c) {
  c.expert_format = "fp32";
  return c;
}

int64_t fp32_expert_bytes(const ModelConfig& c) {
  return 3 * c.hidden_size * c.moe_intermediate_size * 4;
}

std::map<std::string, Param*> by_name(const DeepSeekModel& m) {
  std::map<std::string, Param*> out;
  for (Param* p : m.params()) out[p->name] = p;
  return out;
}

// Rows of every dequantized packed expert matrix, as the fp32 model's experts would hold them.
void copy_dequantized_experts(const DeepSeekModel& packed, DeepSeekModel& dense) {
  auto dst = by_name(dense);
  const ParamList& ps = packed.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i]->format != ParamFormat::Mxfp4Data) continue;
    const Param& data = *ps[i];
    const Param& scales = *ps[i + 1];
    Param* w = dst.at(data.name);
    const int64_t rows = data.value.dim(0), cols = 2 * data.value.dim(1);
    for (int64_t r = 0; r < rows; ++r)
      mxfp4::dequantize_row(data.value.u8() + r * cols / 2, scales.value.u8() + r * cols / 32, cols,
                            w->w() + r * cols);
  }
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

}  // namespace

TEST(Mxfp4Experts, StoreMatchesDecodeThenFp32Gemm) {
  const int64_t D = 96, H = 64, E = 5;
  Mxfp4ExpertWeights packed;
  packed.init("t.", {0, E}, D, H);
  Rng rng(3);
  ParamList ps;
  packed.collect(ps);
  for (size_t i = 0; i < ps.size(); i += 2)
    quantize_rows_into(*ps[i], *ps[i + 1], [&](int64_t, float* row) {
      for (int64_t j = 0; j < 2 * ps[i]->value.dim(1); ++j) row[j] = 0.1f * rng.normal();
    });
  DenseExpertWeights dense;
  dense.init("t.", {0, E}, D, H);
  for (int64_t e = 0; e < E; ++e) {
    const Mxfp4Matrix mats[3] = {packed.gate(e), packed.up(e), packed.down(e)};
    Param* dst[3] = {&dense.gate(e), &dense.up(e), &dense.down(e)};
    for (int m = 0; m < 3; ++m)
      for (int64_t r = 0; r < mats[m].rows; ++r)
        mxfp4::dequantize_row(mats[m].packed + r * mats[m].packed_stride,
                              mats[m].scales + r * mats[m].scale_stride, mats[m].cols,
                              dst[m]->w() + r * mats[m].cols);
  }
  // Zero-token experts (0 and 3) and odd counts.
  ExpertSegments seg;
  seg.offsets = {0, 0, 7, 8, 8, 77};
  const int64_t R = seg.total_rows();
  Tensor x = random_tensor({R, D}, rng), dg = random_tensor({R, H}, rng),
         du = random_tensor({R, H}, rng), dy = random_tensor({R, D}, rng),
         h = random_tensor({R, H}, rng);
  auto check = [&](const char* what, const std::function<void(ExpertWeights&, float*)>& f,
                   int64_t n) {
    std::vector<float> a(static_cast<size_t>(n), NAN), b(static_cast<size_t>(n), NAN);
    f(packed, a.data());
    f(dense, b.data());
    EXPECT_LE(rel_error(a.data(), b.data(), n), 2e-6) << what;
  };
  check("gate", [&](ExpertWeights& w, float* out) {
    std::vector<float> u(static_cast<size_t>(R * H));
    w.gate_up_forward(seg, x.f32(), out, u.data());
  }, R * H);
  check("up", [&](ExpertWeights& w, float* out) {
    std::vector<float> g(static_cast<size_t>(R * H));
    w.gate_up_forward(seg, x.f32(), g.data(), out);
  }, R * H);
  check("down", [&](ExpertWeights& w, float* out) { w.down_forward(seg, h.f32(), out); }, R * D);
  check("dh", [&](ExpertWeights& w, float* out) { w.down_backward_input(seg, dy.f32(), out); },
        R * H);
  check("dx", [&](ExpertWeights& w, float* out) {
    w.gate_up_backward_input(seg, dg.f32(), du.f32(), out);
  }, R * D);
  EXPECT_FALSE(packed.trainable());
  EXPECT_EQ(packed.bytes(), E * 3 * D * H * 17 / 32);  // 4.25 bits per weight
}

TEST(Mxfp4Experts, PackedModelIsTheQuantizedFp32Model) {
  const ModelConfig cfg = packed_config();
  DeepSeekModel packed(cfg);
  packed.init_weights(5);
  DeepSeekModel dense(fp32_of(cfg));
  dense.init_weights(5);
  // Same random stream per name, quantized row by row: exactly quantize(fp32 init).
  auto fp = by_name(dense);
  const ParamList& ps = packed.params();
  int64_t pairs = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i]->format != ParamFormat::Mxfp4Data) continue;
    ++pairs;
    const Param* w = fp.at(ps[i]->name);
    const int64_t rows = w->value.dim(0), cols = w->value.dim(1);
    std::vector<uint8_t> p(static_cast<size_t>(rows * cols / 2)), s(static_cast<size_t>(rows * cols / 32));
    for (int64_t r = 0; r < rows; ++r)
      mxfp4::quantize_row(w->w() + r * cols, cols, p.data() + r * cols / 2, s.data() + r * cols / 32);
    EXPECT_EQ(std::memcmp(p.data(), ps[i]->value.u8(), p.size()), 0) << ps[i]->name;
    EXPECT_EQ(std::memcmp(s.data(), ps[i + 1]->value.u8(), s.size()), 0) << ps[i + 1]->name;
  }
  EXPECT_EQ(pairs, static_cast<int64_t>(packed.moe_layers().size()) * 3 * cfg.n_routed_experts);

  // Logits: the packed model against the fp32 model holding the decoded experts.
  copy_dequantized_experts(packed, dense);
  const Tensor tokens = random_tokens(2 * 16, cfg.vocab_size, 8);
  const Tensor a = packed.logits(tokens, {2, 16});
  const Tensor b = dense.logits(tokens, {2, 16});
  EXPECT_LE(rel_error(a.f32(), b.f32(), a.numel()), 1e-5);
}

TEST(Mxfp4Experts, FrozenTrainingTrainsEverythingElse) {
  const ModelConfig cfg = packed_config();
  DeepSeekModel model(cfg);
  model.init_weights(5);
  model.allocate_grads();
  const ParamList trainable = model.trainable_params();
  for (Param* p : model.params()) {
    if (p->packed()) {
      EXPECT_FALSE(p->trainable) << p->name;
      EXPECT_FALSE(p->grad.defined()) << p->name;
    }
  }
  std::vector<Tensor> before;
  for (Param* p : model.params()) before.push_back(p->value.clone(MemCategory::Scratch));
  AdamW opt(trainable, AdamWConfig{});
  const Tensor tokens = random_tokens(2 * 16, cfg.vocab_size, 8);
  const Tensor targets = random_tokens(2 * 16, cfg.vocab_size, 9);
  const MemSnapshot start = MemoryTracker::instance().snapshot();
  double first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    model.zero_grads();
    const LossResult r = model.forward(tokens, targets, {2, 16}, Pass::Train);
    model.backward();
    EXPECT_FALSE(model.has_saved());
    EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Routing), 0);
    opt.step(1e-2);
    (step == 0 ? first : last) = r.ce;
  }
  EXPECT_LT(last, first) << "everything but the experts trains";
  int64_t changed = 0, packed_params = 0;
  for (size_t i = 0; i < model.params().size(); ++i) {
    const Param* p = model.params()[i];
    const bool same = same_bytes(p->value, before[i]);
    if (p->packed()) {
      ++packed_params;
      EXPECT_TRUE(same) << p->name << " is frozen";
    } else if (p->trainable && !same) {
      ++changed;
    }
  }
  EXPECT_GT(packed_params, 0);
  EXPECT_EQ(changed, static_cast<int64_t>(trainable.size()));
  // No optimizer state and no gradient for the experts.
  EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Optimizer) -
                start.current[static_cast<int>(MemCategory::Optimizer)],
            0);
  int64_t trainable_bytes = 0;
  for (Param* p : trainable) trainable_bytes += p->value.nbytes();
  EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Optimizer), 2 * trainable_bytes);
}

TEST(Mxfp4Experts, NoFullPrecisionExpertEverExists) {
  MemoryTracker& mem = MemoryTracker::instance();
  const ModelConfig cfg = packed_config();
  const int64_t expert = fp32_expert_bytes(cfg);
  const fs::path dir = scratch_dir("test_mxfp4_tmp");
  {  // An fp32 model on disk to load from (its allocations happen before the watch starts).
    DeepSeekModel dense(fp32_of(cfg));
    dense.init_weights(5);
    save_model(dir / "fp32", fp32_of(cfg), dense.params());
  }
  // Weights that are not parameters (the RoPE table, built at the first forward), measured on
  // an fp32 twin.
  int64_t non_param_weights = 0;
  {
    const int64_t w0 = mem.current(MemCategory::Weights);
    DeepSeekModel twin(fp32_of(cfg));
    twin.logits(random_tokens(2 * 16, cfg.vocab_size, 8), {2, 16});
    non_param_weights = mem.current(MemCategory::Weights) - w0;
    for (Param* p : twin.params()) non_param_weights -= p->value.nbytes();
  }
  const int64_t weights_before = mem.current(MemCategory::Weights);
  mem.reset_peaks();
  {
    DeepSeekModel model(cfg);
    model.init_weights(6);
    load_weights(dir / "fp32", model.params());  // fp32 experts quantized row by row
    model.allocate_grads();
    AdamW opt(model.trainable_params(), AdamWConfig{});
    const Tensor tokens = random_tokens(2 * 16, cfg.vocab_size, 8);
    for (int step = 0; step < 3; ++step) {
      model.zero_grads();
      model.forward(tokens, tokens, {2, 16}, Pass::Train);
      model.backward();
      opt.step(1e-3);
      model.forward(tokens, tokens, {2, 16}, Pass::Eval);
      model.logits(tokens, {2, 16});
    }
    save_model(dir / "packed", cfg, model.params());

    const MemSnapshot s = mem.snapshot();
    // Weights: never more than the model holds now (nothing transient), and that is the fp32
    // non-expert tensors plus 4.25 bits per expert weight.
    int64_t packed_bytes = 0, largest_store = 0, fp32_bytes = 0, largest_fp32 = 0,
            expert_weights = 0;
    for (MoELayer* m : model.moe_layers()) {
      packed_bytes += m->mxfp4_experts()->bytes();
      largest_store = std::max(largest_store, m->mxfp4_experts()->bytes());
      expert_weights += cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size;
    }
    for (Param* p : model.params())
      if (!p->packed()) fp32_bytes += p->value.nbytes(), largest_fp32 = std::max(largest_fp32, p->value.nbytes());
    EXPECT_EQ(packed_bytes * 32, expert_weights * 17) << "4.25 bits per weight";
    EXPECT_EQ(s.current[static_cast<int>(MemCategory::Weights)] - weights_before,
              packed_bytes + fp32_bytes + non_param_weights);
    EXPECT_EQ(s.peak[static_cast<int>(MemCategory::Weights)],
              s.current[static_cast<int>(MemCategory::Weights)]);
    // No other allocation, of any kind, reached the size of one fp32 expert. Workspace is the
    // GEMM's per-thread packing panels, bounded by block sizes whatever the model; which thread
    // first runs the largest matmul varies, and at this toy size a panel can exceed an expert.
    for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c) {
      if (c == static_cast<int>(MemCategory::Weights) || c == static_cast<int>(MemCategory::Workspace))
        continue;
      EXPECT_LT(s.largest_allocation[static_cast<size_t>(c)], expert)
          << mem_category_name(static_cast<MemCategory>(c));
    }
    // The largest weight allocation is a layer's packed store (all its experts at 4.25 bits)
    // or a non-expert tensor, and those are smaller than one fp32 expert.
    EXPECT_EQ(s.largest_allocation[static_cast<int>(MemCategory::Weights)],
              std::max(largest_store, largest_fp32));
    EXPECT_LT(largest_fp32, expert);
  }
}

TEST(Mxfp4Experts, PassthroughLoadAndSaveAreByteExact) {
  const ModelConfig cfg = packed_config();
  const fs::path dir = scratch_dir("test_mxfp4_tmp");
  DeepSeekModel a(cfg);
  a.init_weights(5);
  save_model(dir / "a", cfg, a.params());
  // The files hold the DeepSeek-V4 form: I8 [out, in/2] + F8_E8M0 [out, in/32] per matrix.
  const SafetensorsReader r(dir / "a" / kSafetensorsSingleFile);
  const std::string key = "model.layers.1.mlp.experts.3.down_proj.";
  EXPECT_EQ(r.entry(key + "weight").dtype, "I8");
  EXPECT_EQ(r.entry(key + "weight").shape, (Shape{cfg.hidden_size, cfg.moe_intermediate_size / 2}));
  EXPECT_EQ(r.entry(key + "scale").dtype, "F8_E8M0");
  EXPECT_EQ(r.entry(key + "scale").shape, (Shape{cfg.hidden_size, cfg.moe_intermediate_size / 32}));
  EXPECT_TRUE(read_hf_config(dir / "a").mxfp4_experts()) << "config.json says so";

  DeepSeekModel b(resolve_model_config((dir / "a").string()));
  b.init_weights(99);
  load_weights(dir / "a", b.params());
  for (size_t i = 0; i < a.params().size(); ++i)
    EXPECT_TRUE(same_bytes(a.params()[i]->value, b.params()[i]->value)) << a.params()[i]->name;
  save_model(dir / "b", cfg, b.params());
  EXPECT_EQ(read_file(dir / "a" / kSafetensorsSingleFile), read_file(dir / "b" / kSafetensorsSingleFile));
}

TEST(Mxfp4Experts, APackedWeightWithoutItsScaleIsAnError) {
  const ModelConfig cfg = packed_config();
  const fs::path dir = scratch_dir("test_mxfp4_tmp");
  DeepSeekModel a(cfg);
  a.init_weights(5);
  const std::string missing = "model.layers.2.mlp.experts.6.up_proj.scale";
  std::vector<SafetensorsWriteItem> items;
  for (Param* p : a.params()) {
    if (p->name == missing) continue;
    items.push_back({p->name, p->value,
                     p->format == ParamFormat::Mxfp4Data     ? "I8"
                     : p->format == ParamFormat::Mxfp4Scales ? "F8_E8M0"
                                                             : ""});
  }
  fs::create_directories(dir / "m");
  write_safetensors_with_dtypes(dir / "m" / kSafetensorsSingleFile, items);
  write_hf_config(dir / "m", cfg);
  DeepSeekModel b(cfg);
  const std::string e = error_of([&] { load_weights(dir / "m", b.params()); });
  EXPECT_NE(e.find("model.layers.2.mlp.experts.6.up_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("has no scale tensor '" + missing + "'"), std::string::npos) << e;

  // A missing packed weight is reported as missing (its scales are there).
  items.clear();
  for (Param* p : a.params())
    if (p->name != "model.layers.1.mlp.experts.2.gate_proj.weight")
      items.push_back({p->name, p->value,
                       p->format == ParamFormat::Mxfp4Data     ? "I8"
                       : p->format == ParamFormat::Mxfp4Scales ? "F8_E8M0"
                                                               : ""});
  write_safetensors_with_dtypes(dir / "m" / kSafetensorsSingleFile, items);
  const std::string e3 = error_of([&] { load_weights(dir / "m", b.params()); });
  EXPECT_NE(e3.find("have no tensor 'model.layers.1.mlp.experts.2.gate_proj.weight'"),
            std::string::npos) << e3;

  // And an fp32 model decodes packed experts row by row: exactly their MXFP4 values.
  DeepSeekModel c(fp32_of(cfg));
  save_model(dir / "full", cfg, a.params());
  const LoadSummary s2 = load_weights(dir / "full", c.params());
  auto decoded = by_name(c);
  int64_t pairs = 0;
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param* w = a.params()[i];
    if (w->format != ParamFormat::Mxfp4Data) continue;
    const Param* full = decoded.at(w->name);
    const int64_t rows = full->value.dim(0), cols = full->value.dim(1);
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      mxfp4::dequantize_row(w->value.u8() + r * cols / 2,
                            a.params()[i + 1]->value.u8() + r * cols / 32, cols, row.data());
      ASSERT_EQ(std::memcmp(row.data(), full->w() + r * cols, static_cast<size_t>(cols) * 4), 0)
          << w->name << " row " << r;
    }
    ++pairs;
  }
  EXPECT_EQ(s2.decoded, pairs);
  EXPECT_GT(pairs, 0);
}

TEST(Mxfp4Experts, QuantizeCommandStreamsExpertByExpert) {
  const ModelConfig cfg = fp32_of(packed_config());
  const fs::path dir = scratch_dir("test_mxfp4_tmp");
  DeepSeekModel dense(cfg);
  dense.init_weights(5);
  save_model(dir / "fp32", cfg, dense.params(), DType::F32, /*max_shard_bytes=*/300000);
  write_text(dir / "fp32" / "tokenizer.json", "{}");

  MemoryTracker& mem = MemoryTracker::instance();
  const int64_t before = mem.snapshot().total_current();
  mem.reset_peaks();
  const QuantizeReport rep = quantize_model_experts(dir / "fp32", dir / "q");
  const MemSnapshot s = mem.snapshot();
  // The peak is one packed expert matrix (0.53 bytes per weight), not an fp32 one.
  const int64_t one_matrix = cfg.hidden_size * cfg.moe_intermediate_size;
  EXPECT_LE(s.total_peak() - before, one_matrix * 17 / 32);
  EXPECT_GT(rep.files, 1);
  ASSERT_EQ(rep.layers.size(), dense.moe_layers().size());
  for (const auto& l : rep.layers) {
    EXPECT_EQ(l.matrices, 3 * cfg.n_routed_experts);
    EXPECT_GT(l.rel_rms_error, 0.01);  // 4 bits cost something...
    EXPECT_LT(l.rel_rms_error, 0.2);   // ...but not everything
  }
  EXPECT_EQ(rep.expert_bytes_out * 128, rep.expert_bytes_in * 17);
  EXPECT_TRUE(fs::exists(dir / "q" / "tokenizer.json"));

  // The quantized directory loads by passthrough into exactly what quantizing on load gives.
  DeepSeekModel from_q(resolve_model_config((dir / "q").string()));
  load_weights(dir / "q", from_q.params());
  DeepSeekModel on_load(packed_config());
  load_weights(dir / "fp32", on_load.params());
  for (size_t i = 0; i < on_load.params().size(); ++i)
    EXPECT_TRUE(same_bytes(on_load.params()[i]->value, from_q.params()[i]->value))
        << on_load.params()[i]->name;

  EXPECT_NE(error_of([&] { quantize_model_experts(dir / "fp32", dir / "q"); }).find("not an empty"),
            std::string::npos);
  EXPECT_NE(error_of([&] { quantize_model_experts(dir / "q", dir / "q2"); }).find("already MXFP4"),
            std::string::npos);
}

TEST(Mxfp4Experts, Bf16ExpertsQuantizeTheSameOnLoadAndInQuantize) {
  const ModelConfig cfg = fp32_of(packed_config());
  const fs::path dir = scratch_dir("test_mxfp4_tmp");
  DeepSeekModel dense(cfg);
  dense.init_weights(5);
  save_model(dir / "bf16", cfg, dense.params(), DType::BF16);
  quantize_model_experts(dir / "bf16", dir / "q");
  DeepSeekModel from_q(resolve_model_config((dir / "q").string()));
  load_weights(dir / "q", from_q.params());
  DeepSeekModel on_load(packed_config());
  load_weights(dir / "bf16", on_load.params());
  int64_t packed = 0;
  for (size_t i = 0; i < on_load.params().size(); ++i) {
    packed += on_load.params()[i]->packed();
    EXPECT_TRUE(same_bytes(on_load.params()[i]->value, from_q.params()[i]->value))
        << on_load.params()[i]->name;
  }
  EXPECT_GT(packed, 0);
}

// ---------------------------------------------------------------- int8 expert activations
//
// The int8 kernel's documented bound (kernels/mxfp4_gemm_q8.h), per output of y = x·Wᵀ:
//   |y − x·Wᵀ| <= Σ_blocks (amax_block(x) / 254) · Σ_block |w|   (half an int8 step each)
// plus fp32 rounding. The tests carry it through a routed expert (SwiGLU, routing weight, down
// projection) to every routed row's output, and for a V3 model on through the final norm and the
// head to the logits, with Lipschitz constants and fp32 rounding bounds only (u = 2^-24; a dot
// product of n terms lies within γ_n·Σ|a·b| of the real one in any order). The fp32 allowances
// are 250 to 1,000 times smaller than the int8 term: the bounds are the kernel's, not tolerances.

namespace {

constexpr double kUnit = 0x1p-24;
double gamma_n(int64_t n) {
  return static_cast<double>(n) * kUnit / (1 - static_cast<double>(n) * kUnit);
}
// The kernel's fl(127 / amax) and fl(amax / 254) round once each: an element may land up to
// 4u·amax beyond half a step.
constexpr double kStepRounding = 1 + 4 * 254 * kUnit;
// An fp32 elementwise chain (silu's exp and division, the routing weight, rsqrt): a few ulps.
constexpr double kElementwise = 64 * kUnit;
// max |silu'| = 1.0998 (at 2.40); min(·, L) and clamp(·, −L, L) are 1-Lipschitz.
constexpr double kSiluLipschitz = 1.1;

double silu(double v) { return v / (1 + std::exp(-v)); }

// One expert's matrices, decoded: gate and up [H, D], down [D, H].
struct DecodedExpert {
  std::vector<float> gate, up, down;
};

std::vector<float> decode(const Mxfp4Matrix& w) {
  std::vector<float> out(static_cast<size_t>(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r)
    mxfp4::dequantize_row(w.packed + r * w.packed_stride, w.scales + r * w.scale_stride, w.cols,
                          out.data() + r * w.cols);
  return out;
}

// Of one weight row: Σ a·w, Σ |a|·|w| and the int8 term Σ_blocks (max_block |a| / 254)·
// Σ_block |w|, from the activations and a bound on their magnitudes (the down projection's int8
// input is only known to lie within a bound of the real one).
struct DotTerms {
  double value = 0, abs = 0, int8 = 0;
};

DotTerms dot_terms(const double* a, const double* a_mag, const float* w, int64_t n) {
  DotTerms t;
  for (int64_t b = 0; b < n; b += 32) {
    double amax = 0, wsum = 0;
    for (int64_t k = b; k < b + 32; ++k) {
      t.value += a[k] * w[k];
      t.abs += a_mag[k] * std::fabs(w[k]);
      amax = std::max(amax, a_mag[k]);
      wsum += std::fabs(w[k]);
    }
    t.int8 += amax / 254 * wsum;
  }
  t.int8 *= kStepRounding;
  return t;
}

// A routed row's output o = W_down·(weight · swiglu(W_gate·x, W_up·x)) in real numbers, and per
// output how far from it the exact fp32 path and the int8 path may land.
struct RowReference {
  std::vector<double> value, exact, int8;
};

RowReference expert_row_reference(const float* x, float weight, const DecodedExpert& m, int64_t D,
                                  int64_t H, double limit) {
  std::vector<double> xv(x, x + D), xm(static_cast<size_t>(D));
  for (int64_t k = 0; k < D; ++k) xm[k] = std::fabs(xv[k]);
  // The real h, and per path (0 exact, 1 int8) the bound around it and on the path's |h|.
  std::vector<double> h(static_cast<size_t>(H)), eh[2], hm[2];
  for (int p = 0; p < 2; ++p) {
    eh[p].resize(static_cast<size_t>(H));
    hm[p].resize(static_cast<size_t>(H));
  }
  const double w = weight;
  for (int64_t i = 0; i < H; ++i) {
    const DotTerms g = dot_terms(xv.data(), xm.data(), m.gate.data() + i * D, D);
    const DotTerms u = dot_terms(xv.data(), xm.data(), m.up.data() + i * D, D);
    const double cg = limit > 0 ? std::min(g.value, limit) : g.value;
    const double cu = limit > 0 ? std::clamp(u.value, -limit, limit) : u.value;
    h[i] = w * silu(cg) * cu;
    const double eg[2] = {gamma_n(D) * g.abs, g.int8 + gamma_n(D) * (g.abs + g.int8)};
    const double eu[2] = {gamma_n(D) * u.abs, u.int8 + gamma_n(D) * (u.abs + u.int8)};
    for (int p = 0; p < 2; ++p) {
      // h' − h = w·((silu(g') − silu(g))·u' + silu(g)·(u' − u)), clamps included.
      const double carried =
          w * (kSiluLipschitz * eg[p] * (std::fabs(cu) + eu[p]) + std::fabs(silu(cg)) * eu[p]);
      eh[p][i] = carried + kElementwise * (std::fabs(h[i]) + carried);
      hm[p][i] = std::fabs(h[i]) + eh[p][i];
    }
  }
  RowReference r;
  r.value.resize(static_cast<size_t>(D));
  r.exact.resize(static_cast<size_t>(D));
  r.int8.resize(static_cast<size_t>(D));
  for (int64_t j = 0; j < D; ++j) {
    const float* wd = m.down.data() + j * H;
    for (int p = 0; p < 2; ++p) {
      const DotTerms o = dot_terms(h.data(), hm[p].data(), wd, H);
      double carried = 0;  // the input's own deviation, through |W_down|
      for (int64_t i = 0; i < H; ++i) carried += std::fabs(wd[i]) * eh[p][i];
      if (p == 0) {
        r.value[j] = o.value;
        r.exact[j] = carried + gamma_n(H) * o.abs;
      } else {
        r.int8[j] = carried + o.int8 + gamma_n(H) * (o.abs + o.int8);
      }
    }
  }
  return r;
}

// What one MoE layer forward handed its dispatcher: the experts' input rows (expert-major), their
// routing weights and per-expert offsets, the experts' outputs and the combined result.
struct MoeCall {
  Tensor rows, row_weights, expert_out, combined;
  std::vector<int32_t> offsets, row_of_slot;
  int64_t top_k = 0;
};

class RecordingDispatcher : public LocalDispatcher {
 public:
  std::vector<MoeCall> calls;

  Dispatched dispatch(const Tensor& x, const Tensor& ids, const Tensor& weights,
                      int64_t num_experts) override {
    Dispatched d = LocalDispatcher::dispatch(x, ids, weights, num_experts);
    MoeCall c;
    c.rows = d.rows.clone(MemCategory::Scratch);
    c.row_weights = d.row_weights.clone(MemCategory::Scratch);
    const Handle& h = d.handle;
    c.offsets.assign(h.offsets(), h.offsets() + h.experts().count + 1);
    c.row_of_slot.assign(h.row_of_slot(), h.row_of_slot() + h.tokens() * h.top_k());
    c.top_k = h.top_k();
    calls.push_back(std::move(c));
    return d;
  }
  Tensor combine(const Tensor& expert_out, Handle& handle, Pass pass) override {
    calls.back().expert_out = expert_out.clone(MemCategory::Scratch);
    Tensor y = LocalDispatcher::combine(expert_out, handle, pass);
    calls.back().combined = y.clone(MemCategory::Scratch);
    return y;
  }
};

// The reference of every routed row of a recorded call, in row order.
std::vector<RowReference> row_references(const MoeCall& call, MoELayer& layer) {
  const Mxfp4ExpertWeights& w = *layer.mxfp4_experts();
  const int64_t D = w.dim(), H = w.hidden();
  std::vector<RowReference> out;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(call.offsets.size()); ++e) {
    const DecodedExpert m{decode(w.gate(e)), decode(w.up(e)), decode(w.down(e))};
    for (int32_t r = call.offsets[e]; r < call.offsets[e + 1]; ++r)
      out.push_back(expert_row_reference(call.rows.f32() + r * D, call.row_weights.f32()[r], m, D,
                                         H, layer.swiglu_limit()));
  }
  return out;
}

struct RowCheck {
  double worst = 0;             // max |o − o*| / the path's bound: <= 1
  double beyond_fp32 = 0;       // max |o − o*| / the exact path's bound: > 1 only from int8
};

RowCheck check_rows(const MoeCall& call, const std::vector<RowReference>& refs,
                    ExpertActivations path) {
  RowCheck c;
  const int64_t D = static_cast<int64_t>(refs.front().value.size());
  for (size_t r = 0; r < refs.size(); ++r)
    for (int64_t j = 0; j < D; ++j) {
      const double got = call.expert_out.f32()[static_cast<int64_t>(r) * D + j];
      const double d = std::fabs(got - refs[r].value[j]);
      if (d == 0) continue;  // an all-zero row has a zero bound
      const double bound = path == ExpertActivations::Int8 ? refs[r].int8[j] : refs[r].exact[j];
      c.worst = std::max(c.worst, d / bound);
      c.beyond_fp32 = std::max(c.beyond_fp32, d / refs[r].exact[j]);
    }
  return c;
}

std::vector<float> floats_of(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

// The int8 path's routed rows of a recorded call computed directly: per expert one
// mxfp4_gemm_nt_q8 call over all its rows and whole matrices, SwiGLU, the routing weight, then
// the down projection. The kernel's bits depend on the shapes only (not on m or on how the
// layer cuts the work into items), so the layer's rows must equal these bit for bit.
std::vector<float> int8_rows_direct(const MoeCall& call, MoELayer& layer) {
  const Mxfp4ExpertWeights& w = *layer.mxfp4_experts();
  const int64_t D = w.dim(), H = w.hidden();
  std::vector<float> out(static_cast<size_t>(call.rows.dim(0) * D));
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(call.offsets.size()); ++e) {
    const int64_t first = call.offsets[e], n = call.offsets[e + 1] - first;
    if (n == 0) continue;
    std::vector<float> g(static_cast<size_t>(n * H)), u(g.size()), h(g.size());
    mxfp4_gemm_nt_q8(n, call.rows.f32() + first * D, D, w.gate(e), g.data(), H, false);
    mxfp4_gemm_nt_q8(n, call.rows.f32() + first * D, D, w.up(e), u.data(), H, false);
    swiglu_forward(g.data(), u.data(), h.data(), n * H, layer.swiglu_limit());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < H; ++i) h[r * H + i] *= call.row_weights.f32()[first + r];
    mxfp4_gemm_nt_q8(n, h.data(), H, w.down(e), out.data() + first * D, D, false);
  }
  return out;
}

// The int8 logits are the same bits at 1 and 2 threads and on every SIMD target, and switching
// back to fp32 activations gives the exact path's logits again.
template <class Model>
void expect_int8_logits_reproducible(Model& model, const Tensor& tokens, const BatchShape& shape,
                                     const Tensor& int8, const Tensor& exact) {
  const int threads = num_threads();
  for (int n : {1, 2}) {
    set_num_threads(n);
    EXPECT_EQ(floats_of(model.logits(tokens, shape)), floats_of(int8)) << n << " threads";
  }
  set_num_threads(threads);
  expect_same_bits_on_every_target([&] { return floats_of(model.logits(tokens, shape)); });
  model.set_expert_activations(ExpertActivations::Fp32);
  EXPECT_TRUE(same_bytes(model.logits(tokens, shape), exact));
}

}  // namespace

TEST(Int8ExpertActivations, V3LogitsStayWithinTheKernelBoundCarriedToThem) {
  // One MoE layer without shared experts, its attention's output projection zeroed: the layer's
  // input rows, routing and expert outputs are recorded, and the final norm's input is then known
  // exactly (the embedding row + the combined experts), so the bound is carried through the norm
  // and the head without a hidden state the model does not expose.
  ModelConfig cfg = packed_config();
  cfg.num_hidden_layers = 1;
  cfg.first_k_dense_replace = 0;
  cfg.n_shared_experts = 0;
  cfg.validate("test");
  const auto recorder = std::make_shared<RecordingDispatcher>();
  DeepSeekModel model(cfg, recorder);
  model.init_weights(5);
  const auto params = by_name(model);
  Param* o_proj = params.at("model.layers.0.self_attn.o_proj.weight");
  std::memset(o_proj->w(), 0, static_cast<size_t>(o_proj->value.nbytes()));
  const BatchShape shape{2, 16};
  const Tensor tokens = random_tokens(shape.tokens(), cfg.vocab_size, 8);
  const Tensor exact = model.logits(tokens, shape);
  model.set_expert_activations(ExpertActivations::Int8);
  const Tensor int8 = model.logits(tokens, shape);
  ASSERT_EQ(recorder->calls.size(), 2u);
  const MoeCall& ce = recorder->calls[0];
  const MoeCall& cq = recorder->calls[1];
  // The switch changes the experts' matmuls and nothing before them.
  EXPECT_TRUE(same_bytes(ce.rows, cq.rows));
  EXPECT_TRUE(same_bytes(ce.row_weights, cq.row_weights));
  EXPECT_EQ(ce.offsets, cq.offsets);
  EXPECT_FALSE(same_bytes(exact, int8)) << "the option must switch the kernel";

  MoELayer& layer = *model.moe_layers()[0];
  EXPECT_EQ(floats_of(cq.expert_out), int8_rows_direct(cq, layer));
  const std::vector<RowReference> refs = row_references(ce, layer);
  const RowCheck re = check_rows(ce, refs, ExpertActivations::Fp32);
  const RowCheck rq = check_rows(cq, refs, ExpertActivations::Int8);
  EXPECT_LE(re.worst, 1.0);
  EXPECT_LE(rq.worst, 1.0);
  EXPECT_GT(rq.beyond_fp32, 1.0) << "int8 rounding shows beyond fp32's";

  // Rows -> logits. Per token t: y = Σ_j o_{row(t, j)} (fp32, k terms), z = y + embedding row
  // (fp32), n = γ ⊙ z·r(z) with r = 1/sqrt(mean z² + eps), logits = W_head·n. Given a bound
  // row_delta on |o' − o| per routed row and output, the bound on |logits' − logits|, and the
  // largest and mean fraction of it that the two runs' logits use.
  const int64_t T = shape.tokens(), D = cfg.hidden_size, V = cfg.vocab_size, k = ce.top_k;
  const float* embedding = params.at("model.embed_tokens.weight")->w();
  const float* norm_weight = params.at("model.norm.weight")->w();
  const float* head = params.at("lm_head.weight")->w();
  const double eps = static_cast<float>(cfg.rms_norm_eps);
  struct Used {
    double worst = 0, mean = 0;
  };
  auto logits_within = [&](const std::function<double(int32_t row, int64_t i)>& row_delta) {
    Used used;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> z(static_cast<size_t>(D)), dz(static_cast<size_t>(D));
      double z2 = 0, dz2 = 0;
      for (int64_t i = 0; i < D; ++i) {
        double sum_delta = 0, sum_abs = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t r = ce.row_of_slot[static_cast<size_t>(t * k + j)];
          sum_delta += row_delta(r, i);
          sum_abs += std::fabs(ce.expert_out.f32()[r * D + i]);
        }
        // Each path's k − 1 fp32 additions, then its residual addition.
        const double dy =
            sum_delta + static_cast<double>(k - 1) * kUnit * (2 * sum_abs + sum_delta);
        z[i] = ce.combined.f32()[t * D + i] + embedding[tokens.i32()[t] * D + i];
        dz[i] = dy + kUnit * (2 * std::fabs(z[i]) + dy);
        z2 += z[i] * z[i];
        dz2 += dz[i] * dz[i];
      }
      z2 = std::sqrt(z2), dz2 = std::sqrt(dz2);
      const double dim = static_cast<double>(D);
      const double r = 1 / std::sqrt(z2 * z2 / dim + eps);
      // Over the ball of radius |Δz| around z: r <= r_max, and |∇r| = r³·|ξ|/D.
      const double lo = std::max(0.0, z2 - dz2);
      const double r_max = 1 / std::sqrt(lo * lo / dim + eps);
      const double dr = r_max * r_max * r_max * (z2 + dz2) * dz2 / dim;
      const double e_norm = gamma_n(D) + kElementwise;  // each path's fp32 norm
      std::vector<double> n(static_cast<size_t>(D)), dn(static_cast<size_t>(D));
      for (int64_t i = 0; i < D; ++i) {
        n[i] = norm_weight[i] * z[i] * r;
        dn[i] = std::fabs(norm_weight[i]) * (r_max * dz[i] + (std::fabs(z[i]) + dz[i]) * dr);
        dn[i] += e_norm * (2 * std::fabs(n[i]) + dn[i]);
      }
      for (int64_t v = 0; v < V; ++v) {
        double bound = 0, mag = 0;
        for (int64_t i = 0; i < D; ++i) {
          const double w = std::fabs(head[v * D + i]);
          bound += w * dn[i];
          mag += w * (2 * std::fabs(n[i]) + dn[i]);
        }
        bound += gamma_n(D) * mag;
        const double diff =
            std::fabs(static_cast<double>(int8.f32()[t * V + v]) - exact.f32()[t * V + v]);
        EXPECT_LE(diff, bound) << "token " << t << " logit " << v;
        used.worst = std::max(used.worst, diff / bound);
        used.mean += diff / bound / static_cast<double>(T * V);
      }
    }
    return used;
  };
  // End to end: the kernel's bound, carried to the rows above, then to the logits. Worst case at
  // every step (each rounding error of 64 + 256 + 64 products aligned), so the two runs use a
  // small fraction of it.
  const Used chain = logits_within([&](int32_t r, int64_t i) {
    return refs[static_cast<size_t>(r)].exact[i] + refs[static_cast<size_t>(r)].int8[i];
  });
  // The last stage alone, from the rows' actual differences: nothing but the rows moves the logits.
  const Used stage = logits_within([&](int32_t r, int64_t i) {
    return std::fabs(static_cast<double>(cq.expert_out.f32()[r * D + i]) -
                     ce.expert_out.f32()[r * D + i]);
  });
  std::printf("used of the bound: expert rows %.3f (largest), logits from the kernel bound %.4f "
              "(largest) %.5f (mean), logits from the rows' differences %.3f (largest) %.4f "
              "(mean)\n",
              rq.worst, chain.worst, chain.mean, stage.worst, stage.mean);

  expect_int8_logits_reproducible(model, tokens, shape, int8, exact);
}

TEST(Int8ExpertActivations, EveryMoELayerOfAV4ModelRunsTheInt8KernelWithinItsBound) {
  // DeepSeek-V4: a hash-routed first layer, top-k layers after it, clamped SwiGLU, shared experts
  // and an MTP layer; one set_expert_activations reaches each of them.
  ModelConfig cfg = resolve_model_config("debug-v4");
  cfg.expert_format = "mxfp4";
  cfg.validate("test");
  const auto recorder = std::make_shared<RecordingDispatcher>();
  DeepSeekV4Model model(cfg, recorder);
  model.init_weights(3);
  const BatchShape shape{2, 16};
  const Tensor tokens = random_tokens(shape.tokens(), cfg.vocab_size, 4);
  const Tensor exact = model.logits(tokens, shape);
  std::vector<MoeCall> exact_calls = std::move(recorder->calls);
  recorder->calls.clear();
  model.set_expert_activations(ExpertActivations::Int8);
  const std::vector<MoELayer*> layers = model.moe_layers();
  ASSERT_EQ(static_cast<int64_t>(layers.size()),
            cfg.num_hidden_layers + cfg.num_nextn_predict_layers);
  for (MoELayer* m : layers) EXPECT_EQ(m->expert_activations(), ExpertActivations::Int8);
  EXPECT_EQ(layers[0]->selection(), ExpertSelection::Hash);
  EXPECT_EQ(layers[1]->selection(), ExpertSelection::TopK);
  const Tensor int8 = model.logits(tokens, shape);
  EXPECT_FALSE(same_bytes(exact, int8));
  ASSERT_EQ(recorder->calls.size(), exact_calls.size());
  ASSERT_GE(static_cast<int64_t>(exact_calls.size()), cfg.num_hidden_layers);
  for (size_t l = 0; l < exact_calls.size(); ++l) {
    SCOPED_TRACE("MoE layer " + std::to_string(l));
    // Each run against the real product of its own rows (past the first layer they differ).
    const MoeCall& ce = exact_calls[l];
    const MoeCall& cq = recorder->calls[l];
    const RowCheck re = check_rows(ce, row_references(ce, *layers[l]), ExpertActivations::Fp32);
    const RowCheck rq = check_rows(cq, row_references(cq, *layers[l]), ExpertActivations::Int8);
    EXPECT_LE(re.worst, 1.0);
    EXPECT_LE(rq.worst, 1.0);
    EXPECT_GT(rq.beyond_fp32, 1.0) << "this layer did not run the int8 kernel";
    EXPECT_EQ(floats_of(cq.expert_out), int8_rows_direct(cq, *layers[l]));
  }
  expect_int8_logits_reproducible(model, tokens, shape, int8, exact);
}

TEST(Int8ExpertActivations, NeverInATrainingForwardAndOnlyOverMxfp4Experts) {
  const ModelConfig cfg = packed_config();
  // What `moe train` and `moe finetune` build: exact experts, and no option reaches them.
  const std::unique_ptr<CausalLM> model = make_causal_lm(cfg);
  model->init_weights(5);
  model->allocate_grads();
  for (MoELayer* m : model->moe_layers())
    EXPECT_EQ(m->expert_activations(), ExpertActivations::Fp32);
  const BatchShape shape{2, 16};
  const Tensor tokens = random_tokens(shape.tokens(), cfg.vocab_size, 8);
  const Tensor targets = random_tokens(shape.tokens(), cfg.vocab_size, 9);
  model->set_expert_activations(ExpertActivations::Int8);
  EXPECT_NE(error_of([&] { model->forward(tokens, targets, shape, Pass::Train); })
                .find("a training forward with int8 expert activations"),
            std::string::npos);
  // Evaluation keeps nothing for a backward: allowed.
  EXPECT_TRUE(std::isfinite(model->forward(tokens, targets, shape, Pass::Eval).ce));
  // Back to fp32, training runs and leaves nothing behind from the refused forward.
  model->set_expert_activations(ExpertActivations::Fp32);
  model->zero_grads();
  model->forward(tokens, targets, shape, Pass::Train);
  model->backward();
  EXPECT_FALSE(model->has_saved());

  // fp32 experts have no int8 path: the model, a layer and the store each refuse it.
  DeepSeekModel dense(fp32_of(cfg));
  EXPECT_NE(error_of([&] { dense.set_expert_activations(ExpertActivations::Int8); })
                .find("int8 expert activations need MXFP4 routed experts, but this deepseek_v3 "
                      "model's are fp32"),
            std::string::npos);
  MoELayer& dense_layer = *dense.moe_layers()[0];
  EXPECT_NE(error_of([&] { dense_layer.set_expert_activations(ExpertActivations::Int8); })
                .find("model.layers.1.mlp.gate.weight: int8 expert activations need MXFP4"),
            std::string::npos);
  ExpertSegments seg;
  seg.offsets = {0, 1};
  std::vector<float> x(static_cast<size_t>(cfg.hidden_size));
  std::vector<float> g(static_cast<size_t>(cfg.moe_intermediate_size)), u(g.size());
  EXPECT_NE(error_of([&] {
              dense_layer.experts().gate_up_forward(seg, x.data(), g.data(), u.data(),
                                                    ExpertActivations::Int8);
            }).find("no int8-activation forward"),
            std::string::npos);
}
