#pragma once
// Hugging Face config.json <-> ModelConfig for model_type deepseek_v3, deepseek_v2 and
// deepseek_v4 (the released DeepSeek-V4-Flash fields, SPEC §6.1).
//
// Reading follows transformers' semantics where they are unambiguous: null q_lora_rank means a
// single q_proj, null n_routed_experts a dense model, null n_group/topk_group one group, null or
// "default" rope_scaling no scaling, and topk_method / scoring_func / norm_topk_prob /
// routed_scaling_factor / token ids / max_position_embeddings default per model_type. Fields
// that fix parameter shapes have no silent default (transformers would substitute the 671B
// sizes): a config missing one is rejected. Unknown fields are ignored; a known field with the
// wrong JSON type or an unsupported value is an error naming the file, the field and what was
// expected.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "io/fp8.h"
#include "model/config.h"

namespace moe {

inline constexpr const char* kHfConfigFile = "config.json";

// `path` is a config.json file or a model directory containing one. Validates the result.
ModelConfig read_hf_config(const std::filesystem::path& path);
// `source` names the origin in error messages (a file path, "test", ...). Validates the result.
ModelConfig parse_hf_config(const nlohmann::json& j, const std::string& source);

// What config.json says about the weight files beyond the model itself: the quantization of a
// released checkpoint and its multi-token-prediction (MTP) layers. parse_hf_config checks the
// same fields (an unsupported quantization is an error there too).
//
//   quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
//                        "activation_scheme": "dynamic", "scale_fmt": "ue8m0" (V3.1, optional)}
//     DeepSeek-V3/R1/V3.1: F8_E4M3 linears with F32 block scales (io/fp8.h), dequantized on load.
//     DeepSeek-V4 (model_type "deepseek_v4"): the same with E8M0 scales named `X.scale`, plus
//     the routed experts packed as MXFP4 (config.json expert_dtype "fp4", SPEC §6.3).
//   quantization_config {"quant_method": "mxfp4", ...}: packed routed experts (SPEC §5).
//   num_nextn_predict_layers N: the MTP layers at model.layers.[num_hidden_layers, +N). This
//     engine does not use them: loading skips them with a one-line notice, inspect lists them,
//     convert and quantize leave them out of the new model.
struct HfWeightsInfo {
  std::string model_type;         // config.json's ("" without a config.json)
  std::string quant_method;       // "", "fp8" or "mxfp4"
  int64_t fp8_block_rows = 128;   // weight_block_size[0]: output rows per scale
  int64_t fp8_block_cols = 128;   // weight_block_size[1]: input columns per scale
  std::string fp8_scale_fmt;      // "" (any F32) or "ue8m0" (powers of two)
  int64_t num_hidden_layers = 0;
  int64_t num_nextn_predict_layers = 0;
  // The MTP layer index of a tensor name (model.layers.L.* with L >= num_hidden_layers), or -1.
  // Always -1 for DeepSeek-V4, whose MTP layer (mtp.0.*) is part of the model.
  int64_t mtp_layer_of(const std::string& tensor_name) const;
  bool v4() const { return model_type == "deepseek_v4"; }
  // weight_block_size, with the scale name of this model_type (V4: X.scale).
  Fp8Block fp8_block() const {
    return {fp8_block_rows, fp8_block_cols,
            v4() ? Fp8ScaleKey::Scale : Fp8ScaleKey::WeightScaleInv};
  }
};
HfWeightsInfo parse_hf_weights_info(const nlohmann::json& j, const std::string& source);
// `path` is a config.json file or a model directory; a directory without config.json gives the
// defaults (no quantization, no MTP layers).
HfWeightsInfo read_hf_weights_info(const std::filesystem::path& path);

// A config.json transformers accepts (DeepseekV3ForCausalLM / DeepseekV2ForCausalLM). Holds
// every ModelConfig field, so json -> config -> json -> config is lossless.
nlohmann::json model_config_to_json(const ModelConfig& cfg);
// Writes <dir>/config.json atomically; `dir` must exist.
void write_hf_config(const std::filesystem::path& dir, const ModelConfig& cfg);

}  // namespace moe
