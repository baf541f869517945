#pragma once
// Where DeepSeek-V4's reference forward quantize-dequantizes its activations
// (ModelConfig::quantization_simulation = "reference"; the arithmetic is kernels/quant_sim.h):
//
//   attention      the shared KV rows after kv_norm and RoPE        Fp8NonRope
//   compressor     the main compressor's entries after norm + RoPE  Fp8NonRope
//   indexer        its queries after RoPE, per head, and its own    HadamardFp4
//                  compressor's entries after norm + RoPE
//
// Fp8NonRope: E4M3 over the first width − rope_dim features of a row, blocks of 64 (the rotated
// tail stays fp32, as the reference keeps it bf16). HadamardFp4: the whole row rotated by the
// orthonormal Hadamard transform, then E2M1 in blocks of 32. The rotation changes no dot product
// of two rotated rows; it spreads outliers before the coarse FP4 grid.
#include <cstdint>

namespace moe {

enum class SimulatedPrecision { None, Fp8NonRope, HadamardFp4 };

// rows [n_rows, width] (contiguous) in place; rope_dim: the rotated tail Fp8NonRope leaves alone.
// Rows run in parallel, each one serially: the same bits for any thread count.
void simulate_precision(SimulatedPrecision kind, float* rows, int64_t n_rows, int64_t width,
                        int64_t rope_dim);

}  // namespace moe
