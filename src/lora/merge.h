#pragma once
// LoRA adapters merged into their base (`moe merge`, PEFT's merge_and_unload): every adapted
// weight W [out, in] becomes
//   W' = W + s·B·A          (A [r, in], B [out, r], s = alpha / r, or alpha / √r with rsLoRA)
// per routed expert for the grouped adapters, and on the bare kv_a_proj_with_mqa Param for its
// adapter (both of its row blocks, c_kv | k_pe, at once: B spans the whole output). The delta
// of a row is accumulated in double (Σ_k B[o,k]·A[k,:]), added to the row in double and rounded
// to fp32 once, so a merged fp32 model equals the unmerged one up to fp32 rounding of the
// summation order (measured ~1e-7 relative on the logits, tests/test_lora_merge.cpp).
//
// MXFP4 routed experts cannot hold W + s·B·A exactly. merge_lora_into_base re-quantizes them in
// place, row by row: decode the packed row (exact), add the delta row, quantize it back into the
// same bytes; the only scratch is one fp32 row, one double row and one row of scale bytes per
// thread, never a whole expert matrix. Each block of 32 takes the better (smaller error) of two
// encodings: quantize_row's own (the scale from the merged block's amax, what `moe quantize` of
// the fp32 merge writes) and the same values under the base's block scale, on whose grid W
// already lies, so a block's error never exceeds its ‖ΔW‖ (the fresh scale alone can cost twice
// ‖ΔW‖ for a small adapter: a block whose amax crosses a power of two is rounded again, coarser).
// Even so, an adapter whose ‖ΔW‖/‖W‖ is a few percent is mostly below MXFP4's resolution: the
// re-quantization error is then about ‖ΔW‖ itself, i.e. the routed experts' part of the adapter
// is largely lost (the other modules merge exactly). What it costs is reported per MoE layer
// (MergeLayerStats: compare rel_rms_error with rel_delta). A caller that wants the merged experts
// exact loads the base with fp32 experts instead (load_weights_decoding_experts: the packed values
// decode exactly) and merges into those.
//
// Rows are independent and each is computed by one iteration of a parallel loop; the per-layer
// error sums add per-row results in row order, so results are the same for any thread count.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "lora/lora_config.h"
#include "model/config.h"
#include "model/param.h"

namespace moe {

class CausalLM;

// One MoE layer's MXFP4 experts after re-quantizing W + ΔW (every expert matrix the adapters
// changed). The error is that of the re-quantization: merged fp32 values against the packed ones.
struct MergeLayerStats {
  int64_t layer = 0;
  int64_t matrices = 0;       // expert matrices re-quantized
  int64_t weights = 0;        // their elements
  double rel_rms_error = 0;   // ‖(W + ΔW) − Q(W + ΔW)‖ / ‖W + ΔW‖
  double max_abs_error = 0;   // max |(W + ΔW) − Q(W + ΔW)|
  double rel_delta = 0;       // ‖ΔW‖ / ‖W + ΔW‖: the adapter's size, for comparison
};

struct MergeReport {
  int64_t matrices = 0;  // base matrices changed (each routed expert's projection counts once)
  std::vector<MergeLayerStats> requantized;  // MoE layers with MXFP4 experts, in layer order
};

// Adds every adapter of `model` (from add_lora / apply_peft_adapter with these `settings`, which
// give each adapter's s) into the base weight it adapts, fp32 or MXFP4 (re-quantized, above),
// then drops the adapters: model.has_lora() is false afterwards and lora_params() empty.
// The model keeps no reference from an adapter Param to its module, so the pairing is by PEFT
// name: base_model.model.<module>.lora_{A,B}.weight adapts <module>.weight (DeepSeek-V4: the
// released key of that Hugging Face module, v4_weight_of_hf_module); shapes are checked.
MergeReport merge_lora_into_base(CausalLM& model, const LoraSettings& settings);

// An adapter directory attached to a loaded base for inference (moe sample / logits / merge
// --adapter): read_peft_adapter_config, add_lora, load_peft_adapter_weights (the adapter
// unmerged), and checks a plain apply_peft_adapter does not make: the directory exists, and
// every tensor of adapter_model.safetensors adapts a module of this model (an adapter made for
// a deeper model or other targets would otherwise load with tensors silently ignored).
struct AttachedAdapter {
  LoraSettings settings;
  // Set when the directory records its base (base_model.json, written by `moe finetune`) and
  // `base_dir` is not that model (its config or tensor index differ): the message of
  // check_base_model. A warning, not an error: a base re-saved in another dtype differs too.
  std::string base_mismatch;
};
AttachedAdapter attach_peft_adapter(const std::filesystem::path& adapter_dir,
                                    const std::filesystem::path& base_dir, CausalLM& model);

// The model config an adapter is applied to: `base`, with the routed experts in the format the
// adapter was trained with. `moe finetune` records the model's config.json in each checkpoint,
// with quantization_config when the experts were MXFP4 — also when the base on disk is fp32 and
// was quantized on load (--model.experts mxfp4). The adapter learned against those quantized
// experts, so an fp32 base is then loaded with MXFP4 experts again (quantized on load, the same
// bits as during the fine-tune) and `note` says so. An adapter trained on fp32 experts applied to
// an MXFP4 base cannot get its experts back: `note` warns. No config.json (a PEFT directory from
// elsewhere): `base` as it is.
ModelConfig config_for_adapter(const ModelConfig& base, const std::filesystem::path& adapter_dir,
                               std::string* note);

// Rounds every fp32 routed-expert matrix among `params` through MXFP4 in place (quantize_row,
// then dequantize_row, row by row): the exact values an MXFP4 model loaded from them holds.
void round_experts_through_mxfp4(const ParamList& params);

// load_weights for a model whose routed experts are fp32 (ModelConfig::expert_format "fp32")
// from a directory whose experts may be MXFP4 (I8 weight + F8_E8M0 scale pairs): those are
// decoded exactly, row by row, straight into the fp32 parameters; everything else loads as
// load_weights does (with its checks).
void load_weights_decoding_experts(const std::filesystem::path& model_dir,
                                   const ParamList& params);

}  // namespace moe
