#include "kernels/fp8_e4m3.h"

#include <array>
#include <cmath>
#include <limits>

namespace moe {

namespace {

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exp = (b >> 3) & 0xF, mant = b & 7;
    float v;
    if ((b & 0x7F) == 0x7F)
      v = std::numeric_limits<float>::quiet_NaN();
    else if (exp == 0)
      v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: m/8 · 2^-6
    else
      v = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
    t[static_cast<size_t>(b)] = (b & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256> kE4M3 = make_e4m3_table();

}  // namespace

float fp8_e4m3_value(uint8_t byte) { return kE4M3[byte]; }

const float* fp8_e4m3_values() { return kE4M3.data(); }

uint8_t fp8_e4m3_encode(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  if (std::isnan(v)) return static_cast<uint8_t>(sign | 0x7F);
  const float a = std::fabs(v);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7E);  // saturate (Inf included)
  if (a < 0x1p-6f) {
    // Subnormal range: a = q · 2^-9 with q in [0, 8); q = 8 is the smallest normal (code 8).
    const float q = std::nearbyint(a * 512.0f);  // exact scaling, round half to even
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));
  }
  int e = 0;
  const float m = std::frexp(a, &e);      // a = m · 2^e, m in [0.5, 1)
  const int exp = e - 1;                   // a = (2m) · 2^exp, 2m in [1, 2)
  const float frac = (2.0f * m - 1.0f) * 8.0f;  // exact
  int q = static_cast<int>(std::nearbyint(frac));
  int biased = exp + 7;
  if (q == 8) q = 0, ++biased;
  // a < 448 keeps this at most 0x7E (rounding up to 480 would need a > 464).
  return static_cast<uint8_t>(sign | (biased << 3) | q);
}

}  // namespace moe
