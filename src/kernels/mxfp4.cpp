#include "kernels/mxfp4.h"

#include <cmath>
#include <limits>

#include "core/error.h"

namespace moe::mxfp4 {

namespace {

constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Magnitude code of |v| (no sign). The boundaries are the midpoints between neighbouring
// E2M1 values; at a midpoint the even code (0, 1.0, 2.0, 4.0 have even codes) wins, hence
// `<=` below even codes and `<` below odd ones.
uint8_t e2m1_magnitude_code(float a) {
  if (a <= 0.25f) return 0;  // 0.25: tie 0 / 0.5 -> 0
  if (a < 0.75f) return 1;   // 0.75: tie 0.5 / 1 -> 1
  if (a <= 1.25f) return 2;  // 1.25: tie 1 / 1.5 -> 1
  if (a < 1.75f) return 3;   // 1.75: tie 1.5 / 2 -> 2
  if (a <= 2.5f) return 4;   // 2.5: tie 2 / 3 -> 2
  if (a < 3.5f) return 5;    // 3.5: tie 3 / 4 -> 4
  if (a <= 5.0f) return 6;   // 5: tie 4 / 6 -> 4
  return 7;                  // saturate (Inf included)
}

}  // namespace

float e2m1_value(uint8_t nibble) { return kE2M1[nibble & 0xF]; }

float e8m0_value(uint8_t scale) {
  if (scale == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  // ldexp is exact for every exponent in [-127, 127], including the subnormal 2^-127.
  return std::ldexp(1.0f, static_cast<int>(scale) - 127);
}

uint8_t e2m1_encode(float v) {
  if (std::isnan(v)) return 0;
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  return static_cast<uint8_t>(sign | e2m1_magnitude_code(std::fabs(v)));
}

void quantize_row(const float* src, int64_t n, uint8_t* packed, uint8_t* scales) {
  MOE_CHECK(n % kBlock == 0, "mxfp4::quantize_row: length {} is not a multiple of {}", n, kBlock);
  for (int64_t b = 0; b < n / kBlock; ++b) {
    const float* v = src + b * kBlock;
    uint8_t* out = packed + b * (kBlock / 2);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < kBlock; ++i) {
      finite = finite && std::isfinite(v[i]);
      amax = std::fmax(amax, std::fabs(v[i]));
    }
    if (!finite || amax == 0.0f) {
      scales[b] = finite ? 0 : 0xFF;
      for (int64_t i = 0; i < kBlock / 2; ++i) out[i] = 0;
      continue;
    }
    // ilogb is floor(log2) exactly, subnormals included; the smallest subnormal (2^-149) gives
    // -151, hence the clamp. The upper clamp never binds (FLT_MAX gives 125).
    int shared_exp = std::ilogb(amax) - 2;
    shared_exp = shared_exp < -127 ? -127 : (shared_exp > 127 ? 127 : shared_exp);
    scales[b] = static_cast<uint8_t>(shared_exp + 127);
    for (int64_t i = 0; i < kBlock; i += 2) {
      const uint8_t lo = e2m1_encode(std::ldexp(v[i], -shared_exp));
      const uint8_t hi = e2m1_encode(std::ldexp(v[i + 1], -shared_exp));
      out[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void dequantize_row(const uint8_t* packed, const uint8_t* scales, int64_t n, float* dst) {
  MOE_CHECK(n % kBlock == 0, "mxfp4::dequantize_row: length {} is not a multiple of {}", n,
            kBlock);
  for (int64_t b = 0; b < n / kBlock; ++b) {
    const float s = e8m0_value(scales[b]);
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      const uint8_t byte = packed[b * (kBlock / 2) + i];
      dst[b * kBlock + 2 * i] = kE2M1[byte & 0xF] * s;
      dst[b * kBlock + 2 * i + 1] = kE2M1[byte >> 4] * s;
    }
  }
}

}  // namespace moe::mxfp4
