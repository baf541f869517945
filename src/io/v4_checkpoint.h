#pragma once
// DeepSeek-V4 checkpoints in the layout DeepSeek releases them (SPEC §6.3, §6.10), written from
// a DeepSeekV4Model's params(). load_weights (io/checkpoint.h) reads the same layout back: it
// knows the V4 scale name `X.scale` from config.json's model_type.
//
// Every tensor takes the released dtype of its kind (v4_released_format):
//   F8_E4M3 `X.weight` + F8_E8M0 `X.scale` [ceil(out/128), ceil(in/128)]: the attention's
//     wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b, the shared expert's w1/w2/w3 and the MTP
//     module's e_proj/h_proj;
//   I8 `X.weight` [out, in/2] + F8_E8M0 `X.scale` [out, in/32]: packed (MXFP4) routed experts,
//     their bytes written unchanged;
//   F32: the hyper-connections' hc_*, attn_sink, the compressors' ape and the router's gate.bias;
//   I64: the hash layers' gate.tid2eid;
//   BF16: everything else (embed, head, norms, the router's gate.weight, the compressors' and the
//     indexer's other projections).
// Routed experts the model keeps in fp32 are written as FP8 with 128x128 scales, as
// DeepSeek-V4-Flash-Base ships its experts (config.json expert_dtype "fp8"), which loses less
// than re-quantizing them to 4 bits; packed ones give expert_dtype "fp4", as V4-Flash.
//
// FP8 tiles are written with the power-of-two scale of fp8_tile_scale_e8m0 (io/fp8.h): the
// smallest with amax / scale <= 464. That choice makes a save of a loaded checkpoint
// reproduce its bytes exactly: quantizing the decoded values e4m3(b) · 2^k again picks 2^k
// and the bytes b. So save(load(file)) == file for files written this way, and load(save(x))
// reproduces x's packed experts, F32, I64 and BF16-representable values bitwise.
//
// Tensors are written in name order (std::string order, which Python's sorted() shares), so a
// file's bytes depend only on its tensors, not on the order a model lists them in.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "io/checkpoint.h"
#include "model/config.h"
#include "model/param.h"

namespace moe {

enum class V4DiskFormat { Fp8, Mxfp4, F32, Bf16, Ids };
const char* v4_disk_format_name(V4DiskFormat f);  // "FP8", "MXFP4", "F32", "BF16", "I64"

// The released on-disk format of a V4 parameter, by its key (SPEC §6.10) and, for routed
// experts, by whether it is packed. An MXFP4 pair's `.scale` parameter is Mxfp4 as well.
V4DiskFormat v4_released_format(const Param& p);
// The same by key alone, for a tensor that is not packed (routed experts: Fp8).
V4DiskFormat v4_released_format(std::string_view name);

// config.json as the release writes it: the model's fields (model_config_to_json) with
// torch_dtype bfloat16, quantization_config {quant_method fp8, fmt e4m3, scale_fmt ue8m0,
// weight_block_size [128, 128], activation_scheme dynamic} and expert_dtype "fp4" (packed
// experts) or "fp8". Reading it back gives `cfg` with torch_dtype bfloat16.
nlohmann::json v4_released_config_json(const ModelConfig& cfg);

struct V4SaveSummary {
  int64_t fp8 = 0, mxfp4 = 0, f32 = 0, bf16 = 0, ids = 0;  // weights (scales not counted)
  int64_t files = 0;
  int64_t bytes = 0;  // tensor data written
};

// Writes `params` (a DeepSeekV4Model's params(), or a subset: an expert-parallel rank's) to
// `dir` in the released layout: config.json (v4_released_config_json) plus model.safetensors,
// or shards of at most `max_shard_bytes` with model.safetensors.index.json, every file replaced
// atomically (save_model's order and stale-file removal). Streaming: each tensor is encoded
// row by row (FP8: one row of bytes plus the tensor's tile scales); no copy of the model is
// made. Everything is checked (a V4 config, each tensor's shape for its format, packed experts
// agreeing with cfg.expert_format, ids exact) before the first file is written.
V4SaveSummary save_v4_released(const std::filesystem::path& dir, const ModelConfig& cfg,
                               const ParamList& params,
                               int64_t max_shard_bytes = kDefaultMaxShardBytes);

}  // namespace moe
