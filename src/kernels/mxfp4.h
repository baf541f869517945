#pragma once
// MXFP4 (OCP Microscaling v1.0) codec: 32 consecutive elements along the contraction (input)
// dimension share one E8M0 scale byte; each element is an E2M1 nibble. Packing follows PyTorch
// float4_e2m1fn_x2 / DeepSeek-V4 / HF checkpoints: element 2i in the low nibble of byte i,
// element 2i+1 in the high nibble, so checkpoint bytes are used as they are (no repacking).
//
// A row of n elements (n % 32 == 0) is n/2 data bytes plus n/32 scale bytes.
#include <array>
#include <bit>
#include <cstdint>

namespace moe::mxfp4 {

inline constexpr int64_t kBlock = 32;  // elements per scale byte, along the input dim

// E2M1 nibble (low 4 bits; bit 3 = sign): 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6; 8..15 the same
// negated (8 = -0). Higher bits of `nibble` are ignored.
float e2m1_value(uint8_t nibble);

// E8M0 scale byte: 2^(e-127) exactly. 0xFF is NaN; 0 is 2^-127 (a subnormal float, not zero).
float e8m0_value(uint8_t scale);

// The same for all 256 bytes as a compile-time table, built from bit patterns (the normal float
// with exponent field e for e in 1..254, the subnormal 0x00400000 for 0, NaN for 255), for the
// kernels' scale lookups; e8m0_value stays the reference they are tested against.
inline constexpr std::array<float, 256> kE8m0Floats = [] {
  std::array<float, 256> t{};
  for (uint32_t e = 0; e < 256; ++e)
    t[e] = std::bit_cast<float>(e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : e << 23);
  return t;
}();

// Nearest E2M1 code of v (v already divided by the block scale): ties to the even code,
// magnitudes above 6 (Inf included) saturate to ±6. The sign is kept, so negative values that
// round to zero give -0 (code 8): that makes quantize_row(dequantize_row(q)) == q for any
// data whose blocks keep their scale. NaN gives code 0.
uint8_t e2m1_encode(float v);

// One row of n floats (n % 32 == 0) -> n/2 packed bytes + n/32 scale bytes. Per block:
//   amax = max|v|; shared_exp = floor(log2(amax)) - 2 clamped to [-127, 127];
//   each v · 2^-shared_exp (exact power-of-two scaling) encoded with e2m1_encode.
// Special blocks (our documented choices where the spec leaves one):
//   * amax == 0 (all ±0): scale byte 0 (2^-127), all codes 0 (+0; the sign of zero is dropped);
//   * any NaN or ±Inf in the block: scale byte 0xFF (NaN), all codes 0, so the whole block
//     dequantizes to NaN — a poisoned block stays visibly poisoned.
void quantize_row(const float* src, int64_t n, uint8_t* packed, uint8_t* scales);

// Inverse of the packing: dst[i] = e2m1_value(code_i) · e8m0_value(scale of block i/32), an
// exact product in fp32 except past its range (|value| >= 2 under scale byte 254, >= 4 under
// 253 give ±Inf) — scales quantize_row never produces from finite input (at most 252).
void dequantize_row(const uint8_t* packed, const uint8_t* scales, int64_t n, float* dst);

}  // namespace moe::mxfp4
