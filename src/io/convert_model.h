#pragma once
// `moe convert`: a Hugging Face model directory in any layout the engine reads (F32, BF16,
// DeepSeek's FP8 with block scales, MXFP4 experts; one file or sharded) -> a new directory in
// the engine's preferred layout, so that a later load is a plain read: non-expert weights in
// `dtype` (bf16 or f32), routed experts in `experts` (mxfp4, bf16 or f32), sharded at
// `max_shard_bytes` with model.safetensors.index.json, config.json rewritten (no fp8
// quantization_config; quantization_config mxfp4 when the experts are packed), tokenizer and
// other side files copied.
//
// Streaming, tensor by tensor in the engine's parameter order: each output tensor is produced
// row by row from its input (FP8 rows dequantized with their block scales, MXFP4 rows decoded)
// and written at once; an MXFP4 output holds only its matrix's scale bytes (1/128 of fp32) until
// they are written after the packed rows. Peak memory is one FP8 chunk of input rows (<= ~1 MiB)
// plus one matrix's scales, whatever the model's size; copies go through a fixed 4 MiB buffer.
//
// Left out of the new model: the multi-token-prediction layers (num_nextn_predict_layers; moe
// does not use them) and the FP8 scale tensors consumed. Tensors the model does not describe are
// copied as they are (and reported). The router's F32 correction bias stays F32 under
// dtype = bf16 (it only ranks experts; DeepSeek ships it in F32), as do DeepSeek-V4's F32
// tensors (hc_*, attn_sink, ape, gate.bias); V4's I64 gate.tid2eid is copied as it is.
//
// DeepSeek-V4 (model_type deepseek_v4): the released layout (FP8 with `.scale`, MXFP4 experts)
// is read like V3's; the output is the engine's layout (no fp8 quantization_config, experts
// packed or not as `experts` says), under the released key names.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "io/checkpoint.h"

namespace moe {

struct ConvertOptions {
  // Non-expert weights: "bf16", "f32", or "keep" (F32/BF16 tensors byte for byte, FP8 -> F32,
  // which is exact).
  std::string dtype = "bf16";
  // Routed experts: "mxfp4" (packed rows are copied, others quantized row by row), "bf16", "f32".
  std::string experts = "mxfp4";
  // Greedy sharding in parameter order; <= 0 keeps the input's files instead (same names, each
  // input file's tensors converted in place: `moe quantize`).
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
};

struct QuantizeLayerStats {
  int64_t layer = 0;
  int64_t matrices = 0;   // expert matrices quantized (3 per expert)
  int64_t weights = 0;    // their elements
  double rel_rms_error = 0;  // ‖W − dequant(quant(W))‖ / ‖W‖ over the layer's experts
  double max_abs_error = 0;
};

struct ConvertReport {
  std::vector<QuantizeLayerStats> layers;  // MoE layers whose experts were quantized here
  int64_t expert_bytes_in = 0, expert_bytes_out = 0;  // routed experts, scales included
  int64_t bytes_in = 0, bytes_out = 0;                // all tensor data read / written
  int64_t files = 0, tensors = 0;                     // written
  int64_t fp8_dequantized = 0;                        // FP8 weights decoded
  int64_t mtp_dropped = 0;                            // MTP tensors left out
  int64_t copied_unknown = 0;                         // tensors the model does not use, copied
  std::vector<std::string> notices;                   // one line each (MTP, unknown tensors)
};

// `out` must not exist or be an empty directory. Everything is checked (a complete model, FP8
// weights with their scales, shapes) before the first file is written; errors name the file
// and the tensor. `on_layer` gets each quantized MoE layer's error statistics at the end.
ConvertReport convert_model(const std::filesystem::path& in, const std::filesystem::path& out,
                            const ConvertOptions& options,
                            const std::function<void(const QuantizeLayerStats&)>& on_layer = {});

// `out` must differ from `in` and not exist or be an empty directory (errors name --out).
void check_new_output_dir(const std::filesystem::path& in, const std::filesystem::path& out);
// Copies `in`'s files other than weights, their index, config.json and trainer.json (the
// tokenizer, generation_config.json, ...) into `out`, each atomically.
void copy_side_files(const std::filesystem::path& in, const std::filesystem::path& out);

}  // namespace moe
