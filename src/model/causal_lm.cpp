#include "model/causal_lm.h"

#include "core/error.h"
#include "model/model.h"
#include "model/v4/v4_model.h"

namespace moe {

std::unique_ptr<CausalLM> make_causal_lm(const ModelConfig& cfg,
                                         std::shared_ptr<Dispatcher> dispatcher) {
  if (cfg.is_v4()) return std::make_unique<DeepSeekV4Model>(cfg, std::move(dispatcher));
  return std::make_unique<DeepSeekModel>(cfg, std::move(dispatcher));
}

void CausalLM::set_expert_activations(ExpertActivations activations) {
  const std::vector<MoELayer*> layers = moe_layers();
  if (activations != ExpertActivations::Fp32) {
    MOE_CHECK(!layers.empty(), "{} expert activations need MXFP4 routed experts, but this {} "
              "model has no MoE layer", expert_activations_name(activations), config().model_type);
    MOE_CHECK(config().mxfp4_experts(), "{} expert activations need MXFP4 routed experts, but "
              "this {} model's are {}", expert_activations_name(activations), config().model_type,
              config().expert_format);
  }
  for (MoELayer* layer : layers) layer->set_expert_activations(activations);
}

}  // namespace moe
