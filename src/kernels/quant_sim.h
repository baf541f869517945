#pragma once
// Simulated low precision as DeepSeek-V4's reference inference code computes it (its
// inference/kernel.py act_quant and fp4_act_quant called with inplace=True, and model.py's
// rotate_activation): values are quantized to a narrow format and decoded again at once, so
// the arithmetic after it runs in fp32 on values the narrow format can hold. DeepSeek trained
// V4 with this in its forward (quantization-aware); model/v4 applies it when
// ModelConfig::quantization_simulation is "reference".
//
// Block quantize-dequantize, per `block` consecutive values x (n a multiple of block):
//   amax = max(max|x|, floor)
//   s    = 2^ceil(log2(amax · (1/max)))     "ue8m0": a power of two, the ceiling taken from the
//                                            float bits of the fp32 product (the reference's
//                                            fast_round_scale), so s·max >= amax
//   x    ← decode(encode(clamp(x / s, −max, max))) · s       (x / s and the product are exact)
//   FP8  E4M3 (fp8_e4m3_encode): max 448, floor 1e-4
//   FP4  E2M1 (mxfp4::e2m1_encode): max 6, floor 6 · 2^-126
// Both encoders round to nearest, ties to even. The scale rule is DeepSeek's, not OCP MX's
// (mxfp4::quantize_row takes floor(log2 amax) − 2): amax 7 gets scale 2 here and 1 there.
//
// What differs from the reference: it quantizes bf16 activations, the engine its fp32 ones (no
// bf16 rounding first). NaN stays NaN (the reference leaves it to the GPU cast).
//
// Scalar and serial per call: the same bits on every SIMD target and thread count.
#include <cstdint>

namespace moe {

inline constexpr int64_t kSimFp8Block = 64;  // act_quant(kv[..., :-rope], 64, "ue8m0", ...)
inline constexpr int64_t kSimFp4Block = 32;  // fp4_act_quant(x, fp4_block_size = 32, ...)

// The power-of-two block scales (see above).
float sim_fp8_scale(float amax);
float sim_fp4_scale(float amax);

// In place over x[0, n), blocks of `block`.
void fp8_e4m3_quant_dequant(float* x, int64_t n, int64_t block);
void fp4_e2m1_quant_dequant(float* x, int64_t n, int64_t block);

// x ← H·x / sqrt(n), H the n×n Sylvester Hadamard matrix (H_1 = [1], H_2m = [[H, H], [H, −H]]),
// n a power of two: orthonormal, and its own inverse. The fast transform's butterflies in a
// fixed order, then one multiply by the fp32 1/sqrt(n).
void hadamard_rotate(float* x, int64_t n);

}  // namespace moe
