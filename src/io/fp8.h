#pragma once
// FP8 weights as DeepSeek-V3/R1/V3.1 publish them, and a row-by-row reader for every weight
// encoding the engine loads, so no weight is ever materialised at a wider type than its target.
//
// The released checkpoints store most linears as F8_E4M3 `X.weight [out, in]` plus an F32
// `X.weight_scale_inv [ceil(out/B0), ceil(in/B1)]` (B = quantization_config.weight_block_size,
// [128, 128] in every release): W[i, j] = e4m3(X[i, j]) · scale_inv[i / B0][j / B1] (multiplied,
// despite the name). The last tile of a dimension that is not a multiple of the block is
// partial. V3.1 (quantization_config.scale_fmt = "ue8m0") keeps the same F32 tensor but its
// values are powers of two; the product is the same operation. DeepSeek-V4 names the scale
// `X.scale` and stores it as F8_E8M0 bytes (2^(e-127)); any of F32, BF16 and F8_E8M0 is read
// under either name.
#include <cstdint>
#include <string>
#include <string_view>

#include "core/tensor.h"
#include "kernels/fp8_e4m3.h"

namespace moe {

class SafetensorsReader;
class SafetensorsSet;
struct SafetensorsEntry;

// fp8_e4m3_value / fp8_e4m3_encode: kernels/fp8_e4m3.h.

// The E8M0 byte (2^(byte-127)) of the block scale s used to write a tile whose largest
// magnitude is `amax` as F8_E4M3 (DeepSeek-V4's "ue8m0" scales): the smallest power of two with
// amax / s <= 464, i.e. the smallest scale at which no element rounds past E4M3's largest value
// 448 (464 is the midpoint between 448 and the next step, 480, and rounds to 448 by ties to
// even), clamped to E8M0's [2^-127, 2^127]. A tile of zeros gets 2^0 (byte 127), any scale
// writing it exactly.
//
// Why 464 and not amax / s <= 448: that rule lets the tile's largest byte be anything in
// [224, 448], so a tile whose maximum rounds down to 224 at scale s looks, once decoded, like a
// tile of maximum 448 at s/2, and re-saving it changes its bytes. With 464 the maximum byte
// lies in [240, 448], less than a factor of two apart, so quantizing the decoded values again
// picks the same scale and the same bytes: save(load(file)) == file. The elements in
// (448, 464] that saturate to 448 lose at most 16/464 = 3.4%, the same as E4M3's own worst
// rounding step.
uint8_t fp8_tile_scale_e8m0(float amax);

// The name of an FP8 weight's block scales: DeepSeek-V3/R1/V3.1 `X.weight_scale_inv`,
// DeepSeek-V4 `X.scale`.
enum class Fp8ScaleKey { WeightScaleInv, Scale };

// quantization_config.weight_block_size: rows (output dim) x columns (input dim) per scale, and
// the release's name for the scales (HfWeightsInfo::fp8_block() picks it by model_type).
struct Fp8Block {
  int64_t rows = 128;
  int64_t cols = 128;
  Fp8ScaleKey scale_key = Fp8ScaleKey::WeightScaleInv;
};

// "X.weight" -> "X.weight_scale_inv".
std::string fp8_scale_inv_name(std::string_view weight_name);
// "X.weight" -> "X.weight_scale_inv" or "X.scale", as `key` says.
std::string fp8_scale_name(std::string_view weight_name, Fp8ScaleKey key);
// "X.weight_scale_inv" -> "X.weight"; empty when `name` is not a scale_inv name.
std::string fp8_weight_of_scale_inv(std::string_view name);
// "X.weight" -> "X.scale": the scale of an MXFP4-packed (I8) weight (SPEC §5).
std::string mxfp4_scale_name(std::string_view weight_name);

// The dtype strings a 2-D weight may have on disk, and how its rows decode:
//   F32, BF16           the values;
//   F8_E4M3             FP8 with its block scales, X.weight_scale_inv or X.scale (above);
//   I8 / U8             MXFP4 pairs with their X.scale F8_E8M0 [out, in/32] (SPEC §5).
enum class WeightEncoding { F32, BF16, Fp8, Mxfp4 };
const char* weight_encoding_name(WeightEncoding e);  // "F32", "BF16", "FP8", "MXFP4"

// Reads one 2-D checkpoint weight as fp32 rows. Every check (dtypes, shapes, the scale's
// presence) happens in the constructor, which reads nothing and allocates nothing, so a loader
// can check all weights before touching any value; errors name the file, the tensor and, for a
// scale, both tensors. The first row() allocates the buffers, as tracked Scratch tensors: for
// FP8 the block scales plus one chunk of on-disk rows (at most ~1 MiB, at least one row), for
// the others one row of on-disk bytes; release() or the destructor frees them.
class WeightRows {
 public:
  // `name` must exist in `weights` (an error names the directory otherwise); an FP8 or MXFP4
  // weight's scale is looked up there too and must exist.
  WeightRows(const SafetensorsSet& weights, const std::string& name, Fp8Block block = {});
  ~WeightRows();
  WeightRows(const WeightRows&) = delete;
  WeightRows& operator=(const WeightRows&) = delete;

  WeightEncoding encoding() const { return encoding_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  // The on-disk tensors read (weight, and the scale for FP8/MXFP4: empty otherwise).
  const std::string& name() const { return name_; }
  const std::string& scale_name() const { return scale_name_; }
  int64_t disk_bytes() const;

  // Row r as fp32. Sequential access is the cheap case (FP8 rows come from the buffered chunk).
  void row(int64_t r, float* out);
  void release();

 private:
  std::string name_, scale_name_;
  const SafetensorsReader* reader_ = nullptr;
  const SafetensorsEntry* entry_ = nullptr;
  const SafetensorsReader* scale_reader_ = nullptr;
  const SafetensorsEntry* scale_entry_ = nullptr;
  WeightEncoding encoding_ = WeightEncoding::F32;
  int64_t rows_ = 0, cols_ = 0;
  Fp8Block block_;
  Tensor scales_;   // FP8: F32 [ceil(rows/B0) * ceil(cols/B1)]
  Tensor chunk_;    // FP8: U8 [chunk_rows_ * cols]; MXFP4: one packed row + its scales; BF16: one row
  int64_t chunk_rows_ = 0, chunk_begin_ = -1;
};

}  // namespace moe
