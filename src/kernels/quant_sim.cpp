#include "kernels/quant_sim.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "core/error.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/mxfp4.h"

namespace moe {

namespace {

constexpr float kFp8Max = 448.0f, kFp8AmaxFloor = 1e-4f;
constexpr float kFp4Max = 6.0f, kFp4AmaxFloor = 6.0f * 0x1p-126f;

// 2^ceil(log2(max(amax, floor) · inv_max)) from the product's float bits, as the reference's
// fast_log2_ceil / fast_pow2: the biased exponent, plus one when any mantissa bit is set (a
// subnormal product counts as exponent −126).
float pow2_ceil_scale(float amax, float floor, float inv_max) {
  const float r = std::max(amax, floor) * inv_max;
  const uint32_t bits = std::bit_cast<uint32_t>(r);
  const uint32_t biased = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0 ? 1u : 0u);
  return std::bit_cast<float>(std::min(biased, 255u) << 23);
}

// max|x| over a block; NaN is skipped (it stays NaN element-wise).
float block_amax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

template <class Roundtrip>
void quant_dequant_blocks(float* x, int64_t n, int64_t block, float (*scale_of)(float),
                          const char* who, Roundtrip roundtrip) {
  MOE_CHECK(block > 0 && n % block == 0, "{}: length {} is not a multiple of the block {}", who, n,
            block);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    float* v = x + b0;
    const float s = scale_of(block_amax(v, block));
    for (int64_t i = 0; i < block; ++i)
      if (!std::isnan(v[i])) v[i] = roundtrip(v[i] / s) * s;
  }
}

}  // namespace

float sim_fp8_scale(float amax) { return pow2_ceil_scale(amax, kFp8AmaxFloor, 1.0f / kFp8Max); }
float sim_fp4_scale(float amax) { return pow2_ceil_scale(amax, kFp4AmaxFloor, 1.0f / kFp4Max); }

void fp8_e4m3_quant_dequant(float* x, int64_t n, int64_t block) {
  quant_dequant_blocks(x, n, block, sim_fp8_scale, "fp8_e4m3_quant_dequant", [](float q) {
    return fp8_e4m3_value(fp8_e4m3_encode(std::clamp(q, -kFp8Max, kFp8Max)));
  });
}

void fp4_e2m1_quant_dequant(float* x, int64_t n, int64_t block) {
  quant_dequant_blocks(x, n, block, sim_fp4_scale, "fp4_e2m1_quant_dequant", [](float q) {
    return mxfp4::e2m1_value(mxfp4::e2m1_encode(std::clamp(q, -kFp4Max, kFp4Max)));
  });
}

void hadamard_rotate(float* x, int64_t n) {
  MOE_CHECK(n > 0 && (n & (n - 1)) == 0, "hadamard_rotate: length must be a power of two, got {}",
            n);
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

}  // namespace moe
