#pragma once
// Model checkpoints in the Hugging Face layout: config.json plus model.safetensors, or shards
// model-0000i-of-0000n.safetensors with model.safetensors.index.json.
#include <cstdint>
#include <filesystem>

#include "model/config.h"
#include "model/param.h"

namespace moe {

class SafetensorsSet;

// Fills every param's (allocated, F32) value from the checkpoint tensor of the same name,
// converting BF16. Tensors are looked up by exact name, so expert 10 is `mlp.experts.10`
// whatever order the files list them in. All params are checked (presence, shape, F32/BF16
// dtype) before any value is touched. Absent `*.mlp.gate.e_score_correction_bias` tensors are
// zeroed (DeepSeek-V2 checkpoints have no router bias); any other absent tensor is an error.
// Tensors the model does not use (e.g. the V3 multi-token-prediction layer) are ignored.
void load_weights(const std::filesystem::path& model_dir, const ParamList& params);
void load_weights(const SafetensorsSet& weights, const ParamList& params);

inline constexpr int64_t kDefaultMaxShardBytes = int64_t{4} << 30;

// Writes config.json (its torch_dtype set to `dtype`) and the weights in `dtype` (F32 or BF16),
// in the order of `params`: one model.safetensors when they fit in `max_shard_bytes`, otherwise
// shards plus an index. Creates `dir`; every file is replaced atomically, the index (or the
// single file) after all shards, and weight files of a previous save that the new layout no
// longer uses are removed afterwards so they cannot shadow the new weights.
void save_model(const std::filesystem::path& dir, const ModelConfig& cfg, const ParamList& params,
                DType dtype = DType::F32, int64_t max_shard_bytes = kDefaultMaxShardBytes);

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
