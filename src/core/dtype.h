#pragma once
#include <cstdint>
#include <cstring>

namespace moe {

// F32/BF16 hold weights and activations; I32 holds routing indices; U8 holds packed bytes
// (MXFP4 nibbles and E8M0 scales arrive in a later milestone).
enum class DType : int { F32, BF16, I32, U8 };

inline int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::U8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t);

// Round-to-nearest-even, NaN kept quiet; matches torch's float->bfloat16 conversion.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace moe
