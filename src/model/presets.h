#pragma once
// Model presets from configs/models/*.json, compiled into the library.
#include <string>
#include <vector>

namespace moe {

struct ModelPreset {
  std::string name;
  std::string config_json;  // Hugging Face config.json text
};

const std::vector<ModelPreset>& model_presets();

}  // namespace moe
