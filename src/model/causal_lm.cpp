#include "model/causal_lm.h"

#include "model/model.h"
#include "model/v4/v4_model.h"

namespace moe {

std::unique_ptr<CausalLM> make_causal_lm(const ModelConfig& cfg,
                                         std::shared_ptr<Dispatcher> dispatcher) {
  if (cfg.is_v4()) return std::make_unique<DeepSeekV4Model>(cfg, std::move(dispatcher));
  return std::make_unique<DeepSeekModel>(cfg, std::move(dispatcher));
}

}  // namespace moe
