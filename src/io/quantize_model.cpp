#include "io/quantize_model.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"
#include "model/config.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kCopyChunk = int64_t{4} << 20;

// `model.layers.L.mlp.experts.M.{gate,up,down}_proj.weight` -> L, else nullopt.
std::optional<int64_t> routed_expert_layer(std::string_view name, const ModelConfig& cfg) {
  const std::string_view head = "model.layers.";
  if (!name.starts_with(head)) return std::nullopt;
  name.remove_prefix(head.size());
  int64_t layer = 0, expert = 0;
  auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), layer);
  if (ec != std::errc()) return std::nullopt;
  name.remove_prefix(static_cast<size_t>(p - name.data()));
  const std::string_view mid = ".mlp.experts.";
  if (!name.starts_with(mid)) return std::nullopt;
  name.remove_prefix(mid.size());
  auto [q, ec2] = std::from_chars(name.data(), name.data() + name.size(), expert);
  if (ec2 != std::errc()) return std::nullopt;
  name.remove_prefix(static_cast<size_t>(q - name.data()));
  if (name != ".gate_proj.weight" && name != ".up_proj.weight" && name != ".down_proj.weight")
    return std::nullopt;
  if (!cfg.is_moe_layer(layer) || expert < 0 || expert >= cfg.n_routed_experts) return std::nullopt;
  return layer;
}

std::string scale_name(const std::string& weight) {
  return weight.substr(0, weight.size() - std::string_view(".weight").size()) + ".scale";
}

// Input weight files in the order the index first names them (or the single file).
std::vector<std::string> weight_files(const fs::path& dir) {
  if (fs::is_regular_file(dir / kSafetensorsSingleFile)) return {kSafetensorsSingleFile};
  const fs::path index = dir / kSafetensorsIndexFile;
  std::ifstream in(index, std::ios::binary);
  MOE_CHECK(in.good(), "{}: no model weights ({} or {})", dir.string(), kSafetensorsSingleFile,
            kSafetensorsIndexFile);
  std::stringstream text;
  text << in.rdbuf();
  const auto j = nlohmann::ordered_json::parse(text.str(), nullptr, false);
  MOE_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
            "{}: not a safetensors index (no weight_map object)", index.string());
  std::vector<std::string> files;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    MOE_CHECK(file.is_string(), "{}: weight_map['{}'] must be a file name", index.string(), tensor);
    const std::string f = file.get<std::string>();
    if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
  }
  return files;
}

struct ErrorSums {
  double err2 = 0, ref2 = 0, max_abs = 0;
  int64_t matrices = 0, weights = 0;
};

// One expert matrix, row by row: fp32 row -> packed row (+ its error against the input).
void quantize_matrix(const SafetensorsReader& reader, const SafetensorsEntry& e,
                     SafetensorsStreamWriter& out, ErrorSums& sums) {
  MOE_CHECK(e.shape.size() == 2 && e.shape[1] % mxfp4::kBlock == 0,
            "{}: expert tensor '{}' has shape {}; MXFP4 needs [out, in] with in divisible by 32",
            reader.path().string(), e.name, shape_str(e.shape));
  MOE_CHECK(e.dtype == "F32" || e.dtype == "BF16",
            "{}: expert tensor '{}' has dtype {}; only F32 and BF16 experts can be quantized",
            reader.path().string(), e.name, e.dtype);
  const int64_t rows = e.shape[0], cols = e.shape[1], B = mxfp4::kBlock;
  // The packed matrix is what this routine holds: 0.53 bytes per weight, charged to Scratch.
  Tensor packed = Tensor::empty({rows, cols / 2}, DType::U8, MemCategory::Scratch);
  Tensor scales = Tensor::empty({rows, cols / B}, DType::U8, MemCategory::Scratch);
  std::vector<float> row(static_cast<size_t>(cols)), back(static_cast<size_t>(cols));
  std::vector<uint16_t> raw(e.dtype == "BF16" ? static_cast<size_t>(cols) : 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (raw.empty()) {
      reader.read_bytes(e, r * cols * 4, cols * 4, row.data());
    } else {
      reader.read_bytes(e, r * cols * 2, cols * 2, raw.data());
      for (int64_t j = 0; j < cols; ++j) row[static_cast<size_t>(j)] = bf16_to_f32(raw[static_cast<size_t>(j)]);
    }
    uint8_t* p = packed.u8() + r * (cols / 2);
    uint8_t* s = scales.u8() + r * (cols / B);
    mxfp4::quantize_row(row.data(), cols, p, s);
    mxfp4::dequantize_row(p, s, cols, back.data());
    for (int64_t j = 0; j < cols; ++j) {
      const double v = row[static_cast<size_t>(j)], d = v - back[static_cast<size_t>(j)];
      sums.err2 += d * d;
      sums.ref2 += v * v;
      sums.max_abs = std::max(sums.max_abs, std::abs(d));
    }
  }
  out.append(packed.raw(), packed.nbytes());
  out.append(scales.raw(), scales.nbytes());
  ++sums.matrices;
  sums.weights += rows * cols;
}

void copy_tensor(const SafetensorsReader& reader, const SafetensorsEntry& e,
                 SafetensorsStreamWriter& out) {
  std::vector<char> buffer(static_cast<size_t>(std::min(kCopyChunk, std::max<int64_t>(e.nbytes(), 1))));
  for (int64_t at = 0; at < e.nbytes(); at += kCopyChunk) {
    const int64_t n = std::min(kCopyChunk, e.nbytes() - at);
    reader.read_bytes(e, at, n, buffer.data());
    out.append(buffer.data(), n);
  }
}

}  // namespace

QuantizeReport quantize_model_experts(const fs::path& in, const fs::path& out,
                                      const std::function<void(const QuantizeLayerStats&)>& on_layer) {
  ModelConfig cfg = read_hf_config(in);
  MOE_CHECK(!cfg.mxfp4_experts(), "{}: the routed experts are already MXFP4 (config.json "
            "quantization_config)", in.string());
  MOE_CHECK(cfg.n_routed_experts > 0, "{}: the model has no routed experts to quantize",
            in.string());
  cfg.expert_format = "mxfp4";
  cfg.validate((in / kHfConfigFile).string());  // dims divisible by 32
  MOE_CHECK(fs::absolute(in).lexically_normal() != fs::absolute(out).lexically_normal(),
            "--out must differ from --model ({})", in.string());
  std::error_code ec;
  MOE_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
            "{}: already exists and is not an empty directory; choose a new --out", out.string());
  fs::create_directories(out);

  QuantizeReport report;
  std::map<int64_t, ErrorSums> per_layer;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  int64_t total_size = 0;
  const std::vector<std::string> files = weight_files(in);
  for (const std::string& file : files) {
    const SafetensorsReader reader(in / file);
    std::vector<SafetensorsLayoutItem> layout;
    for (const SafetensorsEntry& e : reader.entries()) {
      if (routed_expert_layer(e.name, cfg)) {
        const int64_t rows = e.shape.size() == 2 ? e.shape[0] : 0;
        const int64_t cols = e.shape.size() == 2 ? e.shape[1] : 0;
        layout.push_back({e.name, "I8", {rows, cols / 2}});
        layout.push_back({scale_name(e.name), "F8_E8M0", {rows, cols / mxfp4::kBlock}});
      } else {
        layout.push_back({e.name, e.dtype, e.shape});
      }
    }
    for (const auto& item : layout) {
      weight_map[item.name] = file;
      total_size += shape_numel(item.shape) * safetensors_dtype_bits(item.dtype) / 8;
    }
    SafetensorsStreamWriter writer(out / file, layout, reader.metadata());
    for (const SafetensorsEntry& e : reader.entries()) {
      if (const auto layer = routed_expert_layer(e.name, cfg)) {
        quantize_matrix(reader, e, writer, per_layer[*layer]);
        report.expert_bytes_in += e.nbytes();
        report.expert_bytes_out += e.shape[0] * e.shape[1] / 2 + e.shape[0] * e.shape[1] / mxfp4::kBlock;
      } else {
        copy_tensor(reader, e, writer);
      }
    }
    writer.commit();
    ++report.files;
  }
  if (files.size() > 1 || !fs::is_regular_file(in / kSafetensorsSingleFile)) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total_size}}},
                                          {"weight_map", weight_map}};
    write_file_atomic(out / kSafetensorsIndexFile, index.dump(2) + "\n");
  }
  // The tokenizer and other side files travel along; weights and training state do not.
  for (const auto& entry : fs::directory_iterator(in)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name.ends_with(".safetensors") ||
        name == kSafetensorsIndexFile || name == kHfConfigFile || name == "trainer.json")
      continue;
    std::ifstream src(entry.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << src.rdbuf();
    write_file_atomic(out / name, bytes.str());
  }
  write_hf_config(out, cfg);
  fsync_directory(out);

  for (const auto& [layer, s] : per_layer) {
    QuantizeLayerStats st;
    st.layer = layer;
    st.matrices = s.matrices;
    st.weights = s.weights;
    st.rel_rms_error = s.ref2 > 0 ? std::sqrt(s.err2 / s.ref2) : 0.0;
    st.max_abs_error = s.max_abs;
    report.layers.push_back(st);
    if (on_layer) on_layer(st);
  }
  return report;
}

}  // namespace moe
