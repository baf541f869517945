#pragma once
// Model checkpoints in the Hugging Face layout: config.json plus model.safetensors, or shards
// model-0000i-of-0000n.safetensors with model.safetensors.index.json.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/param.h"

namespace moe {

class SafetensorsSet;

// Fills every param's (allocated) value from the checkpoint tensor of the same name. Tensors
// are looked up by exact name, so expert 10 is `mlp.experts.10` whatever order the files list
// them in. All params are checked (presence, shape, dtype, FP8/MXFP4 scales) before any value
// is touched. Absent `*.mlp.gate.e_score_correction_bias` tensors are zeroed (DeepSeek-V2
// checkpoints have no router bias); any other absent tensor is an error.
//
// On-disk forms: F32 and BF16 (converted); F8_E4M3 with its block scales (DeepSeek-V3/R1/V3.1
// `weight_scale_inv`, DeepSeek-V4 `.scale` as config.json's model_type says; io/fp8.h; block
// size from its quantization_config, 128x128 by default), dequantized row by row straight into
// the fp32 value; I8 + F8_E8M0 MXFP4 pairs (DeepSeek-V4's routed experts) decoded row by row
// into an fp32 matrix. Into an MXFP4 pair, I8 + F8_E8M0 pairs are copied as they are (never
// decoded) and F32 / BF16 / FP8 rows quantized one row at a time.
// Integer id tables (Param::id_bound > 0, DeepSeek-V4's `gate.tid2eid`) load from I64 (as
// released) or I32, every entry checked against the bound (an error names the tensor, the entry
// and the bound) before any value is touched.
// A weight matrix never exists at a wider type than its parameter: the transient memory is one
// row, or for FP8 one chunk of on-disk rows (<= ~1 MiB) plus the tensor's block scales.
//
// Tensors the model does not use are ignored. The multi-token-prediction layers of V3
// (config.json num_nextn_predict_layers: model.layers.61.* in the 671B release) are skipped
// with a one-line notice on stderr ("note: ..."), printed by rank 0 only under mpirun.
struct LoadSummary {
  int64_t tensors = 0;      // params filled from the files (an MXFP4 pair counts once)
  int64_t fp8 = 0;          // ... of which dequantized from F8_E4M3
  int64_t quantized = 0;    // MXFP4 pairs quantized on load (from F32, BF16 or FP8)
  int64_t decoded = 0;      // MXFP4 pairs decoded into fp32 parameters
  int64_t zeroed = 0;       // absent router correction biases
  int64_t mtp_tensors = 0;  // MTP tensors present in the files and skipped
  std::string notice;       // the notice printed ("" when there was none)
};
LoadSummary load_weights(const std::filesystem::path& model_dir, const ParamList& params);
LoadSummary load_weights(const SafetensorsSet& weights, const ParamList& params);

inline constexpr int64_t kDefaultMaxShardBytes = int64_t{4} << 30;

// Writes config.json (its torch_dtype set to `dtype`) and the weights in `dtype` (F32 or BF16),
// in the order of `params`: one model.safetensors when they fit in `max_shard_bytes`, otherwise
// shards plus an index. Creates `dir`; every file is replaced atomically, the index (or the
// single file) after all shards, and weight files of a previous save that the new layout no
// longer uses are removed afterwards so they cannot shadow the new weights.
void save_model(const std::filesystem::path& dir, const ModelConfig& cfg, const ParamList& params,
                DType dtype = DType::F32, int64_t max_shard_bytes = kDefaultMaxShardBytes);

// The weight files of a model directory, for savers with their own tensor encodings (the
// DeepSeek-V4 released layout, io/v4_checkpoint.h): `write_shard(path, i)` writes shard i
// (0-based) holding the tensors shard_tensors[i]. One shard becomes model.safetensors, several
// become model-0000i-of-0000n.safetensors plus model.safetensors.index.json (total_size
// `total_bytes`). Creates `dir`; the order of writes and the removal of stale weight files are
// save_model's (above). The caller writes config.json afterwards, then fsyncs `dir`.
void write_weight_files(const std::filesystem::path& dir,
                        const std::vector<std::vector<std::string>>& shard_tensors,
                        int64_t total_bytes,
                        const std::function<void(const std::filesystem::path&, size_t)>& write_shard);

// A model saved by several processes at once (expert parallelism), into one directory on a file
// system they share: each process writes its part of the weights as shard `shard` of `shards`
// (1-based, model-0000i-of-0000n.safetensors), then, once all are written, one process calls
// finish_sharded_model, which indexes the shards it finds (reading only their headers) and
// writes config.json. The result is an ordinary sharded Hugging Face model directory.
void save_model_shard(const std::filesystem::path& dir, int64_t shard, int64_t shards,
                      const ParamList& params, DType dtype = DType::F32);
void finish_sharded_model(const std::filesystem::path& dir, const ModelConfig& cfg,
                          int64_t shards, DType dtype = DType::F32);

}  // namespace moe
