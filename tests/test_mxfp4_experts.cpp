// MXFP4-resident frozen experts (issue 5): the packed store against decode-then-fp32 GEMMs, the
// model with packed experts against the fp32 model it quantizes, frozen training, passthrough
// load/save, the missing-scale error, `moe quantize`, and the memory accounting that proves no
// full-precision expert ever exists.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/model_spec.h"
#include "io/quantize_model.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"
#include "model/model.h"
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
