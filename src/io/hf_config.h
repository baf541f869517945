#pragma once
// Hugging Face config.json <-> ModelConfig for model_type deepseek_v3 and deepseek_v2.
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

#include "model/config.h"

namespace moe {

inline constexpr const char* kHfConfigFile = "config.json";

// `path` is a config.json file or a model directory containing one. Validates the result.
ModelConfig read_hf_config(const std::filesystem::path& path);
// `source` names the origin in error messages (a file path, "test", ...). Validates the result.
ModelConfig parse_hf_config(const nlohmann::json& j, const std::string& source);

// A config.json transformers accepts (DeepseekV3ForCausalLM / DeepseekV2ForCausalLM). Holds
// every ModelConfig field, so json -> config -> json -> config is lossless.
nlohmann::json model_config_to_json(const ModelConfig& cfg);
// Writes <dir>/config.json atomically; `dir` must exist.
void write_hf_config(const std::filesystem::path& dir, const ModelConfig& cfg);

}  // namespace moe
