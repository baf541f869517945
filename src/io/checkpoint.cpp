#include "io/checkpoint.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/limits.h"
#include "io/atomic_file.h"
#include "io/fp8.h"
#include "io/hf_config.h"
#include "io/safetensors.h"

namespace moe {

namespace {

namespace fs = std::filesystem;

bool optional_in_checkpoint(std::string_view name) {
  return name.ends_with("mlp.gate.e_score_correction_bias");
}

// Shard files named by an existing index, so a new save can delete the ones it no longer uses.
// An unreadable old index names nothing: stale files are left rather than guessed at.
std::set<std::string> indexed_shards(const fs::path& index) {
  std::set<std::string> shards;
  std::ifstream in(index, std::ios::binary);
  if (!in.good()) return shards;
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str(), json_depth_limit<nlohmann::json>(index.string()),
                              /*allow_exceptions=*/false);
  } catch (const Error&) {
    return shards;
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) return shards;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string()) continue;
    const fs::path p(file.get<std::string>());
    if (p.has_filename() && p == p.filename()) shards.insert(p.string());
  }
  return shards;
}

const SafetensorsMetadata kWeightsMetadata{{"format", "pt"}};

// Packed MXFP4 tensors keep their on-disk dtypes (SPEC §5) and id tables their I64; everything
// else takes the save's.
std::string file_dtype_of(const Param& p, const std::string& weights_dtype) {
  switch (p.format) {
    case ParamFormat::Mxfp4Data: return "I8";
    case ParamFormat::Mxfp4Scales: return "F8_E8M0";
    case ParamFormat::F32: break;
  }
  if (p.id_bound > 0) return "I64";  // an id table (V4's tid2eid), as released
  return weights_dtype;
}

std::string shard_file_name(int64_t shard, int64_t shards) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", shard, shards);
}

ModelConfig config_as_saved(const fs::path& dir, const ModelConfig& cfg, DType dtype) {
  MOE_CHECK(dtype == DType::F32 || dtype == DType::BF16,
            "save_model: weights are saved as F32 or BF16, not {}", dtype_name(dtype));
  ModelConfig written = cfg;
  written.torch_dtype = dtype == DType::BF16 ? "bfloat16" : "float32";
  written.validate((dir / kHfConfigFile).string());
  return written;
}

void create_model_dir(const fs::path& dir) {
  std::error_code ec;
  const bool created = fs::create_directories(dir, ec);
  MOE_CHECK(!ec && fs::is_directory(dir), "{}: cannot create the model directory: {}",
            dir.string(), ec ? ec.message() : "a file of that name exists");
  if (created) {
    fs::path absolute = fs::absolute(dir).lexically_normal();
    if (!absolute.has_filename()) absolute = absolute.parent_path();  // "dir/" names dir itself
    fsync_directory(absolute.parent_path());
  }
}

void write_index(const fs::path& index_path, const nlohmann::json& weight_map,
                 int64_t total_bytes) {
  const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                                {"weight_map", weight_map}};
  write_file_atomic(index_path, index.dump(2) + "\n");
}

void remove_file(const fs::path& path) {
  std::error_code ec;
  fs::remove(path, ec);
  MOE_CHECK(!ec, "{}: cannot remove stale weight file: {}", path.string(), ec.message());
}

}  // namespace

namespace {

bool is_byte_dtype(const std::string& dtype) { return dtype == "I8" || dtype == "U8"; }

// Integer id tables (Param::id_bound > 0: DeepSeek-V4's gate.tid2eid, I64 as released, or I32)
// are read in chunks of this many entries: the transient buffer stays small whatever the vocab.
constexpr int64_t kIdChunk = 1 << 14;

// Calls f(first index, values, count) for consecutive chunks of an I64 / I32 tensor, as int64.
template <typename F>
void for_each_id_chunk(const SafetensorsReader& reader, const SafetensorsEntry& e, F&& f) {
  const int64_t width = e.dtype == "I64" ? 8 : 4, n = e.nbytes() / width;
  std::vector<int64_t> wide(static_cast<size_t>(std::min(n, kIdChunk)));
  std::vector<int32_t> narrow(width == 4 ? wide.size() : 0);
  for (int64_t i0 = 0; i0 < n; i0 += kIdChunk) {
    const int64_t count = std::min(kIdChunk, n - i0);
    if (width == 8) {
      reader.read_bytes(e, i0 * 8, count * 8, wide.data());
    } else {
      reader.read_bytes(e, i0 * 4, count * 4, narrow.data());
      for (int64_t k = 0; k < count; ++k) wide[static_cast<size_t>(k)] = narrow[static_cast<size_t>(k)];
    }
    f(i0, wide.data(), count);
  }
}

// Every id of the table in [0, bound), checked before any parameter is written.
void check_ids(const SafetensorsReader& reader, const SafetensorsEntry& e, const Param& p) {
  const int64_t cols = e.shape.empty() ? 1 : e.shape.back();
  for_each_id_chunk(reader, e, [&](int64_t i0, const int64_t* v, int64_t count) {
    for (int64_t k = 0; k < count; ++k)
      MOE_CHECK(v[k] >= 0 && v[k] < p.id_bound,
                "{}: tensor '{}' holds {} at [{}, {}], outside the valid ids [0, {})",
                reader.path().string(), p.name, v[k], (i0 + k) / cols, (i0 + k) % cols,
                p.id_bound);
  });
}

// How one checkpoint tensor reaches its parameter.
struct Source {
  enum Kind { Copy, Zero, Rows, Quantize, Ids } kind;
  Param* param;
  const SafetensorsReader* reader = nullptr;
  Param* scales = nullptr;             // Quantize: the pair's scale parameter, filled with it
  std::unique_ptr<WeightRows> rows{};  // Rows / Quantize: the decoded on-disk rows
};

// Notices go to stderr once per job: under mpirun only rank 0 prints them.
bool prints_notices() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(var)) return std::string_view(v) == "0";
  return true;
}

std::string mtp_notice(const SafetensorsSet& weights, const HfWeightsInfo& info,
                       int64_t* count) {
  std::set<int64_t> layers;
  *count = 0;
  if (info.num_nextn_predict_layers <= 0) return {};
  for (const std::string& name : weights.names()) {
    const int64_t layer = info.mtp_layer_of(name);
    if (layer < 0) continue;
    layers.insert(layer);
    ++*count;
  }
  if (layers.empty()) return {};
  std::string which;
  for (int64_t l : layers) which += fmt::format("{}model.layers.{}", which.empty() ? "" : ", ", l);
  return fmt::format("note: {}: skipping the multi-token-prediction layer{} {} ({} tensors, "
                     "num_nextn_predict_layers = {}): moe does not use it", weights.dir().string(),
                     layers.size() == 1 ? "" : "s", which, *count, info.num_nextn_predict_layers);
}

}  // namespace

LoadSummary load_weights(const SafetensorsSet& weights, const ParamList& params) {
  const HfWeightsInfo info = read_hf_weights_info(weights.dir());
  const Fp8Block block = info.fp8_block();
  std::map<std::string_view, Param*> by_name;
  for (Param* p : params) {
    MOE_CHECK(p != nullptr && p->value.defined(), "load_weights: parameter '{}' has no value",
              p ? p->name : "?");
    by_name[p->name] = p;
  }
  std::vector<Source> sources;
  sources.reserve(params.size());
  std::vector<std::string_view> missing;
  std::set<const Param*> filled_by_pair;
  for (Param* p : params) {
    if (p->format == ParamFormat::Mxfp4Scales) continue;  // with its weight, below
    Param* scales = nullptr;
    if (p->format == ParamFormat::Mxfp4Data) {
      const auto sit = by_name.find(mxfp4_scale_name(p->name));
      MOE_CHECK(sit != by_name.end() && sit->second->format == ParamFormat::Mxfp4Scales,
                "internal: MXFP4 weight '{}' has no scale parameter '{}'", p->name,
                mxfp4_scale_name(p->name));
      scales = sit->second;
      filled_by_pair.insert(scales);  // even when the weight turns out to be missing
    }
    const SafetensorsReader* reader = weights.find(p->name);
    if (reader == nullptr) {
      if (optional_in_checkpoint(p->name))
        sources.push_back({Source::Zero, p});
      else
        missing.push_back(p->name);
      continue;
    }
    const SafetensorsEntry& e = reader->entry(p->name);
    const std::string file = reader->path().string();
    if (p->format == ParamFormat::F32) {
      MOE_CHECK(p->value.dtype() == DType::F32,
                "load_weights: parameter '{}' needs an allocated F32 value", p->name);
      const bool coded = e.dtype == "F8_E4M3" || is_byte_dtype(e.dtype);
      MOE_CHECK(!coded || (p->value.ndim() == 2 && p->id_bound == 0),
                "{}: tensor '{}' has dtype {}, but only a weight matrix can be stored as FP8 or "
                "MXFP4; the model expects {} {}", file, p->name, e.dtype,
                p->id_bound > 0 ? "I64 (or I32) ids" : "F32 (or BF16)",
                shape_str(p->value.shape()));
      if (is_byte_dtype(e.dtype)) {
        // Packed MXFP4 into an fp32 parameter (the model keeps its experts in fp32): decoded
        // row by row; WeightRows checks the scale.
        auto rows = std::make_unique<WeightRows>(weights, p->name, block);
        const Shape unpacked_shape = {rows->rows(), rows->cols()};
        MOE_CHECK(unpacked_shape == p->value.shape(),
                  "{}: packed tensor '{}' has shape {} (an MXFP4 matrix {}), the model expects {} "
                  "([out, in/2] bytes = {})", file, p->name, shape_str(e.shape),
                  shape_str(unpacked_shape), shape_str(p->value.shape()),
                  shape_str({p->value.dim(0), p->value.dim(1) / 2}));
        sources.push_back({Source::Rows, p, reader, nullptr, std::move(rows)});
        continue;
      }
      MOE_CHECK(e.shape == p->value.shape(), "{}: tensor '{}' has shape {}, the model expects {}",
                file, p->name, shape_str(e.shape), shape_str(p->value.shape()));
      if (e.dtype == "F8_E4M3") {
        sources.push_back({Source::Rows, p, reader, nullptr,
                           std::make_unique<WeightRows>(weights, p->name, block)});
        continue;
      }
      if (p->id_bound > 0 && (e.dtype == "I64" || e.dtype == "I32")) {
        // Ids are small integers: exact in fp32 (the bound is an expert count).
        MOE_CHECK(p->id_bound <= (int64_t{1} << 24), "internal: '{}' bound {} is not exact in "
                  "fp32", p->name, p->id_bound);
        check_ids(*reader, e, *p);
        sources.push_back({Source::Ids, p, reader});
        continue;
      }
      MOE_CHECK(e.dtype == "F32" || e.dtype == "BF16",
                "{}: tensor '{}' has dtype {}; {}", file, p->name, e.dtype,
                p->id_bound > 0 ? std::string("an id table loads from I64 or I32")
                : p->value.ndim() == 2
                    ? fmt::format("a weight matrix loads from F32, BF16, F8_E4M3 (with its {}) or "
                                  "MXFP4 (I8 with its {})",
                                  fp8_scale_name(p->name, block.scale_key),
                                  mxfp4_scale_name(p->name))
                    : std::string("expected F32 (or BF16)"));
      sources.push_back({Source::Copy, p, reader});
      continue;
    }
    // An MXFP4 pair: packed bytes + scales copied as they are, or F32/BF16/FP8 quantized here.
    const std::string& scale_key = scales->name;
    const Shape unpacked = {p->value.dim(0), p->value.dim(1) * 2};
    if (is_byte_dtype(e.dtype)) {
      MOE_CHECK(e.shape == p->value.shape(),
                "{}: packed tensor '{}' has shape {}, the model expects {} ([out, in/2] bytes)",
                file, p->name, shape_str(e.shape), shape_str(p->value.shape()));
      const SafetensorsReader* sreader = weights.find(scale_key);
      // Never an implicit scale of 1: the bytes mean nothing without their block scales.
      MOE_CHECK(sreader != nullptr,
                "{}: MXFP4 weight '{}' ({}) has no scale tensor '{}' (F8_E8M0 {}) in {}; packed "
                "weights cannot be used without their block scales", file, p->name, e.dtype,
                scale_key, shape_str(scales->value.shape()), weights.dir().string());
      const SafetensorsEntry& se = sreader->entry(scale_key);
      MOE_CHECK(se.dtype == "F8_E8M0" || se.dtype == "U8",
                "{}: scale tensor '{}' has dtype {}, expected F8_E8M0", sreader->path().string(),
                scale_key, se.dtype);
      MOE_CHECK(se.shape == scales->value.shape(),
                "{}: scale tensor '{}' has shape {}, the model expects {} ([out, in/32])",
                sreader->path().string(), scale_key, shape_str(se.shape),
                shape_str(scales->value.shape()));
      sources.push_back({Source::Copy, p, reader});
      sources.push_back({Source::Copy, scales, sreader});
    } else {
      MOE_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F8_E4M3",
                "{}: tensor '{}' has dtype {}; an MXFP4 expert loads from I8 + F8_E8M0 scales, "
                "or from F32/BF16/F8_E4M3 (quantized on load)", file, p->name, e.dtype);
      MOE_CHECK(e.shape == unpacked, "{}: tensor '{}' has shape {}, the model expects {}", file,
                p->name, shape_str(e.shape), shape_str(unpacked));
      sources.push_back({Source::Quantize, p, reader, scales,
                         std::make_unique<WeightRows>(weights, p->name, block)});
    }
  }
  for (Param* p : params)
    MOE_CHECK(p->format != ParamFormat::Mxfp4Scales || filled_by_pair.contains(p),
              "internal: MXFP4 scales '{}' without their weight", p->name);
  if (!missing.empty()) {
    std::string more;
    if (missing.size() > 1) more = fmt::format(" (and {} more missing)", missing.size() - 1);
    fail("{}: the model weights have no tensor '{}'{}", weights.dir().string(), missing.front(),
         more);
  }
  LoadSummary summary;
  for (Source& s : sources) {
    switch (s.kind) {
      case Source::Copy:
        s.reader->read_into(s.param->name, s.param->value);
        summary.tensors += s.param->format != ParamFormat::Mxfp4Scales;
        break;
      case Source::Zero:
        s.param->value.zero();
        ++summary.zeroed;
        break;
      case Source::Ids: {
        float* w = s.param->w();
        for_each_id_chunk(*s.reader, s.reader->entry(s.param->name),
                          [&](int64_t i0, const int64_t* v, int64_t count) {
                            for (int64_t k = 0; k < count; ++k) w[i0 + k] = static_cast<float>(v[k]);
                          });
        ++summary.tensors;
        break;
      }
      case Source::Rows: {
        // Decoded row by row into the parameter itself: no second copy of the matrix.
        const int64_t cols = s.rows->cols();
        for (int64_t r = 0; r < s.rows->rows(); ++r) s.rows->row(r, s.param->w() + r * cols);
        ++summary.tensors;
        summary.fp8 += s.rows->encoding() == WeightEncoding::Fp8;
        summary.decoded += s.rows->encoding() == WeightEncoding::Mxfp4;
        break;
      }
      case Source::Quantize:
        // Row by row through a one-row buffer: the fp32 matrix never exists in memory.
        quantize_rows_into(*s.param, *s.scales,
                           [&](int64_t r, float* row) { s.rows->row(r, row); });
        ++summary.tensors;
        ++summary.quantized;
        summary.fp8 += s.rows->encoding() == WeightEncoding::Fp8;
        break;
    }
    s.rows.reset();  // its buffers go with it
  }
  summary.notice = mtp_notice(weights, info, &summary.mtp_tensors);
  if (!summary.notice.empty() && prints_notices()) fmt::print(stderr, "{}\n", summary.notice);
  return summary;
}

LoadSummary load_weights(const fs::path& model_dir, const ParamList& params) {
  const SafetensorsSet weights(model_dir);
  return load_weights(weights, params);
}

void write_weight_files(const fs::path& dir,
                        const std::vector<std::vector<std::string>>& shard_tensors,
                        int64_t total_bytes,
                        const std::function<void(const fs::path&, size_t)>& write_shard) {
  MOE_CHECK(!shard_tensors.empty(), "internal: a model needs at least one weight file");
  create_model_dir(dir);
  const fs::path index_path = dir / kSafetensorsIndexFile;
  const std::set<std::string> old_shards = indexed_shards(index_path);
  if (shard_tensors.size() == 1) {
    // model.safetensors takes precedence over an index when loading, so it is written first and
    // the old index removed only afterwards.
    write_shard(dir / kSafetensorsSingleFile, 0);
    remove_file(index_path);
    for (const auto& old : old_shards)
      if (old != kSafetensorsSingleFile) remove_file(dir / old);
    return;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  std::set<std::string> new_shards;
  for (size_t i = 0; i < shard_tensors.size(); ++i) {
    const std::string file = shard_file_name(static_cast<int64_t>(i + 1),
                                             static_cast<int64_t>(shard_tensors.size()));
    for (const std::string& name : shard_tensors[i]) weight_map[name] = file;
    write_shard(dir / file, i);
    new_shards.insert(file);
  }
  write_index(index_path, weight_map, total_bytes);
  remove_file(dir / kSafetensorsSingleFile);
  for (const auto& old : old_shards)
    if (!new_shards.contains(old)) remove_file(dir / old);
}

void save_model(const fs::path& dir, const ModelConfig& cfg, const ParamList& params, DType dtype,
                int64_t max_shard_bytes) {
  MOE_CHECK(max_shard_bytes > 0, "save_model: max_shard_bytes must be positive, got {}",
            max_shard_bytes);
  // Before any weight file changes: a config that cannot be loaded back makes the save useless.
  const ModelConfig written = config_as_saved(dir, cfg, dtype);
  const std::string file_dtype = dtype_name(dtype);

  // Greedy packing in parameter order, as transformers shards: a tensor larger than the limit
  // gets a shard of its own (an empty tensor never opens a new one).
  std::vector<std::vector<SafetensorsWriteItem>> shards(1);
  std::vector<int64_t> shard_bytes(1, 0);
  int64_t total_bytes = 0;
  std::set<std::string_view> names;
  for (const Param* p : params) {
    MOE_CHECK(p != nullptr && p->value.defined(), "save_model: parameter '{}' has no value",
              p ? p->name : "?");
    MOE_CHECK(names.insert(p->name).second, "save_model: parameter '{}' is listed twice", p->name);
    const int64_t bytes = p->packed()       ? p->value.nbytes()
                          : p->id_bound > 0 ? p->value.numel() * 8
                                            : p->value.numel() * dtype_size(dtype);
    if (bytes > 0 && !shards.back().empty() && shard_bytes.back() + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes.push_back(0);
    }
    shards.back().push_back({p->name, p->value, file_dtype_of(*p, file_dtype)});
    shard_bytes.back() += bytes;
    total_bytes += bytes;
  }

  std::vector<std::vector<std::string>> shard_tensors;
  for (const auto& shard : shards) {
    shard_tensors.emplace_back();
    for (const auto& item : shard) shard_tensors.back().push_back(item.name);
  }
  write_weight_files(dir, shard_tensors, total_bytes, [&](const fs::path& path, size_t shard) {
    write_safetensors_with_dtypes(path, shards[shard], kWeightsMetadata);
  });
  write_hf_config(dir, written);
  fsync_directory(dir);  // the removals in write_weight_files
}

void save_model_shard(const fs::path& dir, int64_t shard, int64_t shards, const ParamList& params,
                      DType dtype) {
  MOE_CHECK(shards >= 1 && shard >= 1 && shard <= shards,
            "save_model_shard: shard {} of {} is out of range", shard, shards);
  MOE_CHECK(dtype == DType::F32 || dtype == DType::BF16,
            "save_model_shard: weights are saved as F32 or BF16, not {}", dtype_name(dtype));
  create_model_dir(dir);
  std::vector<SafetensorsWriteItem> items;
  for (const Param* p : params) items.push_back({p->name, p->value, file_dtype_of(*p, dtype_name(dtype))});
  write_safetensors_with_dtypes(dir / shard_file_name(shard, shards), items, kWeightsMetadata);
}

void finish_sharded_model(const fs::path& dir, const ModelConfig& cfg, int64_t shards,
                          DType dtype) {
  const ModelConfig written = config_as_saved(dir, cfg, dtype);
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total_bytes = 0;
  for (int64_t i = 1; i <= shards; ++i) {
    const std::string file = shard_file_name(i, shards);
    const SafetensorsReader reader(dir / file);
    for (const SafetensorsEntry& e : reader.entries()) {
      MOE_CHECK(!weight_map.contains(e.name), "{}: tensor '{}' is also in {}", (dir / file).string(),
                e.name, weight_map[e.name].get<std::string>());
      weight_map[e.name] = file;
      total_bytes += e.nbytes();
    }
  }
  write_index(dir / kSafetensorsIndexFile, weight_map, total_bytes);
  write_hf_config(dir, written);
  fsync_directory(dir);
}

}  // namespace moe
