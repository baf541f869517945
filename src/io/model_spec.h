#pragma once
// Where a model configuration comes from: a preset name (configs/models, built in), a
// config.json file, or a model directory holding one.
#include <string>

#include "model/config.h"

namespace moe {

ModelConfig resolve_model_config(const std::string& spec);
std::string preset_names_joined();

}  // namespace moe
