// adapter_config.json <-> LoraSettings (lora/peft_adapter.h), apart from the adapter weights
// (peft_adapter.cpp): reading the settings alone needs no model (tests/fuzz links just this).
#include <cmath>
#include <optional>
#include <type_traits>

#include "core/error.h"
#include "core/limits.h"
#include "lora/peft_adapter.h"

namespace moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

json peft_adapter_config(const LoraSettings& s, const std::string& base_model) {
  json targets;
  if (!s.target_regex.empty()) targets = s.target_regex;
  else if (s.targets == std::vector<std::string>{"all-linear"}) targets = "all-linear";
  else targets = s.targets;
  json rank_pattern = json::object(), alpha_pattern = json::object();
  if (s.expert_r > 0 && s.expert_r != s.r) rank_pattern[kExpertRankPattern] = s.expert_r;
  if (s.expert_alpha > 0 && s.expert_alpha != s.alpha) alpha_pattern[kExpertRankPattern] = s.expert_alpha;
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base_model},
          {"r", s.r},
          {"lora_alpha", s.alpha},
          {"lora_dropout", s.dropout},
          {"use_rslora", s.rslora},
          {"target_modules", targets},
          {"rank_pattern", rank_pattern},
          {"alpha_pattern", alpha_pattern},
          {"bias", "none"},
          {"fan_in_fan_out", false},
          {"init_lora_weights", true},
          {"inference_mode", true},
          {"use_dora", false},
          {"modules_to_save", nullptr},
          {"layers_to_transform", nullptr},
          {"layers_pattern", nullptr},
          {"revision", nullptr},
          {"library", "moe"}};
}

namespace {

template <typename T>
T field(const json& j, const char* key, T fallback, const std::string& source, const char* want) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  // nlohmann turns a float into an integer with a plain cast, undefined outside the type's range.
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    if (!j[key].is_number_integer())
      fail("{}: field '{}': expected {}, got {}", source, key, want, j[key].dump());
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    fail("{}: field '{}': expected {}, got {}", source, key, want, j[key].dump());
  }
}

// A PEFT feature the engine does not implement, present with a non-default value.
void reject_unless(const json& j, const char* key, const json& allowed, const std::string& source,
                   const char* what) {
  if (!j.contains(key) || j[key].is_null() || j[key] == allowed) return;
  if (j[key].is_array() && j[key].empty()) return;
  if (j[key].is_object() && j[key].empty()) return;
  fail("{}: field '{}' = {}: {} is not supported by moe", source, key, j[key].dump(), what);
}

// rank_pattern / alpha_pattern hold only the routed experts' own values: per expert (DeepSeek-V2/
// V3) or per fused parameter (DeepSeek-V4); only the patterns moe writes are understood.
struct ExpertPatterns {
  std::optional<double> per_expert, gate_up, down;
};

ExpertPatterns expert_patterns(const json& j, const char* key, const std::string& source) {
  ExpertPatterns out;
  if (!j.contains(key) || j[key].is_null()) return out;
  MOE_CHECK(j[key].is_object(), "{}: field '{}': expected an object", source, key);
  for (const auto& [pattern, value] : j[key].items()) {
    MOE_CHECK(value.is_number() && (pattern == kExpertRankPattern ||
                                    pattern == kFusedGateUpPattern || pattern == kFusedDownPattern),
              "{}: field '{}': only {{\"{}\": number}} (the routed experts' own value), or for "
              "DeepSeek-V4's fused experts \"{}\" / \"{}\", is supported, got \"{}\": {}", source,
              key, kExpertRankPattern, kFusedGateUpPattern, kFusedDownPattern, pattern,
              value.dump());
    (pattern == kExpertRankPattern    ? out.per_expert
     : pattern == kFusedGateUpPattern ? out.gate_up
                                      : out.down) = value.get<double>();
  }
  return out;
}

// A rank_pattern value as a rank: JSON gives a double, which must be a whole number in range
// before it becomes an integer (0: no pattern).
int64_t pattern_rank(double rank, const std::string& source) {
  MOE_CHECK(rank >= 0 && rank <= static_cast<double>(kMaxLoraRank) && std::floor(rank) == rank,
            "{}: field 'rank_pattern': expected an integer rank in [1, {}], got {}", source,
            kMaxLoraRank, rank);
  return static_cast<int64_t>(rank);
}

// s.expert_r / s.expert_alpha (0: r / alpha) from the patterns. With fused target_parameters the
// patterns give PEFT's rank and alpha of each fused parameter: gate_up stands for the separate
// gate and up adapters, rank 2·r_e and alpha 2·alpha_e (√2·alpha_e with rsLoRA).
void read_expert_rank_and_alpha(const json& j, LoraSettings& s, const std::string& source) {
  const ExpertPatterns rank = expert_patterns(j, "rank_pattern", source);
  const ExpertPatterns alpha = expert_patterns(j, "alpha_pattern", source);
  bool gate_up = false, down = false;
  for (const std::string& t : s.target_parameters) {
    gate_up |= t.ends_with("gate_up_proj");
    down |= t.ends_with("down_proj");
  }
  if (!gate_up && !down) {
    MOE_CHECK(!rank.gate_up && !rank.down && !alpha.gate_up && !alpha.down,
              "{}: rank_pattern / alpha_pattern name the fused routed-expert parameters, but "
              "target_parameters targets none", source);
    s.expert_r = pattern_rank(rank.per_expert.value_or(0), source);
    s.expert_alpha = alpha.per_expert.value_or(0);
    return;
  }
  MOE_CHECK(!rank.per_expert && !alpha.per_expert,
            "{}: rank_pattern / alpha_pattern mix the per-expert pattern \"{}\" with fused "
            "target_parameters", source, kExpertRankPattern);
  const double gate_up_rank = rank.gate_up.value_or(static_cast<double>(s.r));
  const double gate_up_alpha = alpha.gate_up.value_or(s.alpha);
  const double down_rank = rank.down.value_or(static_cast<double>(s.r));
  const double down_alpha = alpha.down.value_or(s.alpha);
  const double alpha_factor = s.rslora ? std::sqrt(2.0) : 2.0;
  double r = down_rank, a = down_alpha;
  MOE_CHECK(!down || (down_rank >= 1 && std::floor(down_rank) == down_rank),
            "{}: field 'rank_pattern': the fused mlp.experts.down_proj has rank {}; expected a "
            "positive integer", source, down_rank);
  if (gate_up) {
    MOE_CHECK(gate_up_rank >= 2 && std::fmod(gate_up_rank, 2.0) == 0,
              "{}: field 'rank_pattern': the fused mlp.experts.gate_up_proj has rank {}; moe adapts "
              "the routed experts' gate and up with separate rank-r adapters, stored as one "
              "block-diagonal rank-2r adapter (SPEC §8.6): expected an even rank", source,
              gate_up_rank);
    const double gate_up_r = gate_up_rank / 2, gate_up_a = gate_up_alpha / alpha_factor;
    if (down)
      MOE_CHECK(gate_up_r == down_rank &&
                    std::fabs(gate_up_a - down_alpha) <= 1e-12 * std::fabs(down_alpha),
                "{}: the fused mlp.experts.gate_up_proj has rank {} and alpha {}, "
                "mlp.experts.down_proj rank {} and alpha {}: moe gives the routed experts' "
                "projections one rank r and one scaling, so gate_up must have rank 2r and alpha "
                "{} times down's", source, gate_up_rank, gate_up_alpha, down_rank, down_alpha,
                s.rslora ? "√2" : "2");
    else
      r = gate_up_r, a = gate_up_a;
  }
  const int64_t expert_r = pattern_rank(r, source);
  s.expert_r = expert_r != s.r ? expert_r : 0;
  // gate_up's alpha divided by √2 may miss alpha by an ulp: that is alpha.
  s.expert_alpha = std::fabs(a - s.alpha) <= 1e-12 * s.alpha ? 0.0 : a;
}

}  // namespace

LoraSettings lora_settings_from_peft(const json& j, const std::string& source) {
  MOE_CHECK(j.is_object(), "{}: expected a JSON object", source);
  const std::string type = field<std::string>(j, "peft_type", "LORA", source, "a string");
  MOE_CHECK(type == "LORA", "{}: field 'peft_type': expected \"LORA\", got \"{}\"", source, type);
  reject_unless(j, "use_dora", false, source, "DoRA");
  reject_unless(j, "bias", "none", source, "training biases");
  reject_unless(j, "fan_in_fan_out", false, source, "fan_in_fan_out (Conv1D layers)");
  reject_unless(j, "modules_to_save", nullptr, source, "full fine-tuning of extra modules");
  reject_unless(j, "layers_to_transform", nullptr, source, "layer selection");
  reject_unless(j, "layer_replication", nullptr, source, "layer replication");
  reject_unless(j, "use_qalora", false, source, "QA-LoRA");
  reject_unless(j, "lora_bias", false, source, "a bias on lora_B (lora_bias)");
  reject_unless(j, "trainable_token_indices", nullptr, source, "trainable token embeddings");
  reject_unless(j, "exclude_modules", nullptr, source, "exclude_modules");
  LoraSettings s;
  s.r = field<int64_t>(j, "r", 8, source, "an integer");
  s.alpha = field<double>(j, "lora_alpha", 8.0, source, "a number");
  s.dropout = field<double>(j, "lora_dropout", 0.0, source, "a number");
  s.rslora = field<bool>(j, "use_rslora", false, source, "true or false");
  s.target_parameters = field<std::vector<std::string>>(j, "target_parameters", {}, source,
                                                        "a list of parameter names");
  for (const std::string& t : s.target_parameters) {
    // PEFT matches these by suffix, as target_modules: "down_proj" selects every layer's too.
    bool fused = false;
    for (const std::string param : {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
      fused |= target_selects(t, param) || t.ends_with("." + param);
    MOE_CHECK(fused,
              "{}: field 'target_parameters': \"{}\" is not supported; moe adapts only the routed "
              "experts' fused parameters (…mlp.experts.gate_up_proj, …mlp.experts.down_proj of "
              "DeepSeek-V4)", source, t);
  }
  const bool has_modules = j.contains("target_modules") && !j["target_modules"].is_null();
  MOE_CHECK(has_modules || !s.target_parameters.empty(),
            "{}: field 'target_modules' is missing", source);
  s.targets.clear();
  if (has_modules) {
    const json& t = j["target_modules"];
    if (t.is_string()) {
      const std::string v = t.get<std::string>();
      if (v == "all-linear") s.targets = {v};
      else s.target_regex = v;
    } else {
      s.targets = field<std::vector<std::string>>(j, "target_modules", {}, source,
                                                  "a list of module names or a regex string");
    }
  }
  read_expert_rank_and_alpha(j, s, source);
  s.validate(source);
  return s;
}

LoraSettings read_peft_adapter_config(const fs::path& dir) {
  const fs::path file = dir / kAdapterConfigFile;
  MOE_CHECK(fs::is_regular_file(file), "{}: not a PEFT adapter directory (no {})", dir.string(),
            kAdapterConfigFile);
  const json j = json::parse(read_text_file_capped(file, "the adapter config"),
                            json_depth_limit<json>(file.string()), /*allow_exceptions=*/false);
  MOE_CHECK(!j.is_discarded(), "{}: not valid JSON", file.string());
  return lora_settings_from_peft(j, file.string());
}

bool is_peft_adapter_dir(const fs::path& dir) {
  return fs::is_regular_file(dir / kAdapterConfigFile);
}

}  // namespace moe
