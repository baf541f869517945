#pragma once
// What the routed experts' forward Y = X·Wᵀ does with its activations X (`moe generate`,
// `moe serve` and `moe logits` --expert-activations):
//   Fp32  the exact product: fp32 activations times the weights (for MXFP4 experts, decoded
//         block by block, kernels/mxfp4_gemm.h). The default, and the only one training,
//         LoRA fine-tuning and evaluation ever run.
//   Int8  MXFP4 experts, inference only: each 32-element block of X is rounded to int8 and the
//         E2M1 × int8 products are summed exactly (kernels/mxfp4_gemm_q8.h), so each output
//         moves by at most Σ_blocks (amax/254)·Σ|w| from the exact product. Its rounding has no
//         backward: a Train forward of a layer set to Int8 is an error (MoELayer::forward).
namespace moe {

enum class ExpertActivations { Fp32, Int8 };

inline const char* expert_activations_name(ExpertActivations a) {
  return a == ExpertActivations::Int8 ? "int8" : "fp32";
}

}  // namespace moe
