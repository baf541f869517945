#include "io/model_spec.h"

#include <filesystem>

#include "core/error.h"
#include "io/hf_config.h"
#include "model/presets.h"

namespace moe {

std::string preset_names_joined() {
  std::string out;
  for (const auto& p : model_presets()) out += (out.empty() ? "" : ", ") + p.name;
  return out;
}

ModelConfig resolve_model_config(const std::string& spec) {
  if (std::filesystem::exists(spec)) return read_hf_config(spec);
  for (const auto& p : model_presets())
    if (p.name == spec) return parse_hf_config(nlohmann::json::parse(p.config_json), "preset " + spec);
  fail("--config {}: not a file, a model directory or a preset (presets: {})", spec,
       preset_names_joined());
}

}  // namespace moe
