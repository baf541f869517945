// DeepSeek-V4 checkpoints in the released layout: load_weights (io/checkpoint.h) into
// DeepSeekV4Model and save_v4_released (io/v4_checkpoint.h), `moe inspect` and `moe convert`.
//
// The fixture tests/fixtures/v4_released (tests/reference/make_v4_checkpoint.py) is a tiny V4
// model with every released dtype: F8_E4M3 + F8_E8M0 `.scale` linears (two tiles along each axis
// in places, partial last tiles), I8 + F8_E8M0 MXFP4 routed experts, BF16, F32 and I64 tid2eid,
// with the reference's logits on the weights the file defines.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"
#include "io/checkpoint.h"
#include "io/convert_model.h"
#include "io/fp8.h"
#include "io/hf_config.h"
#include "io/inspect.h"
#include "io/quantize_model.h"
#include "io/safetensors.h"
#include "io/v4_checkpoint.h"
#include "kernels/mxfp4.h"
#include "model/v4/v4_model.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kFixture = fs::path(MOE_SOURCE_DIR) / "tests" / "fixtures" / "v4_released";
const fs::path kFile = kFixture / kSafetensorsSingleFile;

struct RawTensor {
  std::string name, dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

std::vector<RawTensor> read_all(const fs::path& file) {
  std::vector<RawTensor> out;
  const SafetensorsReader r(file);
  for (const SafetensorsEntry& e : r.entries()) {
    RawTensor t{e.name, e.dtype, e.shape, std::vector<uint8_t>(static_cast<size_t>(e.nbytes()))};
    r.read_bytes(e, 0, e.nbytes(), t.bytes.data());
    out.push_back(std::move(t));
  }
  return out;
}

std::map<std::string, RawTensor> raw_by_name(const fs::path& file) {
  std::map<std::string, RawTensor> out;
  for (RawTensor& t : read_all(file)) out[t.name] = std::move(t);
  return out;
}

// The fixture with `edit` applied to its tensors, in `dst` (config.json copied).
fs::path edited_copy(const fs::path& dst, const std::function<void(std::vector<RawTensor>&)>& edit) {
  std::vector<RawTensor> ts = read_all(kFile);
  edit(ts);
  fs::create_directories(dst);
  fs::copy_file(kFixture / kHfConfigFile, dst / kHfConfigFile, fs::copy_options::overwrite_existing);
  std::vector<SafetensorsLayoutItem> layout;
  for (const RawTensor& t : ts) layout.push_back({t.name, t.dtype, t.shape});
  SafetensorsStreamWriter w(dst / kSafetensorsSingleFile, layout, {{"format", "pt"}});
  for (const RawTensor& t : ts) w.append(t.bytes.data(), static_cast<int64_t>(t.bytes.size()));
  w.commit();
  return dst;
}

RawTensor& find(std::vector<RawTensor>& ts, const std::string& name) {
  for (RawTensor& t : ts)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

std::map<std::string, Param*> by_name(const DeepSeekV4Model& m) {
  std::map<std::string, Param*> out;
  for (Param* p : m.params()) out[p->name] = p;
  return out;
}

ModelConfig fixture_config(const std::string& experts) {
  ModelConfig c = read_hf_config(kFixture);
  c.expert_format = experts;
  c.validate("test");
  return c;
}

struct Expected {
  std::unique_ptr<SafetensorsReader> file;
  Tensor tokens, logits, mtp_logits;
  BatchShape shape;
  Expected() {
    file = std::make_unique<SafetensorsReader>(kFixture / "expected.safetensors");
    const Shape s = file->entry("tokens").shape;
    shape = {s[0], s[1]};
    tokens = file->read("tokens", DType::I32, MemCategory::Activations).view({shape.tokens()});
    logits = file->read("logits", DType::F32, MemCategory::Scratch);
    mtp_logits = file->read("mtp_logits", DType::F32, MemCategory::Scratch);
  }
};

struct Logits {
  Tensor main, mtp;
};

Logits logits_of(DeepSeekV4Model& m, const Expected& want) {
  Logits l;
  l.main = m.logits(want.tokens, want.shape, &l.mtp);
  return l;
}

// Routed-expert blocks (the layers and the MTP block) x experts x 3 matrices.
int64_t expert_matrices(const ModelConfig& c) {
  return (c.num_hidden_layers + c.num_nextn_predict_layers) * c.n_routed_experts * 3;
}

ParamList routed_experts(const DeepSeekV4Model& m) {
  ParamList out;
  for (Param* p : m.params())
    if (p->name.find(".ffn.experts.") != std::string::npos) out.push_back(p);
  return out;
}

int64_t weights_bytes() { return MemoryTracker::instance().snapshot()[MemCategory::Weights]; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// The E8M0 tile scale of FP8 writes

TEST(Fp8TileScale, SmallestPowerOfTwoBelowOverflowAndIdempotent) {
  EXPECT_EQ(fp8_tile_scale_e8m0(448.0f), 127);  // 448 / 1 fits
  EXPECT_EQ(fp8_tile_scale_e8m0(464.0f), 127);  // rounds to 448 (ties to even)
  EXPECT_EQ(fp8_tile_scale_e8m0(std::nextafter(464.0f, 1e9f)), 128);
  EXPECT_EQ(fp8_tile_scale_e8m0(232.0f), 126);  // 232 / 0.5 = 464
  EXPECT_EQ(fp8_tile_scale_e8m0(std::nextafter(232.0f, 1e9f)), 127);
  EXPECT_EQ(fp8_tile_scale_e8m0(1.0f), 127 - 8);  // 1 / 2^-8 = 256
  EXPECT_EQ(fp8_tile_scale_e8m0(0.0f), 127);
  EXPECT_EQ(fp8_tile_scale_e8m0(1e-45f), 0) << "clamped to 2^-127";
  EXPECT_EQ(fp8_tile_scale_e8m0(INFINITY), 254);
  // Encode, decode, encode again: the same scale and bytes for any tile (with amax / s <= 448
  // a tile whose maximum rounds down to 224 would come back at half the scale).
  Rng rng(5);
  int64_t checked = 0;
  for (int tile = 0; tile < 2000; ++tile) {
    const float mag = std::ldexp(1.0f, static_cast<int>(rng.next_u64() % 60) - 30);
    std::vector<float> v(64);
    for (float& x : v) x = mag * rng.normal();
    float amax = 0;
    for (float x : v) amax = std::max(amax, std::fabs(x));
    const uint8_t s = fp8_tile_scale_e8m0(amax);
    std::vector<float> decoded(v.size());
    std::vector<uint8_t> codes(v.size());
    float amax2 = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      codes[i] = fp8_e4m3_encode(v[i] / mxfp4::e8m0_value(s));
      decoded[i] = fp8_e4m3_value(codes[i]) * mxfp4::e8m0_value(s);
      amax2 = std::max(amax2, std::fabs(decoded[i]));
    }
    ASSERT_EQ(fp8_tile_scale_e8m0(amax2), s) << "amax " << amax << " -> " << amax2;
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(fp8_e4m3_encode(decoded[i] / mxfp4::e8m0_value(s)), codes[i]);
    ++checked;
  }
  EXPECT_EQ(checked, 2000);
}

// ---------------------------------------------------------------------------------------------
// Loading the released layout

TEST(V4Load, PackedExpertsPassThroughAndTheLogitsMatchTheReference) {
  const ModelConfig cfg = read_hf_config(kFixture);
  EXPECT_TRUE(cfg.mxfp4_experts()) << "expert_dtype \"fp4\"";
  EXPECT_EQ(read_hf_weights_info(kFixture).fp8_block().scale_key, Fp8ScaleKey::Scale);
  const Expected want;
  MemoryTracker& mem = MemoryTracker::instance();
  const int64_t w0 = weights_bytes();
  DeepSeekV4Model model(cfg);
  const int64_t model_weights = weights_bytes() - w0;
  mem.reset_peaks();
  const LoadSummary s = load_weights(kFixture, model.params());
  const MemSnapshot after = mem.snapshot();
  EXPECT_EQ(after[MemCategory::Weights] - w0, model_weights) << "a load allocates no weights";
  EXPECT_EQ(after.peak[static_cast<int>(MemCategory::Weights)], after[MemCategory::Weights]);
  EXPECT_EQ(s.quantized, 0);
  EXPECT_EQ(s.decoded, 0);
  EXPECT_EQ(s.zeroed, 0);
  EXPECT_EQ(s.mtp_tensors, 0) << "V4's MTP module is part of the model";

  // Every tensor is what the file defines, bit for bit.
  const std::map<std::string, RawTensor> raw = raw_by_name(kFile);
  int64_t fp8 = 0, packed = 0, bf16 = 0, f32 = 0, ids = 0;
  for (const Param* p : model.params()) {
    const RawTensor& t = raw.at(p->name);
    if (p->packed()) {
      ASSERT_EQ(t.bytes.size(), static_cast<size_t>(p->value.nbytes())) << p->name;
      EXPECT_EQ(std::memcmp(t.bytes.data(), p->value.raw(), t.bytes.size()), 0) << p->name;
      packed += p->format == ParamFormat::Mxfp4Data;
      continue;
    }
    const float* v = p->w();
    const int64_t n = p->value.numel();
    if (t.dtype == "F8_E4M3") {
      ++fp8;
      const RawTensor& sc = raw.at(mxfp4_scale_name(p->name));
      ASSERT_EQ(sc.dtype, "F8_E8M0");
      const int64_t cols = p->value.dim(1), tiles_c = sc.shape[1];
      for (int64_t i = 0; i < n; ++i) {
        const float s = mxfp4::e8m0_value(sc.bytes[static_cast<size_t>((i / cols) / 128 * tiles_c + (i % cols) / 128)]);
        ASSERT_EQ(v[i], fp8_e4m3_value(t.bytes[static_cast<size_t>(i)]) * s) << p->name << " " << i;
      }
    } else if (t.dtype == "BF16") {
      ++bf16;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.bytes.data() + 2 * i, 2);
        ASSERT_EQ(v[i], bf16_to_f32(h)) << p->name;
      }
    } else if (t.dtype == "F32") {
      ++f32;
      EXPECT_EQ(std::memcmp(t.bytes.data(), v, static_cast<size_t>(n) * 4), 0) << p->name;
    } else {
      ASSERT_EQ(t.dtype, "I64") << p->name;
      ++ids;
      for (int64_t i = 0; i < n; ++i) {
        int64_t id;
        std::memcpy(&id, t.bytes.data() + 8 * i, 8);
        ASSERT_EQ(v[i], static_cast<float>(id)) << p->name;
      }
    }
  }
  EXPECT_EQ(packed, expert_matrices(cfg));
  EXPECT_EQ(fp8, s.fp8);
  EXPECT_EQ(ids, cfg.num_hash_layers);
  EXPECT_GT(bf16, 20);
  EXPECT_GT(f32, 20);
  // ... and what the reference decoded.
  const auto params = by_name(model);
  for (const SafetensorsEntry& e : want.file->entries()) {
    if (!e.name.starts_with("dequant.")) continue;
    const Param* p = params.at(e.name.substr(8));
    if (p->packed()) continue;  // the packed experts are checked against the fp32 load below
    EXPECT_TRUE(same_bytes(want.file->read(e.name, DType::F32, MemCategory::Scratch), p->value))
        << e.name;
  }

  const Logits l = logits_of(model, want);
  const double err = rel_error(l.main.f32(), want.logits.f32(), want.logits.numel());
  const double mtp_err = rel_error(l.mtp.f32(), want.mtp_logits.f32(), want.mtp_logits.numel());
  std::printf("released V4 layout, MXFP4 experts: logits rel error %.2e, MTP logits %.2e\n", err,
              mtp_err);
  EXPECT_LT(err, 1e-5);
  EXPECT_LT(mtp_err, 1e-5);
}

TEST(V4Load, NoCopyOfThePackedExpertsExists) {
  // Packed experts are copied straight into their store: loading them allocates nothing at
  // all, in any category, and the store is 4.25 bits per weight.
  const ModelConfig packed_cfg = fixture_config("mxfp4"), fp32_cfg = fixture_config("fp32");
  const int64_t w0 = weights_bytes();
  DeepSeekV4Model packed(packed_cfg);
  const int64_t packed_weights = weights_bytes() - w0;
  int64_t fp32_weights = 0;
  {
    DeepSeekV4Model dense(fp32_cfg);
    fp32_weights = weights_bytes() - w0 - packed_weights;
  }
  const int64_t per_matrix = packed_cfg.hidden_size * packed_cfg.moe_intermediate_size;
  const int64_t fp32_experts = expert_matrices(packed_cfg) * per_matrix * 4;
  EXPECT_EQ(fp32_weights - packed_weights, fp32_experts - fp32_experts * 17 / 128)
      << "the packed model holds the experts in 4.25 bits per weight, nothing more";

  MemoryTracker& mem = MemoryTracker::instance();
  const SafetensorsSet set(kFixture);
  const ParamList experts = routed_experts(packed);
  ASSERT_EQ(static_cast<int64_t>(experts.size()), 2 * expert_matrices(packed_cfg));
  const int64_t before = mem.snapshot().total_current();
  mem.reset_peaks();
  const LoadSummary s = load_weights(set, experts);
  const MemSnapshot after = mem.snapshot();
  EXPECT_EQ(s.tensors, expert_matrices(packed_cfg));
  EXPECT_EQ(after.total_peak(), before) << "no transient buffer: the bytes go straight in";
  EXPECT_EQ(after.total_current(), before);
}

TEST(V4Load, Fp32ExpertsAreDecodedRowByRow) {
  const ModelConfig cfg = fixture_config("fp32");
  const Expected want;
  DeepSeekV4Model model(cfg);
  const LoadSummary s = load_weights(kFixture, model.params());
  EXPECT_EQ(s.decoded, expert_matrices(cfg));
  EXPECT_EQ(s.quantized, 0);
  // Each expert is exactly the decoded MXFP4 of the file (and the reference's dequant.*).
  const std::map<std::string, RawTensor> raw = raw_by_name(kFile);
  for (const Param* p : routed_experts(model)) {
    const RawTensor& data = raw.at(p->name);
    const RawTensor& scales = raw.at(mxfp4_scale_name(p->name));
    const int64_t rows = p->value.dim(0), cols = p->value.dim(1);
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      mxfp4::dequantize_row(data.bytes.data() + r * cols / 2, scales.bytes.data() + r * cols / 32,
                            cols, row.data());
      ASSERT_EQ(std::memcmp(row.data(), p->w() + r * cols, static_cast<size_t>(cols) * 4), 0)
          << p->name << " row " << r;
    }
  }
  const auto params = by_name(model);
  int64_t dequant = 0;
  for (const SafetensorsEntry& e : want.file->entries())
    if (e.name.starts_with("dequant.")) {
      EXPECT_TRUE(same_bytes(want.file->read(e.name, DType::F32, MemCategory::Scratch),
                             params.at(e.name.substr(8))->value)) << e.name;
      ++dequant;
    }
  EXPECT_GE(dequant, 4);
  const Logits l = logits_of(model, want);
  const double err = rel_error(l.main.f32(), want.logits.f32(), want.logits.numel());
  const double mtp_err = rel_error(l.mtp.f32(), want.mtp_logits.f32(), want.mtp_logits.numel());
  std::printf("released V4 layout, fp32 experts: logits rel error %.2e, MTP logits %.2e\n", err,
              mtp_err);
  EXPECT_LT(err, 1e-5);
  EXPECT_LT(mtp_err, 1e-5);

  // Decoding streams: one packed row and its scales at a time, never an fp32 matrix.
  MemoryTracker& mem = MemoryTracker::instance();
  const SafetensorsSet set(kFixture);
  mem.reset_peaks();
  load_weights(set, routed_experts(model));
  const int64_t widest = std::max(cfg.hidden_size, cfg.moe_intermediate_size);
  EXPECT_LE(mem.snapshot().largest_allocation[static_cast<int>(MemCategory::Scratch)],
            widest / 2 + widest / 32);
}

// ---------------------------------------------------------------------------------------------
// Saving it

TEST(V4Save, SavingTheLoadedFixtureGivesItsBytesBack) {
  const fs::path tmp = scratch_dir("test_v4_checkpoint_tmp");
  const ModelConfig cfg = read_hf_config(kFixture);
  DeepSeekV4Model model(cfg);
  load_weights(kFixture, model.params());
  const V4SaveSummary s = save_v4_released(tmp / "saved", cfg, model.params());
  EXPECT_EQ(s.files, 1);
  EXPECT_EQ(s.mxfp4, expert_matrices(cfg));
  EXPECT_EQ(s.ids, cfg.num_hash_layers);
  EXPECT_GT(s.fp8, 0);
  const std::string want = read_file(kFile), got = read_file(tmp / "saved" / kSafetensorsSingleFile);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want) << "save(load(file)) differs from the file";
  EXPECT_FALSE(fs::exists(tmp / "saved" / kSafetensorsIndexFile));

  // config.json: the model's fields, and the release's quantization fields.
  const json j = json::parse(read_file(tmp / "saved" / kHfConfigFile));
  EXPECT_EQ(j["quantization_config"]["quant_method"], "fp8");
  EXPECT_EQ(j["quantization_config"]["scale_fmt"], "ue8m0");
  EXPECT_EQ(j["quantization_config"]["weight_block_size"], json({128, 128}));
  EXPECT_EQ(j["expert_dtype"], "fp4");
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  const ModelConfig back = read_hf_config(tmp / "saved");
  EXPECT_EQ(model_config_to_json(back), model_config_to_json(cfg));
  const json fixture = json::parse(read_file(kFixture / kHfConfigFile));
  for (const char* key : {"quantization_config", "expert_dtype", "compress_ratios", "hc_mult"})
    EXPECT_EQ(j[key], fixture[key]) << key;
}

TEST(V4Save, LoadOfSaveIsBitwiseAndSavesAreIdempotent) {
  const fs::path tmp = scratch_dir("test_v4_checkpoint_tmp");
  const Expected want;
  for (const char* experts : {"mxfp4", "fp32"}) {
    SCOPED_TRACE(experts);
    const ModelConfig cfg = fixture_config(experts);
    // A model the fixture did not write (random weights, fp32 where the file has FP8/BF16).
    DeepSeekV4Model a(cfg);
    a.init_weights(11);
    const fs::path d1 = tmp / experts / "1", d2 = tmp / experts / "2", d3 = tmp / experts / "3";
    save_v4_released(d1, cfg, a.params());
    DeepSeekV4Model b(cfg);
    const LoadSummary s = load_weights(d1, b.params());
    EXPECT_EQ(s.quantized + s.decoded, 0) << "experts load as they were saved";
    const auto bs = by_name(b);
    for (const Param* p : a.params()) {
      const Param* q = bs.at(p->name);
      switch (v4_released_format(*p)) {
        case V4DiskFormat::Mxfp4:
        case V4DiskFormat::F32:
        case V4DiskFormat::Ids:
          EXPECT_TRUE(same_bytes(p->value, q->value)) << p->name;
          break;
        case V4DiskFormat::Bf16:
          for (int64_t i = 0; i < p->value.numel(); ++i)
            ASSERT_EQ(q->w()[i], bf16_to_f32(f32_to_bf16(p->w()[i]))) << p->name;
          break;
        case V4DiskFormat::Fp8: {
          // Within E4M3's half step of the tile's maximum scale; exact on the next round trip.
          double err2 = 0, ref2 = 0;
          for (int64_t i = 0; i < p->value.numel(); ++i) {
            const double d = q->w()[i] - p->w()[i];
            err2 += d * d;
            ref2 += static_cast<double>(p->w()[i]) * p->w()[i];
          }
          EXPECT_LT(std::sqrt(err2 / ref2), 0.04) << p->name;
          break;
        }
      }
    }
    // save(load(save(x))) == save(x), and the reloaded model computes the same bits.
    save_v4_released(d2, cfg, b.params());
    EXPECT_TRUE(read_file(d1 / kSafetensorsSingleFile) == read_file(d2 / kSafetensorsSingleFile));
    DeepSeekV4Model c(cfg);
    load_weights(d2, c.params());
    for (size_t i = 0; i < b.params().size(); ++i)
      EXPECT_TRUE(same_bytes(b.params()[i]->value, c.params()[i]->value)) << b.params()[i]->name;
    const Logits lb = logits_of(b, want), lc = logits_of(c, want);
    EXPECT_TRUE(same_bytes(lb.main, lc.main) && same_bytes(lb.mtp, lc.mtp));

    // Sharded: the same tensors over several files and an index; a later single-file save
    // replaces them.
    const V4SaveSummary sharded = save_v4_released(d3, cfg, b.params(), 40000);
    EXPECT_GT(sharded.files, 3);
    EXPECT_TRUE(fs::exists(d3 / kSafetensorsIndexFile));
    EXPECT_FALSE(fs::exists(d3 / kSafetensorsSingleFile));
    DeepSeekV4Model e(cfg);
    load_weights(d3, e.params());
    for (size_t i = 0; i < b.params().size(); ++i)
      EXPECT_TRUE(same_bytes(b.params()[i]->value, e.params()[i]->value)) << b.params()[i]->name;
    save_v4_released(d3, cfg, b.params());
    EXPECT_FALSE(fs::exists(d3 / kSafetensorsIndexFile));
    EXPECT_FALSE(fs::exists(d3 / fmt::format("model-00001-of-{:05d}.safetensors", sharded.files)));
    EXPECT_TRUE(read_file(d3 / kSafetensorsSingleFile) == read_file(d1 / kSafetensorsSingleFile));
  }
  // The fixture itself: load -> save -> load gives the same logits, bit for bit.
  const ModelConfig cfg = read_hf_config(kFixture);
  DeepSeekV4Model f(cfg), g(cfg);
  load_weights(kFixture, f.params());
  save_v4_released(tmp / "fixture", cfg, f.params());
  load_weights(tmp / "fixture", g.params());
  const Logits lf = logits_of(f, want), lg = logits_of(g, want);
  EXPECT_TRUE(same_bytes(lf.main, lg.main) && same_bytes(lf.mtp, lg.mtp));
}

TEST(V4Save, Fp32ExpertsAreWrittenAsFp8AndLoadIntoEitherForm) {
  const fs::path tmp = scratch_dir("test_v4_checkpoint_tmp");
  const ModelConfig cfg = fixture_config("fp32");
  DeepSeekV4Model a(cfg);
  load_weights(kFixture, a.params());
  save_v4_released(tmp / "d", cfg, a.params());
  const json j = json::parse(read_file(tmp / "d" / kHfConfigFile));
  EXPECT_EQ(j["expert_dtype"], "fp8");
  EXPECT_EQ(read_hf_config(tmp / "d").expert_format, "fp32");
  const SafetensorsReader r(tmp / "d" / kSafetensorsSingleFile);
  EXPECT_EQ(r.entry("layers.0.ffn.experts.3.w2.weight").dtype, "F8_E4M3");
  EXPECT_EQ(r.entry("layers.0.ffn.experts.3.w2.scale").shape, (Shape{1, 1}));
  // Into MXFP4 experts: FP8 rows quantized on load, as for V3's FP8 experts.
  DeepSeekV4Model packed(fixture_config("mxfp4"));
  const LoadSummary s = load_weights(tmp / "d", packed.params());
  EXPECT_EQ(s.quantized, expert_matrices(cfg));
  // A model whose experts and config disagree is refused before anything is written.
  const std::string e = error_of([&] { save_v4_released(tmp / "bad", fixture_config("mxfp4"), a.params()); });
  EXPECT_NE(e.find("routed expert 'layers.0.ffn.experts.0.w1.weight' is fp32, but the config's "
                   "experts are packed"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(tmp / "bad"));
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST(V4Load, ErrorsNameTheFileTheTensorAndWhatWasExpected) {
  const fs::path tmp = scratch_dir("test_v4_checkpoint_tmp");
  struct Case {
    const char* what;
    std::function<void(std::vector<RawTensor>&)> edit;
    std::vector<std::string> message;
    bool fp32_experts = false;
  };
  const std::vector<Case> cases = {
      {"missing FP8 scale",
       [](auto& ts) { std::erase_if(ts, [](const RawTensor& t) { return t.name == "layers.1.attn.wq_a.scale"; }); },
       {"FP8 weight 'layers.1.attn.wq_a.weight' (F8_E4M3 [144, 32]) has no scale tensor "
        "'layers.1.attn.wq_a.scale' (F8_E8M0 [2, 1])"}},
      {"missing MXFP4 scale",
       [](auto& ts) { std::erase_if(ts, [](const RawTensor& t) { return t.name == "layers.2.ffn.experts.3.w2.scale"; }); },
       {"MXFP4 weight 'layers.2.ffn.experts.3.w2.weight' (I8) has no scale tensor "
        "'layers.2.ffn.experts.3.w2.scale' (F8_E8M0 [32, 1])"}},
      {"missing MXFP4 scale, fp32 experts",
       [](auto& ts) { std::erase_if(ts, [](const RawTensor& t) { return t.name == "layers.2.ffn.experts.3.w2.scale"; }); },
       {"MXFP4 weight 'layers.2.ffn.experts.3.w2.weight' (I8) has no scale tensor "
        "'layers.2.ffn.experts.3.w2.scale'"},
       true},
      {"missing tensor",
       [](auto& ts) { std::erase_if(ts, [](const RawTensor& t) { return t.name == "mtp.0.attn.attn_sink"; }); },
       {"the model weights have no tensor 'mtp.0.attn.attn_sink'"}},
      {"wrong dtype of a matrix",
       [](auto& ts) { find(ts, "layers.0.attn.wkv.weight").dtype = "F8_E5M2"; },
       {"tensor 'layers.0.attn.wkv.weight' has dtype F8_E5M2; a weight matrix loads from F32, "
        "BF16, F8_E4M3 (with its layers.0.attn.wkv.scale) or MXFP4"}},
      {"wrong dtype of a vector",
       [](auto& ts) { find(ts, "layers.0.attn.attn_sink").dtype = "I32"; },
       {"tensor 'layers.0.attn.attn_sink' has dtype I32; expected F32 (or BF16)"}},
      {"FP8 vector",
       [](auto& ts) {
         RawTensor& t = find(ts, "layers.0.attn.attn_sink");
         t.dtype = "F8_E4M3";
         t.shape = {16};
       },
       {"tensor 'layers.0.attn.attn_sink' has dtype F8_E4M3, but only a weight matrix can be "
        "stored as FP8 or MXFP4; the model expects F32 (or BF16) [4]"}},
      {"wrong scale dtype",
       [](auto& ts) { find(ts, "layers.0.attn.wkv.scale").dtype = "I8"; },
       {"scale tensor 'layers.0.attn.wkv.scale' of FP8 weight 'layers.0.attn.wkv.weight' has "
        "dtype I8; expected F8_E8M0"}},
      {"wrong shape",
       [](auto& ts) { find(ts, "layers.1.attn.wq_a.weight").shape = {32, 144}; },
       {"tensor 'layers.1.attn.wq_a.weight' has shape [32, 144], the model expects [144, 32]"}},
      {"wrong packed shape",
       [](auto& ts) { find(ts, "layers.1.ffn.experts.0.w1.weight").shape = {16, 32}; },
       {"packed tensor 'layers.1.ffn.experts.0.w1.weight' has shape [16, 32], the model expects "
        "[32, 16] ([out, in/2] bytes)"}},
      {"wrong scale shape",
       [](auto& ts) { find(ts, "layers.1.attn.indexer.wq_b.scale").shape = {4, 1}; },
       {"scale tensor 'layers.1.attn.indexer.wq_b.scale' of FP8 weight "
        "'layers.1.attn.indexer.wq_b.weight' [256, 144] has shape [4, 1]",
        "need [ceil(256/128), ceil(144/128)] = [2, 2]"}},
      {"tid2eid out of range",
       [](auto& ts) {
         RawTensor& t = find(ts, "layers.0.ffn.gate.tid2eid");
         const int64_t bad = 8;  // 8 experts: ids 0..7
         std::memcpy(t.bytes.data() + 8 * (2 * 5 + 1), &bad, 8);
       },
       {"tensor 'layers.0.ffn.gate.tid2eid' holds 8 at [5, 1], outside the valid ids [0, 8)"}},
      {"tid2eid of another dtype",
       [](auto& ts) { find(ts, "layers.0.ffn.gate.tid2eid").dtype = "F64"; },
       {"tensor 'layers.0.ffn.gate.tid2eid' has dtype F64; an id table loads from I64 or I32"}},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path dir = edited_copy(tmp / std::to_string(n++), c.edit);
    DeepSeekV4Model m(fixture_config(c.fp32_experts ? "fp32" : "mxfp4"));
    const Tensor before = m.params().front()->value;
    std::vector<float> first(before.f32(), before.f32() + before.numel());
    const std::string e = error_of([&] { load_weights(dir, m.params()); });
    for (const std::string& part : c.message) EXPECT_NE(e.find(part), std::string::npos) << e;
    EXPECT_NE(e.find(dir.string()), std::string::npos) << "names the file or directory: " << e;
    EXPECT_EQ(std::memcmp(first.data(), before.f32(), first.size() * 4), 0)
        << "nothing loaded before the checks";
  }
}

// ---------------------------------------------------------------------------------------------
// moe inspect, moe convert

TEST(V4Inspect, ListsTheReleasedLayoutByKindAndFormat) {
  const InspectReport r = inspect_model(kFixture);
  const ModelConfig& c = r.config;
  EXPECT_TRUE(r.ok()) << format_inspect_report(r);
  EXPECT_TRUE(r.unexpected.empty()) << format_inspect_report(r);
  EXPECT_EQ(r.mtp_tensors, 0);
  const int64_t matrices = expert_matrices(c);
  EXPECT_EQ(r.kinds.at(TensorKind::RoutedExperts).dtypes.at("I8"), matrices);
  EXPECT_EQ(r.kinds.at(TensorKind::RoutedExperts).dtypes.at("F8_E8M0"), matrices);
  EXPECT_EQ(r.kinds.at(TensorKind::RoutedExperts).dtypes.size(), 2u);
  EXPECT_EQ(r.kinds.at(TensorKind::HyperConnections).dtypes.size(), 1u);
  EXPECT_EQ(r.kinds.at(TensorKind::HyperConnections).dtypes.at("F32"), 6 * c.num_hidden_layers + 3)
      << "fn, base, scale of 2 sites per layer and of the head (the MTP module's are kind MTP)";
  EXPECT_EQ(r.kinds.at(TensorKind::Router).dtypes.at("I64"), c.num_hash_layers);
  EXPECT_EQ(r.kinds.at(TensorKind::SharedExperts).dtypes.at("F8_E4M3"), 3 * c.num_hidden_layers);
  EXPECT_EQ(r.kinds.at(TensorKind::Embedding).dtypes.at("BF16"), 1);
  EXPECT_EQ(r.kinds.at(TensorKind::Head).dtypes.at("BF16"), 1);
  EXPECT_GT(r.kinds.at(TensorKind::Mtp).tensors, 20);
  EXPECT_FALSE(r.kinds.contains(TensorKind::Unknown));
  for (const char* f : {"fp8", "mxfp4", "bf16", "fp32", "I64"}) EXPECT_TRUE(r.formats.contains(f)) << f;
  EXPECT_EQ(r.formats.at("mxfp4").weights, matrices);
  EXPECT_EQ(r.experts_mxfp4_bytes, r.formats.at("mxfp4").bytes) << "data + scales";
  EXPECT_EQ(r.experts, "mxfp4");
  int64_t file_bytes = 0;
  for (const auto& [kind, k] : r.kinds) file_bytes += k.bytes;
  EXPECT_EQ(file_bytes, SafetensorsReader(kFile).entries().back().end);
  const std::string text = format_inspect_report(r);
  for (const char* s : {"DeepseekV4ForCausalLM", "+ 1 MTP layer (mtp.0.*)", "scales F8_E8M0 X.scale",
                        "hyper-conn.", "layers.0.ffn.shared_experts.w1.weight F8_E4M3 [32, 32] + F8_E8M0 [1, 1]",
                        "layers.0.ffn.experts.0.w1.weight I8 [32, 16] + F8_E8M0 [32, 1]",
                        "missing: none", "problems: none"})
    EXPECT_NE(text.find(s), std::string::npos) << s << "\n" << text;
  EXPECT_EQ(text.find("skipped by a load"), std::string::npos) << text;

  // Every tensor of the model, in its parameter order.
  for (const char* experts : {"fp32", "mxfp4"}) {
    for (int64_t mtp : {0, 1}) {
      ModelConfig mc = fixture_config(experts);
      mc.num_nextn_predict_layers = mtp;
      DeepSeekV4Model m(mc);
      std::vector<std::string> want, got;
      std::vector<Shape> want_shapes, got_shapes;
      for (const Param* p : m.params())
        if (p->format != ParamFormat::Mxfp4Scales) {
          want.push_back(p->name);
          want_shapes.push_back(p->format == ParamFormat::Mxfp4Data
                                    ? Shape{p->value.dim(0), 2 * p->value.dim(1)}
                                    : p->value.shape());
        }
      for (const ExpectedTensor& x : expected_tensors(mc)) {
        got.push_back(x.name);
        got_shapes.push_back(x.shape);
      }
      EXPECT_EQ(got, want) << experts << " mtp " << mtp;
      EXPECT_EQ(got_shapes, want_shapes) << experts << " mtp " << mtp;
    }
  }

  // A scale gone is a problem named with its weight.
  const fs::path tmp = scratch_dir("test_v4_checkpoint_tmp");
  const fs::path dir = edited_copy(tmp / "noscale", [](auto& ts) {
    std::erase_if(ts, [](const RawTensor& t) { return t.name == "mtp.0.e_proj.scale"; });
  });
  const InspectReport bad = inspect_model(dir);
  ASSERT_EQ(bad.problems.size(), 1u);
  EXPECT_NE(bad.problems[0].find("mtp.0.e_proj.weight (model.safetensors): FP8 weight without its "
                                 "scale tensor 'mtp.0.e_proj.scale'"), std::string::npos)
      << bad.problems[0];
}

TEST(V4Convert, ToBf16AndMxfp4IsAPlainReadOfTheSameModel) {
  const fs::path tmp = scratch_dir("test_v4_checkpoint_tmp");
  const Expected want;
  const ModelConfig cfg = read_hf_config(kFixture);
  ConvertOptions opt;  // bf16 + mxfp4
  const ConvertReport rep = convert_model(kFixture, tmp / "c", opt);
  EXPECT_EQ(rep.copied_unknown, 0);
  EXPECT_EQ(rep.mtp_dropped, 0);
  EXPECT_GT(rep.fp8_dequantized, 0);
  EXPECT_TRUE(rep.layers.empty()) << "the experts were packed already: copied";
  const InspectReport r = inspect_model(tmp / "c");
  EXPECT_TRUE(r.ok() && r.unexpected.empty()) << format_inspect_report(r);
  EXPECT_FALSE(r.formats.contains("fp8"));
  for (const InspectTensor& t : r.tensors) {
    const V4DiskFormat f = v4_released_format(std::string_view(t.name));
    if (f == V4DiskFormat::F32) {
      EXPECT_EQ(t.dtype, "F32") << t.name;
    }
    if (f == V4DiskFormat::Ids) {
      EXPECT_EQ(t.dtype, "I64") << t.name;
    }
  }
  DeepSeekV4Model direct(cfg), conv(read_hf_config(tmp / "c"));
  load_weights(kFixture, direct.params());
  const LoadSummary s = load_weights(tmp / "c", conv.params());
  EXPECT_EQ(s.fp8 + s.quantized + s.decoded, 0) << "a plain read";
  // E4M3 values times powers of two have 4 significant bits: bf16 holds them exactly.
  for (size_t i = 0; i < direct.params().size(); ++i)
    EXPECT_TRUE(same_bytes(direct.params()[i]->value, conv.params()[i]->value))
        << direct.params()[i]->name;
  const Logits a = logits_of(direct, want), b = logits_of(conv, want);
  EXPECT_TRUE(same_bytes(a.main, b.main) && same_bytes(a.mtp, b.mtp));

  // f32 + f32: the fp32-experts model, decoded.
  ConvertOptions full;
  full.dtype = "f32";
  full.experts = "f32";
  convert_model(kFixture, tmp / "f32", full);
  DeepSeekV4Model d32(fixture_config("fp32")), c32(read_hf_config(tmp / "f32"));
  EXPECT_EQ(read_hf_config(tmp / "f32").expert_format, "fp32");
  load_weights(kFixture, d32.params());
  load_weights(tmp / "f32", c32.params());
  for (size_t i = 0; i < d32.params().size(); ++i)
    EXPECT_TRUE(same_bytes(d32.params()[i]->value, c32.params()[i]->value))
        << d32.params()[i]->name;
  // moe quantize has nothing to do.
  const std::string e = error_of([&] { quantize_model_experts(kFixture, tmp / "q"); });
  EXPECT_NE(e.find("already MXFP4"), std::string::npos) << e;
}
