#include "io/v4_checkpoint.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <set>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/fp8.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

// The released layout's FP8 tile (quantization_config.weight_block_size).
constexpr int64_t kTile = 128;
// Elements converted at a time when a tensor changes dtype on the way out.
constexpr int64_t kChunkElements = int64_t{1} << 18;

bool is_routed_expert(std::string_view name) {
  return name.find(".ffn.experts.") != std::string_view::npos;
}

// The linears DeepSeek stores as FP8 (SPEC §6.10); the routed experts are decided apart.
bool released_as_fp8(std::string_view name) {
  static constexpr std::array<std::string_view, 9> kSuffixes = {
      ".attn.wq_a.weight",   ".attn.wq_b.weight",   ".attn.wkv.weight",
      ".attn.wo_a.weight",   ".attn.wo_b.weight",   ".attn.indexer.wq_b.weight",
      ".ffn.shared_experts.w1.weight", ".ffn.shared_experts.w2.weight",
      ".ffn.shared_experts.w3.weight"};
  for (std::string_view s : kSuffixes)
    if (name.ends_with(s)) return true;
  return name.starts_with("mtp.") && (name.ends_with(".e_proj.weight") || name.ends_with(".h_proj.weight"));
}

bool released_as_f32(std::string_view name) {
  const size_t dot = name.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
  return last.starts_with("hc_") || name.ends_with(".attn_sink") || name.ends_with(".ape") ||
         name.ends_with(".ffn.gate.bias");
}

// One tensor of the output: a parameter's values in a released dtype, or an FP8 weight's scales.
struct OutTensor {
  enum Part { Values, Fp8Bytes, Fp8Scales } part = Values;
  std::string name;
  std::string dtype;
  Shape shape;
  const Param* param = nullptr;
  int64_t bytes() const { return shape_numel(shape) * safetensors_dtype_bits(dtype) / 8; }
};

int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

// The E8M0 scale byte of every 128x128 tile of a [rows, cols] fp32 matrix.
std::vector<uint8_t> fp8_tile_scales(const Param& p) {
  const int64_t rows = p.value.dim(0), cols = p.value.dim(1), tc = tiles(cols);
  std::vector<float> amax(static_cast<size_t>(tiles(rows) * tc), 0.0f);
  const float* w = p.w();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& m = amax[static_cast<size_t>((r / kTile) * tc + c / kTile)];
      m = std::max(m, std::fabs(w[r * cols + c]));  // a NaN element leaves the max as it was
    }
  std::vector<uint8_t> scales(amax.size());
  for (size_t i = 0; i < amax.size(); ++i) scales[i] = fp8_tile_scale_e8m0(amax[i]);
  return scales;
}

void append_fp8_bytes(const Param& p, SafetensorsStreamWriter& out) {
  const int64_t rows = p.value.dim(0), cols = p.value.dim(1), tc = tiles(cols);
  const std::vector<uint8_t> scales = fp8_tile_scales(p);
  Tensor row = Tensor::empty({cols}, DType::U8, MemCategory::Scratch);
  uint8_t* q = row.u8();
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = p.w() + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      // Division by a power of two is exact: the only rounding is E4M3's.
      const float s = mxfp4::e8m0_value(scales[static_cast<size_t>((r / kTile) * tc + c / kTile)]);
      q[c] = fp8_e4m3_encode(w[c] / s);
    }
    out.append(q, cols);
  }
}

void append_converted(const Param& p, const std::string& dtype, SafetensorsStreamWriter& out) {
  const int64_t n = p.value.numel();
  const float* v = p.w();
  if (dtype == "F32") {
    out.append(v, n * 4);
    return;
  }
  const int64_t width = dtype == "BF16" ? 2 : 8;
  Tensor buffer = Tensor::empty({std::min(n, kChunkElements) * width}, DType::U8,
                                MemCategory::Scratch);
  for (int64_t i0 = 0; i0 < n; i0 += kChunkElements) {
    const int64_t count = std::min(kChunkElements, n - i0);
    if (width == 2) {
      auto* h = reinterpret_cast<uint16_t*>(buffer.raw());
      for (int64_t k = 0; k < count; ++k) h[k] = f32_to_bf16(v[i0 + k]);
    } else {
      auto* ids = reinterpret_cast<int64_t*>(buffer.raw());
      for (int64_t k = 0; k < count; ++k) ids[k] = static_cast<int64_t>(v[i0 + k]);
    }
    out.append(buffer.raw(), count * width);
  }
}

void append_tensor(const OutTensor& t, SafetensorsStreamWriter& out) {
  const Param& p = *t.param;
  switch (t.part) {
    case OutTensor::Fp8Bytes:
      append_fp8_bytes(p, out);
      return;
    case OutTensor::Fp8Scales: {
      const std::vector<uint8_t> scales = fp8_tile_scales(p);
      out.append(scales.data(), static_cast<int64_t>(scales.size()));
      return;
    }
    case OutTensor::Values:
      if (p.packed())
        out.append(p.value.raw(), p.value.nbytes());  // MXFP4 bytes as they are
      else
        append_converted(p, t.dtype, out);
      return;
  }
}

// The released tensors of one parameter, checked.
void plan_param(const Param& p, const ModelConfig& cfg, const std::string& where,
                std::vector<OutTensor>& out) {
  MOE_CHECK(p.value.defined(), "{}: parameter '{}' has no value", where, p.name);
  if (is_routed_expert(p.name))
    MOE_CHECK(p.packed() == cfg.mxfp4_experts(),
              "{}: routed expert '{}' is {}, but the config's experts are {} (expert_format \"{}\")",
              where, p.name, p.packed() ? "packed (MXFP4)" : "fp32",
              cfg.mxfp4_experts() ? "packed" : "fp32", cfg.expert_format);
  switch (v4_released_format(p)) {
    case V4DiskFormat::Mxfp4: {
      const bool data = p.format == ParamFormat::Mxfp4Data;
      MOE_CHECK(p.value.dtype() == DType::U8 && p.value.ndim() == 2,
                "{}: packed parameter '{}' must be U8 [out, {}], got {} {}", where, p.name,
                data ? "in/2" : "in/32", dtype_name(p.value.dtype()), shape_str(p.value.shape()));
      out.push_back({OutTensor::Values, p.name, data ? "I8" : "F8_E8M0", p.value.shape(), &p});
      return;
    }
    case V4DiskFormat::Fp8: {
      MOE_CHECK(p.value.ndim() == 2, "{}: FP8 weight '{}' must be a matrix [out, in], got {}",
                where, p.name, shape_str(p.value.shape()));
      const int64_t rows = p.value.dim(0), cols = p.value.dim(1);
      out.push_back({OutTensor::Fp8Bytes, p.name, "F8_E4M3", p.value.shape(), &p});
      out.push_back({OutTensor::Fp8Scales, fp8_scale_name(p.name, Fp8ScaleKey::Scale), "F8_E8M0",
                     {tiles(rows), tiles(cols)}, &p});
      return;
    }
    case V4DiskFormat::Ids: {
      const float* v = p.w();
      for (int64_t i = 0; i < p.value.numel(); ++i)
        MOE_CHECK(v[i] == std::nearbyint(v[i]) && v[i] >= 0 &&
                      (p.id_bound <= 0 || v[i] < static_cast<float>(p.id_bound)),
                  "{}: id table '{}' holds {} at element {}, not an id in [0, {})", where, p.name,
                  v[i], i, p.id_bound);
      out.push_back({OutTensor::Values, p.name, "I64", p.value.shape(), &p});
      return;
    }
    case V4DiskFormat::F32:
      out.push_back({OutTensor::Values, p.name, "F32", p.value.shape(), &p});
      return;
    case V4DiskFormat::Bf16:
      out.push_back({OutTensor::Values, p.name, "BF16", p.value.shape(), &p});
      return;
  }
}

}  // namespace

const char* v4_disk_format_name(V4DiskFormat f) {
  switch (f) {
    case V4DiskFormat::Fp8: return "FP8";
    case V4DiskFormat::Mxfp4: return "MXFP4";
    case V4DiskFormat::F32: return "F32";
    case V4DiskFormat::Bf16: return "BF16";
    case V4DiskFormat::Ids: return "I64";
  }
  return "?";
}

V4DiskFormat v4_released_format(std::string_view name) {
  if (name.ends_with(".gate.tid2eid")) return V4DiskFormat::Ids;
  if (released_as_fp8(name) || is_routed_expert(name)) return V4DiskFormat::Fp8;
  if (released_as_f32(name)) return V4DiskFormat::F32;
  return V4DiskFormat::Bf16;
}

V4DiskFormat v4_released_format(const Param& p) {
  if (p.packed()) return V4DiskFormat::Mxfp4;
  if (p.id_bound > 0) return V4DiskFormat::Ids;
  return v4_released_format(std::string_view(p.name));
}

nlohmann::json v4_released_config_json(const ModelConfig& cfg) {
  MOE_CHECK(cfg.is_v4(), "the DeepSeek-V4 released layout needs model_type \"deepseek_v4\", got "
            "\"{}\"", cfg.model_type);
  ModelConfig written = cfg;
  written.torch_dtype = "bfloat16";
  nlohmann::json j = model_config_to_json(written);
  j["quantization_config"] = {{"activation_scheme", "dynamic"},
                              {"fmt", "e4m3"},
                              {"quant_method", "fp8"},
                              {"scale_fmt", "ue8m0"},
                              {"weight_block_size", {kTile, kTile}}};
  j["expert_dtype"] = cfg.mxfp4_experts() ? "fp4" : "fp8";
  return j;
}

V4SaveSummary save_v4_released(const fs::path& dir, const ModelConfig& cfg,
                               const ParamList& params, int64_t max_shard_bytes) {
  const std::string where = "save_v4_released " + dir.string();
  MOE_CHECK(max_shard_bytes > 0, "{}: max_shard_bytes must be positive, got {}", where,
            max_shard_bytes);
  // Before any file changes: the config must read back as this model.
  const nlohmann::json config = v4_released_config_json(cfg);
  const ModelConfig reread = parse_hf_config(config, (dir / kHfConfigFile).string());
  MOE_CHECK(reread.expert_format == cfg.expert_format,
            "internal: {} reads back with expert_format \"{}\", not \"{}\"", kHfConfigFile,
            reread.expert_format, cfg.expert_format);

  std::vector<OutTensor> tensors;
  V4SaveSummary summary;
  for (const Param* p : params) {
    MOE_CHECK(p != nullptr, "{}: a null parameter", where);
    plan_param(*p, cfg, where, tensors);
    switch (v4_released_format(*p)) {
      case V4DiskFormat::Fp8: ++summary.fp8; break;
      case V4DiskFormat::Mxfp4: summary.mxfp4 += p->format == ParamFormat::Mxfp4Data; break;
      case V4DiskFormat::F32: ++summary.f32; break;
      case V4DiskFormat::Bf16: ++summary.bf16; break;
      case V4DiskFormat::Ids: ++summary.ids; break;
    }
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const OutTensor& a, const OutTensor& b) { return a.name < b.name; });
  for (size_t i = 1; i < tensors.size(); ++i)
    MOE_CHECK(tensors[i].name != tensors[i - 1].name, "{}: tensor '{}' is given twice", where,
              tensors[i].name);

  // Greedy packing in name order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<const OutTensor*>> shards(1);
  int64_t shard_bytes = 0;
  for (const OutTensor& t : tensors) {
    if (t.bytes() > 0 && !shards.back().empty() && shard_bytes + t.bytes() > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&t);
    shard_bytes += t.bytes();
    summary.bytes += t.bytes();
  }
  std::vector<std::vector<std::string>> shard_tensors;
  for (const auto& shard : shards) {
    shard_tensors.emplace_back();
    for (const OutTensor* t : shard) shard_tensors.back().push_back(t->name);
  }
  write_weight_files(dir, shard_tensors, summary.bytes, [&](const fs::path& path, size_t shard) {
    std::vector<SafetensorsLayoutItem> layout;
    for (const OutTensor* t : shards[shard]) layout.push_back({t->name, t->dtype, t->shape});
    SafetensorsStreamWriter writer(path, layout, {{"format", "pt"}});
    for (const OutTensor* t : shards[shard]) append_tensor(*t, writer);
    writer.commit();
  });
  write_file_atomic(dir / kHfConfigFile, config.dump(2) + "\n");
  fsync_directory(dir);
  summary.files = static_cast<int64_t>(shards.size());
  return summary;
}

}  // namespace moe
