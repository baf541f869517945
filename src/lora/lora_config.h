#pragma once
// What a LoRA fine-tune adapts, in PEFT's terms (SPEC §8.4): rank, alpha, dropout, rsLoRA, and
// the target modules, named by Hugging Face module names such as
// "model.layers.3.self_attn.q_a_proj" or "model.layers.3.mlp.experts.17.gate_proj".
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lora/lora_adapter.h"

namespace moe {

// Adapter matrices are rank x width: far above any rank in use, the bound keeps their sizes
// (and a file's rank_pattern) from overflowing.
inline constexpr int64_t kMaxLoraRank = int64_t{1} << 16;

struct LoraSettings {
  int64_t r = 8;
  double alpha = 16.0;
  double dropout = 0.0;
  bool rslora = false;  // s = alpha / √r instead of alpha / r
  // PEFT's target_modules as a list: a module is adapted when its name equals an entry or ends
  // with "." + entry; "all-linear" adapts every linear layer (attention projections, dense and
  // shared-expert MLPs, routed experts; not the router or the LM head, as in PEFT; for
  // DeepSeek-V4 model/v4/v4_lora.h lists what is never adapted).
  std::vector<std::string> targets = {"all-linear"};
  // PEFT's target_modules as one string: a regular expression the whole module name must match
  // (re.fullmatch). Takes the place of `targets` when not empty.
  std::string target_regex;
  // PEFT's target_parameters: 3-D parameters adapted as a whole, matched like `targets` entries
  // (equal, or a suffix after a "."). Only DeepSeek-V4 has them: Hugging Face's deepseek_v4
  // holds each layer's routed experts fused, model.layers.L.mlp.experts.gate_up_proj (adapts
  // the experts' gate and up projections) and .down_proj (SPEC §8.1, §8.5).
  std::vector<std::string> target_parameters;
  // Routed experts may take their own rank and alpha (PEFT's rank_pattern / alpha_pattern):
  // 0 means r / alpha.
  int64_t expert_r = 0;
  double expert_alpha = 0.0;

  int64_t rank_for(bool routed_expert) const {
    return routed_expert && expert_r > 0 ? expert_r : r;
  }
  double alpha_for(bool routed_expert) const {
    return routed_expert && expert_alpha > 0 ? expert_alpha : alpha;
  }
  LoraShape shape_for(bool routed_expert) const;
  // Errors name `section` (e.g. "lora") and the key.
  void validate(const std::string& section) const;
};

// Decides module by module, and remembers which list entries matched something so that a
// target naming nothing in the model is an error (as in PEFT) instead of a silent no-op.
// A compiled target_regex (PCRE2; lora_config.cpp).
class TargetRegex;

class LoraTargetMatcher {
 public:
  explicit LoraTargetMatcher(const LoraSettings& settings);
  bool matches(const std::string& module);
  // A fused 3-D parameter (target_parameters), e.g. "model.layers.3.mlp.experts.gate_up_proj".
  bool matches_parameter(const std::string& parameter);
  // Whether a target names `module` on purpose: a list entry other than "all-linear", or the
  // regex. Nothing is marked used: for modules the model refuses to adapt.
  bool names(const std::string& module) const;

  // The first setting that matched nothing: its field ("targets", "target_regex" or
  // "target_parameters") and value.
  struct Unused {
    std::string field, entry;
  };
  std::optional<Unused> first_unused() const;
  // Raises naming the first list entry that matched no module (or the regex, if it matched
  // none). `module_hint`: what the model's module names look like (default: DeepSeek-V2/V3's).
  void check_all_used(const std::string& section, const std::string& module_hint = {}) const;

 private:
  const LoraSettings& s_;
  std::vector<bool> used_, parameter_used_;
  std::shared_ptr<TargetRegex> regex_;  // compiled once; null without target_regex
  bool regex_used_ = false;
};

// Whether a PEFT target entry selects a module or parameter name: the name itself, or a suffix
// of it after a ".".
bool target_selects(const std::string& target, const std::string& name);

}  // namespace moe
