#include "io/convert_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/fp8.h"
#include "io/hf_config.h"
#include "io/inspect.h"
#include "io/safetensors.h"
#include "io/v4_checkpoint.h"
#include "kernels/mxfp4.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kCopyChunk = int64_t{4} << 20;

// The layer of a tensor: model.layers.L.* (V2/V3), layers.L.* or mtp.0.* (V4: the layer after
// the last); -1 for the others.
int64_t layer_of(const std::string& name, const ModelConfig& cfg) {
  if (cfg.is_v4() && name.starts_with("mtp.")) return cfg.num_hidden_layers;
  const std::string_view head = cfg.is_v4() ? "layers." : "model.layers.";
  if (!std::string_view(name).starts_with(head)) return -1;
  int64_t layer = -1;
  std::from_chars(name.data() + head.size(), name.data() + name.size(), layer);
  return layer;
}

// Tensors DeepSeek ships in F32 stay F32 when the rest becomes bf16: the router's bias only ranks
// experts, and V4's hyper-connection mixes, attention sinks and compressor position biases are
// small F32 tensors in every release.
bool kept_f32(const std::string& name, const ModelConfig& cfg) {
  if (cfg.is_v4()) return v4_released_format(std::string_view(name)) == V4DiskFormat::F32;
  return name.ends_with("e_score_correction_bias");
}

// One unit of output: one tensor, or an MXFP4 pair (weight + scale, written together).
struct Job {
  enum Kind { Copy, Convert, Quantize, Vector } kind;
  std::string input;                         // the input tensor (the weight of a pair)
  std::vector<SafetensorsLayoutItem> items;  // what it writes, in order
  std::unique_ptr<WeightRows> rows{};        // Convert / Quantize
  std::string out_dtype;                     // Convert / Vector: "F32" or "BF16"
  bool expert = false;
  int64_t bytes() const {
    int64_t b = 0;
    for (const auto& i : items) b += shape_numel(i.shape) * safetensors_dtype_bits(i.dtype) / 8;
    return b;
  }
};

struct ErrorSums {
  double err2 = 0, ref2 = 0, max_abs = 0;
  int64_t matrices = 0, weights = 0;
};

void append_row(SafetensorsStreamWriter& out, const float* row, int64_t n, const std::string& dtype,
                std::vector<uint16_t>& half) {
  if (dtype == "F32") {
    out.append(row, n * 4);
    return;
  }
  half.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) half[static_cast<size_t>(j)] = f32_to_bf16(row[j]);
  out.append(half.data(), n * 2);
}

void copy_bytes(const SafetensorsReader& reader, const SafetensorsEntry& e,
                SafetensorsStreamWriter& out) {
  std::vector<char> buffer(static_cast<size_t>(std::min(kCopyChunk, std::max<int64_t>(e.nbytes(), 1))));
  for (int64_t at = 0; at < e.nbytes(); at += kCopyChunk) {
    const int64_t n = std::min(kCopyChunk, e.nbytes() - at);
    reader.read_bytes(e, at, n, buffer.data());
    out.append(buffer.data(), n);
  }
}

}  // namespace

void copy_side_files(const fs::path& in, const fs::path& out) {
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
}


void check_new_output_dir(const fs::path& in, const fs::path& out) {
  MOE_CHECK(fs::absolute(in).lexically_normal() != fs::absolute(out).lexically_normal(),
            "--out must differ from --model ({})", in.string());
  std::error_code ec;
  MOE_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
            "{}: already exists and is not an empty directory; choose a new --out", out.string());
}

ConvertReport convert_model(const fs::path& in, const fs::path& out, const ConvertOptions& opt,
                            const std::function<void(const QuantizeLayerStats&)>& on_layer) {
  MOE_CHECK(opt.dtype == "bf16" || opt.dtype == "f32" || opt.dtype == "keep",
            "--dtype must be bf16 or f32, got '{}'", opt.dtype);
  MOE_CHECK(opt.experts == "mxfp4" || opt.experts == "bf16" || opt.experts == "f32",
            "--experts must be mxfp4, bf16 or f32, got '{}'", opt.experts);
  const ModelConfig cfg = read_hf_config(in);
  const HfWeightsInfo info = read_hf_weights_info(in);
  ModelConfig out_cfg = cfg;
  out_cfg.expert_format = opt.experts == "mxfp4" && cfg.n_routed_experts > 0 ? "mxfp4" : "fp32";
  if (opt.dtype != "keep") out_cfg.torch_dtype = opt.dtype == "bf16" ? "bfloat16" : "float32";
  out_cfg.validate((in / kHfConfigFile).string());  // MXFP4 needs dims divisible by 32
  check_new_output_dir(in, out);

  const SafetensorsSet weights(in);
  const Fp8Block block = info.fp8_block();
  const std::string dense_dtype = opt.dtype == "bf16" ? "BF16" : "F32";  // "keep": see below
  const std::string expert_dtype = opt.experts == "bf16" ? "BF16" : "F32";
  ConvertReport report;

  // ---- Plan and check everything before writing anything.
  std::vector<Job> jobs;
  std::set<std::string> used;  // input tensors consumed (weights and their scales)
  std::vector<std::string> missing;
  for (const ExpectedTensor& x : expected_tensors(cfg)) {
    const SafetensorsReader* reader = weights.find(x.name);
    if (reader == nullptr) {
      if (!x.optional) missing.push_back(x.name);
      continue;
    }
    const SafetensorsEntry& e = reader->entry(x.name);
    const std::string file = reader->path().string();
    used.insert(x.name);
    Job job;
    job.input = x.name;
    job.expert = x.routed_expert();
    if (x.ids) {
      MOE_CHECK(e.shape == x.shape && (e.dtype == "I64" || e.dtype == "I32"),
                "{}: tensor '{}' is {} {}; the model needs an I64 (or I32) id table {}", file,
                x.name, e.dtype, shape_str(e.shape), shape_str(x.shape));
      job.kind = Job::Copy;
      job.items.push_back({x.name, e.dtype, e.shape});
      jobs.push_back(std::move(job));
      continue;
    }
    if (!x.matrix) {
      MOE_CHECK(e.shape == x.shape && (e.dtype == "F32" || e.dtype == "BF16"),
                "{}: tensor '{}' is {} {}; the model needs F32 or BF16 {}", file, x.name, e.dtype,
                shape_str(e.shape), shape_str(x.shape));
      const bool keep = opt.dtype == "keep" || e.dtype == dense_dtype ||
                        (kept_f32(x.name, cfg) && e.dtype == "F32");
      job.kind = keep ? Job::Copy : Job::Vector;
      job.out_dtype = keep ? e.dtype : dense_dtype;
      job.items.push_back({x.name, job.out_dtype, e.shape});
      jobs.push_back(std::move(job));
      continue;
    }
    job.rows = std::make_unique<WeightRows>(weights, x.name, block);  // checks dtype and scales
    WeightRows& rows = *job.rows;
    const Shape got = {rows.rows(), rows.cols()};
    MOE_CHECK(got == x.shape, "{}: tensor '{}' holds a {} matrix {}, the model expects {}", file,
              x.name, weight_encoding_name(rows.encoding()), shape_str(got), shape_str(x.shape));
    if (!rows.scale_name().empty()) used.insert(rows.scale_name());
    const WeightEncoding enc = rows.encoding();
    if (job.expert && opt.experts == "mxfp4") {
      const Shape data = {x.shape[0], x.shape[1] / 2}, scales = {x.shape[0], x.shape[1] / 32};
      job.items = {{x.name, "I8", data}, {mxfp4_scale_name(x.name), "F8_E8M0", scales}};
      job.kind = enc == WeightEncoding::Mxfp4 ? Job::Copy : Job::Quantize;
    } else {
      MOE_CHECK(job.expert || enc != WeightEncoding::Mxfp4,
                "{}: tensor '{}' is MXFP4-packed, but only routed experts can be", file, x.name);
      std::string dtype = job.expert ? expert_dtype : dense_dtype;
      if (!job.expert && opt.dtype == "keep")
        dtype = enc == WeightEncoding::BF16 ? "BF16" : "F32";
      const bool same = (enc == WeightEncoding::F32 && dtype == "F32") ||
                        (enc == WeightEncoding::BF16 && dtype == "BF16");
      job.kind = same ? Job::Copy : Job::Convert;
      job.out_dtype = dtype;
      job.items.push_back({x.name, dtype, x.shape});
    }
    if (job.kind == Job::Copy) job.rows.reset();
    jobs.push_back(std::move(job));
  }
  if (!missing.empty())
    fail("{}: the model weights have no tensor '{}'{}", in.string(), missing.front(),
         missing.size() > 1 ? fmt::format(" (and {} more missing)", missing.size() - 1) : "");
  // What the model does not use: MTP layers are left out, anything else is copied.
  std::vector<std::string> unknown;
  for (const std::string& name : weights.names()) {
    if (used.contains(name)) continue;
    if (info.mtp_layer_of(name) >= 0) {
      ++report.mtp_dropped;
      continue;
    }
    unknown.push_back(name);
    Job job;
    job.kind = Job::Copy;
    job.input = name;
    const SafetensorsEntry& e = weights.reader_for(name).entry(name);
    job.items.push_back({name, e.dtype, e.shape});
    jobs.push_back(std::move(job));
  }
  report.copied_unknown = static_cast<int64_t>(unknown.size());
  if (report.mtp_dropped > 0)
    report.notices.push_back(fmt::format(
        "left out the multi-token-prediction layer{} model.layers.{}.* ({} tensors): moe does not "
        "use {}", info.num_nextn_predict_layers == 1 ? "" : "s", cfg.num_hidden_layers,
        report.mtp_dropped, info.num_nextn_predict_layers == 1 ? "it" : "them"));
  if (!unknown.empty())
    report.notices.push_back(fmt::format("copied {} tensor{} the model does not use, as {} (e.g. "
                                         "'{}')", unknown.size(), unknown.size() == 1 ? "" : "s",
                                         unknown.size() == 1 ? "it is" : "they are",
                                         unknown.front()));

  // ---- Output files.
  std::vector<std::pair<std::string, std::vector<Job*>>> files;
  if (opt.max_shard_bytes <= 0) {
    // Each job in the file of its (first) input tensor, under that file's name.
    const SafetensorsIndex index = read_safetensors_index(in);
    std::map<std::string, std::string, std::less<>> file_by_tensor(index.weight_map.begin(),
                                                                   index.weight_map.end());
    for (const std::string& f : index.files) {
      std::vector<Job*> part;
      for (Job& j : jobs)
        if ((index.sharded ? file_by_tensor.at(j.input) : f) == f) part.push_back(&j);
      if (!part.empty()) files.emplace_back(f, std::move(part));
    }
  } else {
    std::vector<std::vector<Job*>> shards(1);
    int64_t bytes = 0;
    for (Job& j : jobs) {
      if (!shards.back().empty() && bytes + j.bytes() > opt.max_shard_bytes) {
        shards.emplace_back();
        bytes = 0;
      }
      shards.back().push_back(&j);
      bytes += j.bytes();
    }
    for (size_t i = 0; i < shards.size(); ++i)
      files.emplace_back(shards.size() == 1 ? std::string(kSafetensorsSingleFile)
                                            : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                          i + 1, shards.size()),
                         std::move(shards[i]));
  }
  const bool single = files.size() == 1 && files.front().first == kSafetensorsSingleFile;

  fs::create_directories(out);
  std::map<int64_t, ErrorSums> per_layer;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  int64_t total_size = 0;
  std::vector<float> row, back;
  std::vector<uint16_t> half;
  for (auto& [file, part] : files) {
    std::vector<SafetensorsLayoutItem> layout;
    for (const Job* j : part)
      for (const auto& item : j->items) {
        layout.push_back(item);
        weight_map[item.name] = file;
        total_size += shape_numel(item.shape) * safetensors_dtype_bits(item.dtype) / 8;
      }
    SafetensorsStreamWriter writer(out / file, layout, {{"format", "pt"}});
    for (Job* j : part) {
      int64_t in_bytes = 0;
      if (j->rows) {
        in_bytes = j->rows->disk_bytes();
      } else if (j->kind == Job::Vector) {
        in_bytes = weights.reader_for(j->input).entry(j->input).nbytes();
      } else {
        for (const auto& item : j->items)
          in_bytes += weights.reader_for(item.name).entry(item.name).nbytes();
      }
      switch (j->kind) {
        case Job::Copy:
          for (const auto& item : j->items) {
            const SafetensorsReader& r = weights.reader_for(item.name);
            copy_bytes(r, r.entry(item.name), writer);
          }
          break;
        case Job::Vector: {
          const SafetensorsReader& r = weights.reader_for(j->input);
          const SafetensorsEntry& e = r.entry(j->input);
          const int64_t n = shape_numel(e.shape);
          row.resize(static_cast<size_t>(n));
          if (e.dtype == "F32") {
            r.read_bytes(e, 0, n * 4, row.data());
          } else {
            half.resize(static_cast<size_t>(n));
            r.read_bytes(e, 0, n * 2, half.data());
            for (int64_t i = 0; i < n; ++i) row[static_cast<size_t>(i)] = bf16_to_f32(half[static_cast<size_t>(i)]);
          }
          append_row(writer, row.data(), n, j->out_dtype, half);
          break;
        }
        case Job::Convert: {
          WeightRows& w = *j->rows;
          row.resize(static_cast<size_t>(w.cols()));
          for (int64_t r = 0; r < w.rows(); ++r) {
            w.row(r, row.data());
            append_row(writer, row.data(), w.cols(), j->out_dtype, half);
          }
          break;
        }
        case Job::Quantize: {
          WeightRows& w = *j->rows;
          const int64_t rows = w.rows(), cols = w.cols(), B = mxfp4::kBlock;
          MOE_CHECK(cols % B == 0, "{}: expert tensor '{}' has {} columns; MXFP4 needs a multiple "
                    "of 32", in.string(), j->input, cols);
          // Packed rows go out at once; only the matrix's scales wait (1/128 of fp32).
          Tensor scales = Tensor::empty({rows, cols / B}, DType::U8, MemCategory::Scratch);
          std::vector<uint8_t> packed(static_cast<size_t>(cols / 2));
          row.resize(static_cast<size_t>(cols));
          back.resize(static_cast<size_t>(cols));
          ErrorSums& sums = per_layer[layer_of(j->input, cfg)];
          for (int64_t r = 0; r < rows; ++r) {
            w.row(r, row.data());
            uint8_t* s = scales.u8() + r * (cols / B);
            mxfp4::quantize_row(row.data(), cols, packed.data(), s);
            mxfp4::dequantize_row(packed.data(), s, cols, back.data());
            for (int64_t c = 0; c < cols; ++c) {
              const double v = row[static_cast<size_t>(c)], d = v - back[static_cast<size_t>(c)];
              sums.err2 += d * d;
              sums.ref2 += v * v;
              sums.max_abs = std::max(sums.max_abs, std::abs(d));
            }
            writer.append(packed.data(), cols / 2);
          }
          writer.append(scales.raw(), scales.nbytes());
          ++sums.matrices;
          sums.weights += rows * cols;
          break;
        }
      }
      if (j->rows) {
        report.fp8_dequantized += j->rows->encoding() == WeightEncoding::Fp8;
        j->rows.reset();  // its buffers go with it
      }
      report.bytes_in += in_bytes;
      report.bytes_out += j->bytes();
      report.tensors += static_cast<int64_t>(j->items.size());
      if (j->expert) {
        report.expert_bytes_in += in_bytes;
        report.expert_bytes_out += j->bytes();
      }
    }
    writer.commit();
    ++report.files;
  }
  if (!single) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total_size}}},
                                          {"weight_map", weight_map}};
    write_file_atomic(out / kSafetensorsIndexFile, index.dump(2) + "\n");
  }
  copy_side_files(in, out);
  write_hf_config(out, out_cfg);
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
