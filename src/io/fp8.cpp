#include "io/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"

namespace moe {

namespace {

// Bytes of on-disk FP8 rows buffered at once (at least one row).
constexpr int64_t kFp8ChunkBytes = int64_t{1} << 20;

bool is_packed_dtype(const std::string& dtype) { return dtype == "I8" || dtype == "U8"; }

}  // namespace

std::string fp8_scale_inv_name(std::string_view weight_name) {
  return std::string(weight_name) + "_scale_inv";
}

std::string fp8_scale_name(std::string_view weight_name, Fp8ScaleKey key) {
  return key == Fp8ScaleKey::Scale ? mxfp4_scale_name(weight_name) : fp8_scale_inv_name(weight_name);
}

uint8_t fp8_tile_scale_e8m0(float amax) {
  // 464 = 448 + half of E4M3's step (32) between 256 and 512; see fp8.h.
  constexpr float kLargestBeforeOverflow = 464.0f;
  if (!(amax > 0.0f)) return 127;  // zeros (and NaN: the elements carry it, any scale will do)
  if (std::isinf(amax)) return 254;
  // The smallest e with amax <= 464 · 2^e; ldexp is exact, so the comparison is too.
  int e = 0;
  std::frexp(amax / kLargestBeforeOverflow, &e);  // amax/464 in [2^(e-1), 2^e)
  while (e > -127 && std::ldexp(kLargestBeforeOverflow, e - 1) >= amax) --e;
  while (std::ldexp(kLargestBeforeOverflow, e) < amax) ++e;
  return static_cast<uint8_t>(std::clamp(e, -127, 127) + 127);
}

std::string fp8_weight_of_scale_inv(std::string_view name) {
  const std::string_view suffix = ".weight_scale_inv";
  if (!name.ends_with(suffix)) return {};
  return std::string(name.substr(0, name.size() - std::string_view("_scale_inv").size()));
}

std::string mxfp4_scale_name(std::string_view weight_name) {
  const std::string_view suffix = ".weight";
  if (!weight_name.ends_with(suffix)) return std::string(weight_name) + ".scale";
  return std::string(weight_name.substr(0, weight_name.size() - suffix.size())) + ".scale";
}

const char* weight_encoding_name(WeightEncoding e) {
  switch (e) {
    case WeightEncoding::F32: return "F32";
    case WeightEncoding::BF16: return "BF16";
    case WeightEncoding::Fp8: return "FP8";
    case WeightEncoding::Mxfp4: return "MXFP4";
  }
  return "?";
}

WeightRows::WeightRows(const SafetensorsSet& weights, const std::string& name, Fp8Block block)
    : name_(name), block_(block) {
  reader_ = &weights.reader_for(name);
  entry_ = &reader_->entry(name);
  const std::string file = reader_->path().string();
  const SafetensorsEntry& e = *entry_;
  MOE_CHECK(block.rows > 0 && block.cols > 0, "internal: FP8 block {}x{}", block.rows, block.cols);
  MOE_CHECK(e.shape.size() == 2, "{}: tensor '{}' has shape {}; a weight matrix is [out, in]",
            file, name, shape_str(e.shape));
  rows_ = e.shape[0];
  cols_ = e.shape[1];
  if (e.dtype == "F32") {
    encoding_ = WeightEncoding::F32;
  } else if (e.dtype == "BF16") {
    encoding_ = WeightEncoding::BF16;
  } else if (e.dtype == "F8_E4M3") {
    encoding_ = WeightEncoding::Fp8;
    scale_name_ = fp8_scale_name(name, block.scale_key);
    const bool v4_names = block.scale_key == Fp8ScaleKey::Scale;
    scale_reader_ = weights.find(scale_name_);
    const int64_t want_r = (rows_ + block.rows - 1) / block.rows;
    const int64_t want_c = (cols_ + block.cols - 1) / block.cols;
    // Never an implicit scale of 1: FP8 bytes mean nothing without their block scales.
    MOE_CHECK(scale_reader_ != nullptr,
              "{}: FP8 weight '{}' (F8_E4M3 {}) has no scale tensor '{}' ({} [{}, {}]) in {}; "
              "FP8 weights cannot be used without their block scales", file, name,
              shape_str(e.shape), scale_name_, v4_names ? "F8_E8M0" : "F32", want_r, want_c,
              weights.dir().string());
    scale_entry_ = &scale_reader_->entry(scale_name_);
    const SafetensorsEntry& se = *scale_entry_;
    const std::string sfile = scale_reader_->path().string();
    MOE_CHECK(se.dtype == "F32" || se.dtype == "BF16" || se.dtype == "F8_E8M0",
              "{}: scale tensor '{}' of FP8 weight '{}' has dtype {}; expected {}", sfile,
              scale_name_, name, se.dtype,
              v4_names ? "F8_E8M0 (or F32, BF16)" : "F32 (or BF16, F8_E8M0)");
    MOE_CHECK(se.shape == (Shape{want_r, want_c}),
              "{}: scale tensor '{}' of FP8 weight '{}' {} has shape {}; blocks of {}x{} "
              "(quantization_config.weight_block_size) need [ceil({}/{}), ceil({}/{})] = [{}, {}]",
              sfile, scale_name_, name, shape_str(e.shape), shape_str(se.shape), block.rows,
              block.cols, rows_, block.rows, cols_, block.cols, want_r, want_c);
  } else if (is_packed_dtype(e.dtype)) {
    encoding_ = WeightEncoding::Mxfp4;
    cols_ = e.shape[1] * 2;
    scale_name_ = mxfp4_scale_name(name);
    scale_reader_ = weights.find(scale_name_);
    MOE_CHECK(scale_reader_ != nullptr,
              "{}: MXFP4 weight '{}' ({}) has no scale tensor '{}' (F8_E8M0 [{}, {}]) in {}; "
              "packed weights cannot be used without their block scales", file, name, e.dtype,
              scale_name_, rows_, cols_ / mxfp4::kBlock, weights.dir().string());
    scale_entry_ = &scale_reader_->entry(scale_name_);
    const SafetensorsEntry& se = *scale_entry_;
    MOE_CHECK((se.dtype == "F8_E8M0" || se.dtype == "U8") &&
                  se.shape == (Shape{rows_, cols_ / mxfp4::kBlock}) && cols_ % mxfp4::kBlock == 0,
              "{}: scale tensor '{}' of MXFP4 weight '{}' is {} {}, expected F8_E8M0 [{}, {}]",
              scale_reader_->path().string(), scale_name_, name, se.dtype, shape_str(se.shape),
              rows_, cols_ / mxfp4::kBlock);
  } else {
    fail("{}: tensor '{}' has dtype {}; a weight loads from F32, BF16, F8_E4M3 (with its "
         "{}) or MXFP4 (I8 with its F8_E8M0 scale)", file, name, e.dtype,
         fp8_scale_name(name, block.scale_key));
  }
}

WeightRows::~WeightRows() = default;

int64_t WeightRows::disk_bytes() const {
  return entry_->nbytes() + (scale_entry_ ? scale_entry_->nbytes() : 0);
}

void WeightRows::release() {
  scales_.reset();
  chunk_.reset();
  chunk_begin_ = -1;
}

void WeightRows::row(int64_t r, float* out) {
  MOE_CHECK(r >= 0 && r < rows_, "internal: row {} of '{}' ({} rows)", r, name_, rows_);
  const SafetensorsEntry& e = *entry_;
  switch (encoding_) {
    case WeightEncoding::F32:
      reader_->read_bytes(e, r * cols_ * 4, cols_ * 4, out);
      return;
    case WeightEncoding::BF16: {
      if (!chunk_.defined()) chunk_ = Tensor::empty({cols_ * 2}, DType::U8, MemCategory::Scratch);
      reader_->read_bytes(e, r * cols_ * 2, cols_ * 2, chunk_.raw());
      const uint8_t* raw = chunk_.u8();
      for (int64_t j = 0; j < cols_; ++j) {
        uint16_t h;
        std::memcpy(&h, raw + 2 * j, 2);
        out[j] = bf16_to_f32(h);
      }
      return;
    }
    case WeightEncoding::Mxfp4: {
      const int64_t packed = cols_ / 2, nscales = cols_ / mxfp4::kBlock;
      if (!chunk_.defined())
        chunk_ = Tensor::empty({packed + nscales}, DType::U8, MemCategory::Scratch);
      uint8_t* buf = chunk_.u8();
      reader_->read_bytes(e, r * packed, packed, buf);
      scale_reader_->read_bytes(*scale_entry_, r * nscales, nscales, buf + packed);
      mxfp4::dequantize_row(buf, buf + packed, cols_, out);
      return;
    }
    case WeightEncoding::Fp8: break;
  }
  const int64_t tiles_c = (cols_ + block_.cols - 1) / block_.cols;
  if (!scales_.defined()) {
    const SafetensorsEntry& se = *scale_entry_;
    const int64_t n = shape_numel(se.shape);
    scales_ = Tensor::empty({n}, DType::F32, MemCategory::Scratch);
    float* s = scales_.f32();
    if (se.dtype == "F32") {
      scale_reader_->read_bytes(se, 0, n * 4, s);
    } else {
      // BF16 / E8M0 bytes widened in place from the back, so one buffer suffices.
      const int64_t width = se.dtype == "BF16" ? 2 : 1;
      auto* raw = reinterpret_cast<uint8_t*>(s);
      scale_reader_->read_bytes(se, 0, n * width, raw);
      for (int64_t i = n - 1; i >= 0; --i) {
        float v;
        if (width == 2) {
          uint16_t h;
          std::memcpy(&h, raw + 2 * i, 2);
          v = bf16_to_f32(h);
        } else {
          v = mxfp4::e8m0_value(raw[i]);
        }
        s[i] = v;
      }
    }
    chunk_rows_ = std::clamp<int64_t>(kFp8ChunkBytes / std::max<int64_t>(cols_, 1), 1, rows_);
    chunk_ = Tensor::empty({chunk_rows_ * cols_}, DType::U8, MemCategory::Scratch);
    chunk_begin_ = -1;
  }
  if (chunk_begin_ < 0 || r < chunk_begin_ || r >= chunk_begin_ + chunk_rows_) {
    chunk_begin_ = r;
    const int64_t n = std::min(chunk_rows_, rows_ - r);
    reader_->read_bytes(e, r * cols_, n * cols_, chunk_.raw());
  }
  const uint8_t* bytes = chunk_.u8() + (r - chunk_begin_) * cols_;
  const float* scale_row = scales_.f32() + (r / block_.rows) * tiles_c;
  const float* e4m3 = fp8_e4m3_values();
  for (int64_t t = 0; t < tiles_c; ++t) {
    const float s = scale_row[t];
    const int64_t end = std::min(cols_, (t + 1) * block_.cols);
    for (int64_t j = t * block_.cols; j < end; ++j) out[j] = e4m3[bytes[j]] * s;
  }
}

}  // namespace moe
