#include "core/error.h"
#include "model/v4/v4_model.h"

namespace moe {

const ParamList& DeepSeekV4Model::add_lora(const LoraSettings&, uint64_t, const std::string& section) {
  fail("{}: LoRA over DeepSeek-V4 is not built yet", section);
}

void DeepSeekV4Model::drop_lora() { lora_params_.clear(); }

}  // namespace moe
