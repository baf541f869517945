#pragma once
// The scalar OCP E4M3 "FN" codec (torch.float8_e4m3fn, safetensors F8_E4M3): sign, 4 exponent
// bits (bias 7), 3 mantissa bits; no infinities; 0x7F and 0xFF are NaN; the largest finite value
// is ±448; exponent 0 holds the subnormals m · 2^-9. Here rather than in io/ because both the
// checkpoint readers (io/fp8.h) and the model's simulated FP8 (kernels/quant_sim.h) use it.
#include <cstdint>

namespace moe {

float fp8_e4m3_value(uint8_t byte);
// All 256 values indexed by byte, for loops that decode many (no call per byte).
const float* fp8_e4m3_values();
// The nearest E4M3 byte, ties to the even code; |v| >= 448 (infinities included) saturates to
// ±448; NaN gives 0x7F (0xFF with the sign bit set). fp8_e4m3_encode(fp8_e4m3_value(b)) == b for
// every non-NaN byte except -0 -> 0x80 (kept).
uint8_t fp8_e4m3_encode(float v);

}  // namespace moe
