#pragma once
// LoRA over DeepSeek-V4 (DeepSeekV4Model::add_lora, v4_lora.cpp). Targets are matched against the
// module names of Hugging Face's deepseek_v4 model (SPEC §8.5), which is what PEFT sees, while the
// engine's parameters keep DeepSeek's released keys:
//
//   HF module (model.layers.L. + …)        released weight (layers.L. + …)   adapted as
//   self_attn.q_a_proj / q_b_proj           attn.wq_a / attn.wq_b             lora.Linear
//   self_attn.kv_proj / o_b_proj            attn.wkv / attn.wo_b              lora.Linear
//   mlp.shared_experts.{gate,up,down}_proj  ffn.shared_experts.w1 / w3 / w2   lora.Linear
//   mlp.experts.E.{gate,up,down}_proj       ffn.experts.E.w1 / w3 / w2        one grouped adapter
//                                                                             per projection
// Routed experts are selected all or none per projection, as for V3, by their per-expert names or
// by PEFT's target_parameters mlp.experts.gate_up_proj (gate and up) / mlp.experts.down_proj.
// Gate and up go together: Hugging Face holds them as one fused parameter that PEFT adapts whole
// (the adapter file stores them as one block-diagonal rank-2r adapter, lora/peft_adapter.h).
//
// Never adapted:
//   * self_attn.o_a_proj (wo_a): a grouped linear applied per output group; a PEFT lora.Linear on
//     it would not even have the base output's shape (SPEC §8.5). Naming it in a target is an
//     error; "all-linear" leaves it out.
//   * the compressor's kv_proj / gate_proj (attn.compressor.wkv / wgate): they do get gradients,
//     but in the engine they are not linear layers: the compressor multiplies them into its
//     windowed rows inside its per-feature softmax pooling, and there is no layer to host an
//     adapter beside them. A suffix target ("kv_proj") that PEFT would also apply to them adapts
//     only self_attn.kv_proj here, and the saved adapter_config.json lists full module paths, so
//     PEFT rebuilds exactly these adapters and no others.
//   * the indexer (compressor.indexer.*): its output is integer picks, so it gets no gradient
//     (SPEC §6.6) and an adapter there would never train.
//   * the MTP layer (mtp.0.*): Hugging Face drops it at load, so PEFT has no names for it; its
//     base weights stay frozen and its loss still reaches the main layers' adapters.
// A target that reaches only modules of these kinds is an error saying so.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

struct ModelConfig;
class LoraTargetMatcher;

// Which modules of main layer `layer` the targets adapt, by the rules above (the errors
// included: a named o_a_proj, part of the routed experts, gate without up). add_lora builds its
// adapters from this, and `moe plan` sizes them from it (train/memory_plan.cpp).
struct V4LayerLora {
  bool wq_a = false, wq_b = false, wkv = false, wo_b = false;
  std::array<bool, 3> shared{};   // the shared experts' gate, up, down (w1, w3, w2)
  std::array<bool, 3> experts{};  // the routed experts' grouped adapters: gate, up, down
};
V4LayerLora select_v4_lora(const ModelConfig& cfg, int64_t layer, LoraTargetMatcher& match,
                           const std::string& section);
// After every layer's selection: a target that matched nothing is an error, saying why when it
// reaches only modules that are never adapted.
void check_v4_lora_targets_used(const ModelConfig& cfg, const LoraTargetMatcher& match,
                                const std::string& section);

// The released checkpoint key of the weight a Hugging Face deepseek_v4 module name stands for,
// for the modules LoRA adapts ("model.layers.3.self_attn.q_a_proj" -> "layers.3.attn.wq_a.weight",
// "model.layers.3.mlp.experts.5.gate_proj" -> "layers.3.ffn.experts.5.w1.weight"); empty for any
// other name.
std::string v4_weight_of_hf_module(std::string_view module);

// The reverse, from a released module name (a weight key without ".weight"): "layers.3.attn.wkv"
// -> "model.layers.3.self_attn.kv_proj"; empty for a module LoRA does not adapt.
std::string v4_hf_module_of(std::string_view released_module);

}  // namespace moe
