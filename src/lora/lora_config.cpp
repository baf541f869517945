#include "lora/lora_config.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cmath>
#include <memory>

#include "core/error.h"

namespace moe {

namespace {

constexpr size_t kMaxTargetRegexBytes = 1024;
// Backtracking steps one module name may cost: a name is under ~60 bytes, so a sensible pattern
// needs a few hundred; ".*.*.*...x" needs exponentially many.
constexpr uint32_t kRegexMatchLimit = 100000;
// Backtracking memory one match may take (KiB).
constexpr uint32_t kRegexHeapLimitKiB = 8192;

struct RegexDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
  void operator()(pcre2_match_context* context) const { pcre2_match_context_free(context); }
};
using Regex = std::unique_ptr<pcre2_code, RegexDeleter>;

// PEFT matches a string target_modules with Python's re.fullmatch. PCRE2 speaks that dialect
// (std::regex's ECMAScript does not quite), checks the numbers in a pattern (libstdc++'s parser
// overflowed on a back-reference such as \2222222222222222222), and its match limit turns
// exponential backtracking into an error instead of a hang.
Regex compile_target_regex(const std::string& pattern, const std::string& section) {
  MOE_CHECK(pattern.size() <= kMaxTargetRegexBytes,
            "{}.target_regex: {} bytes; a module-name pattern may have at most {}", section,
            pattern.size(), kMaxTargetRegexBytes);
  int error = 0;
  PCRE2_SIZE offset = 0;
  Regex code(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), 0, &error,
                           &offset, nullptr));
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    fail("{}.target_regex: \"{}\" is not a regular expression: {} at offset {}", section, pattern,
         reinterpret_cast<const char*>(message), offset);
  }
  return code;
}

}  // namespace

// Compiled once per matcher: a model has tens of thousands of module names.
class TargetRegex {
 public:
  explicit TargetRegex(const std::string& pattern)
      : pattern_(pattern),
        code_(compile_target_regex(pattern, "lora")),
        data_(pcre2_match_data_create_from_pattern(code_.get(), nullptr)),
        context_(pcre2_match_context_create(nullptr)) {
    MOE_CHECK(data_ && context_, "target_regex \"{}\": out of memory", pattern);
    pcre2_set_match_limit(context_.get(), kRegexMatchLimit);
    pcre2_set_depth_limit(context_.get(), kRegexMatchLimit);
    pcre2_set_heap_limit(context_.get(), kRegexHeapLimitKiB);
  }

  // Python's re.fullmatch(pattern, name) is not None.
  bool full_match(const std::string& name) {
    const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(name.data()), name.size(), 0,
                               PCRE2_ANCHORED | PCRE2_ENDANCHORED, data_.get(), context_.get());
    MOE_CHECK(rc >= 0 || rc == PCRE2_ERROR_NOMATCH, "target_regex \"{}\": matching module '{}' {}",
              pattern_, name,
              rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT
                  ? fmt::format("backtracks more than {} steps (nested repeats such as (.*)*?)",
                                kRegexMatchLimit)
                  : fmt::format("failed (PCRE2 error {})", rc));
    return rc >= 0;
  }

 private:
  std::string pattern_;
  Regex code_;
  std::unique_ptr<pcre2_match_data, RegexDeleter> data_;
  std::unique_ptr<pcre2_match_context, RegexDeleter> context_;
};

LoraShape LoraSettings::shape_for(bool routed_expert) const {
  const double rank = static_cast<double>(rank_for(routed_expert));
  const double a = alpha_for(routed_expert);
  LoraShape s;
  s.rank = rank_for(routed_expert);
  s.scale = static_cast<float>(rslora ? a / std::sqrt(rank) : a / rank);
  s.dropout = static_cast<float>(dropout);
  return s;
}

void LoraSettings::validate(const std::string& section) const {
  MOE_CHECK(r >= 1 && r <= kMaxLoraRank, "{}.r = {}: the LoRA rank must be in [1, {}]", section,
            r, kMaxLoraRank);
  MOE_CHECK(expert_r >= 0 && expert_r <= kMaxLoraRank,
            "{}.expert_r = {}: expected 0 (same as r) or a rank in [1, {}]", section, expert_r,
            kMaxLoraRank);
  MOE_CHECK(std::isfinite(alpha) && alpha > 0, "{}.alpha = {}: expected a positive number",
            section, alpha);
  MOE_CHECK(std::isfinite(expert_alpha) && expert_alpha >= 0,
            "{}.expert_alpha = {}: expected 0 (same as alpha) or a positive number", section,
            expert_alpha);
  MOE_CHECK(dropout >= 0 && dropout < 1, "{}.dropout = {}: expected a probability in [0, 1)",
            section, dropout);
  MOE_CHECK(!targets.empty() || !target_regex.empty() || !target_parameters.empty(),
            "{}.targets: empty; name at least one module (e.g. \"q_a_proj\") or \"all-linear\"",
            section);
  for (const std::string& t : targets)
    MOE_CHECK(!t.empty() && t.front() != '.' && t.back() != '.',
              "{}.targets: \"{}\" is not a module name (expected e.g. \"o_proj\" or "
              "\"self_attn.o_proj\")", section, t);
  for (const std::string& t : target_parameters)
    MOE_CHECK(!t.empty() && t.front() != '.' && t.back() != '.',
              "{}.target_parameters: \"{}\" is not a parameter name (expected e.g. "
              "\"mlp.experts.gate_up_proj\")", section, t);
  if (!target_regex.empty()) compile_target_regex(target_regex, section);
}

LoraTargetMatcher::LoraTargetMatcher(const LoraSettings& settings)
    : s_(settings),
      used_(settings.targets.size(), false),
      parameter_used_(settings.target_parameters.size(), false),
      regex_(settings.target_regex.empty() ? nullptr : std::make_shared<TargetRegex>(settings.target_regex)) {}

namespace {

bool is_linear_module(const std::string& module) {
  // Every module the engine offers for adaptation is a linear layer; the LM head is not offered.
  return module.rfind("model.layers.", 0) == 0;
}

constexpr const char* kV3ModuleHint =
    "modules are q_proj or q_a_proj/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, "
    "up_proj, down_proj, with prefixes like self_attn., mlp., mlp.shared_experts., mlp.experts.N.";

}  // namespace

bool target_selects(const std::string& target, const std::string& name) {
  return name == target ||
         (name.size() > target.size() && name.ends_with(target) &&
          name[name.size() - target.size() - 1] == '.');
}

bool LoraTargetMatcher::matches(const std::string& module) {
  if (!s_.target_regex.empty()) {
    const bool hit = regex_->full_match(module);
    regex_used_ |= hit;
    return hit;
  }
  bool hit = false;
  for (size_t i = 0; i < s_.targets.size(); ++i) {
    const std::string& t = s_.targets[i];
    const bool m = t == "all-linear" ? is_linear_module(module) : target_selects(t, module);
    if (m) used_[i] = true, hit = true;
  }
  return hit;
}

bool LoraTargetMatcher::matches_parameter(const std::string& parameter) {
  bool hit = false;
  for (size_t i = 0; i < s_.target_parameters.size(); ++i)
    if (target_selects(s_.target_parameters[i], parameter)) parameter_used_[i] = true, hit = true;
  return hit;
}

bool LoraTargetMatcher::names(const std::string& module) const {
  if (regex_) return regex_->full_match(module);
  for (const std::string& t : s_.targets)
    if (t != "all-linear" && target_selects(t, module)) return true;
  return false;
}

std::optional<LoraTargetMatcher::Unused> LoraTargetMatcher::first_unused() const {
  if (!s_.target_regex.empty() && !regex_used_) return Unused{"target_regex", s_.target_regex};
  if (s_.target_regex.empty())
    for (size_t i = 0; i < s_.targets.size(); ++i)
      if (!used_[i]) return Unused{"targets", s_.targets[i]};
  for (size_t i = 0; i < s_.target_parameters.size(); ++i)
    if (!parameter_used_[i]) return Unused{"target_parameters", s_.target_parameters[i]};
  return std::nullopt;
}

void LoraTargetMatcher::check_all_used(const std::string& section,
                                       const std::string& module_hint) const {
  const std::optional<Unused> unused = first_unused();
  if (!unused) return;
  const std::string hint = module_hint.empty() ? kV3ModuleHint : module_hint;
  if (unused->field == "target_regex")
    fail("{}.target_regex: \"{}\" matches no module of this model (names look like "
         "model.layers.0.self_attn.o_proj or model.layers.1.mlp.experts.0.up_proj; {})", section,
         unused->entry, hint);
  if (unused->field == "target_parameters" && module_hint.empty())
    fail("{}.target_parameters: \"{}\" matches no parameter of this model (target_parameters "
         "name DeepSeek-V4's fused routed experts; DeepSeek-V2/V3 adapts its routed experts by "
         "module name, e.g. mlp.experts.N.gate_proj)", section, unused->entry);
  fail("{}.{}: \"{}\" matches no {} of this model ({})", section, unused->field, unused->entry,
       unused->field == "targets" ? "module" : "parameter", hint);
}

}  // namespace moe
