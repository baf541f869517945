#include "train/train_config.h"

#include <fstream>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "core/error.h"
#include "core/limits.h"
#include "io/hf_config.h"
#include "io/model_spec.h"
#include "train/config_keys.h"

namespace moe {

namespace {

using json = nlohmann::json;
using Range = ConfigKeys::Range;

// The key table, bound to the fields of one config object.
ConfigKeys bind(TrainConfig& c) {
  const Range positive{0, Range{}.hi, true};
  const Range non_negative{0};
  const Range at_least_one{1};
  ConfigKeys k;
  k.add_optional_string("model.preset", &c.model.preset);
  k.add_optional_string("model.weights", &c.model.weights);
  k.add_string("model.experts", &c.model.experts, {"auto", "fp32", "mxfp4"});

  k.add_string_list("data.path", &c.data.path);
  k.add_string("data.format", &c.data.format,
               {"auto", "text", "jsonl", "prompt_completion", "chat"});
  k.add_string("data.jsonl_field", &c.data.jsonl_field);
  k.add_optional_string("data.tokenizer", &c.data.tokenizer);
  k.add_int("data.seq_len", &c.data.seq_len, at_least_one);
  k.add_int("data.batch_size", &c.data.batch_size, at_least_one);
  k.add_float("data.val_fraction", &c.data.val_fraction, {0, 0.5, false, true});
  k.add_int("data.val_batches", &c.data.val_batches, non_negative);
  k.add_bool("data.shuffle", &c.data.shuffle);

  k.add_float("optimizer.lr", &c.optimizer.lr, positive);
  k.add_float("optimizer.beta1", &c.optimizer.beta1, {0, 1, false, true});
  k.add_float("optimizer.beta2", &c.optimizer.beta2, {0, 1, false, true});
  k.add_float("optimizer.eps", &c.optimizer.eps, positive);
  k.add_float("optimizer.weight_decay", &c.optimizer.weight_decay, non_negative);
  k.add_float("optimizer.grad_clip", &c.optimizer.grad_clip, non_negative);
  k.add_int("optimizer.grad_accum", &c.optimizer.grad_accum, at_least_one);
  k.add_float("optimizer.z_loss", &c.optimizer.z_loss, non_negative);
  k.add_float("optimizer.bias_update_rate", &c.optimizer.bias_update_rate, non_negative);
  k.add_int("optimizer.max_nonfinite_steps", &c.optimizer.max_nonfinite_steps, non_negative);

  k.add_int("schedule.steps", &c.schedule.steps, at_least_one);
  k.add_int("schedule.warmup_steps", &c.schedule.warmup_steps, non_negative);
  k.add_string("schedule.decay", &c.schedule.decay, {"cosine", "constant"});
  k.add_float("schedule.min_lr", &c.schedule.min_lr, non_negative);

  k.add_int("checkpoint.every", &c.checkpoint.every, non_negative);
  k.add_int("checkpoint.keep_last", &c.checkpoint.keep_last, at_least_one);

  k.add_int("logging.log_every", &c.logging.log_every, at_least_one);
  k.add_int("logging.val_every", &c.logging.val_every, non_negative);
  k.add_string("logging.progress", &c.logging.progress, {"auto", "bar", "lines", "none"});

  k.add_int("run.seed", &c.run.seed, non_negative);
  k.add_int("run.threads", &c.run.threads, non_negative);
  k.add_string("run.out_dir", &c.run.out_dir);
  k.add_int("parallel.ep", &c.parallel.ep, at_least_one);
  k.add_int("parallel.collective_timeout", &c.parallel.collective_timeout, non_negative);
  k.add_int("parallel.checkpoint_timeout", &c.parallel.checkpoint_timeout, non_negative);

  k.add_int("lora.r", &c.lora.r, at_least_one);
  k.add_float("lora.alpha", &c.lora.alpha, positive);
  k.add_float("lora.dropout", &c.lora.dropout, {0, 1, false, true});
  k.add_bool("lora.rslora", &c.lora.rslora);
  k.add_string_list("lora.targets", &c.lora.targets);
  k.add_optional_string("lora.target_regex", &c.lora.target_regex);
  k.add_int("lora.expert_r", &c.lora.expert_r, non_negative);
  k.add_float("lora.expert_alpha", &c.lora.expert_alpha, non_negative);
  return k;
}

json toml_to_json(const toml::node& n) {
  if (const auto* t = n.as_table()) {
    json j = json::object();
    for (const auto& [k, v] : *t) j[std::string(k.str())] = toml_to_json(v);
    return j;
  }
  if (const auto* a = n.as_array()) {
    json j = json::array();
    for (const toml::node& v : *a) j.push_back(toml_to_json(v));
    return j;
  }
  if (const auto* v = n.as_integer()) return v->get();
  if (const auto* v = n.as_floating_point()) return v->get();
  if (const auto* v = n.as_boolean()) return v->get();
  if (const auto* v = n.as_string()) return v->get();
  fail("a TOML date or time cannot be a model config value: {}", describe_toml(n));
}

void json_to_toml(const json& j, toml::table& out, const std::string& key) {
  if (j.is_object()) {
    toml::table t;
    for (const auto& [k, v] : j.items()) json_to_toml(v, t, k);
    out.insert_or_assign(key, std::move(t));
  } else if (j.is_boolean()) {
    out.insert_or_assign(key, j.get<bool>());
  } else if (j.is_number_integer()) {
    out.insert_or_assign(key, j.get<int64_t>());
  } else if (j.is_number()) {
    out.insert_or_assign(key, j.get<double>());
  } else if (j.is_string()) {
    out.insert_or_assign(key, j.get<std::string>());
  } else if (j.is_array()) {
    toml::table holder;
    toml::array a;
    for (const json& v : j) {
      json_to_toml(v, holder, "x");
      a.push_back(*holder["x"].node());
    }
    out.insert_or_assign(key, std::move(a));
  }
  // null has no TOML form: an override of null is dropped, which restores the preset's value.
}

// Command-line values for [model] fields are typed by their look: the HF config parser then
// checks them against the field's real type and names the field if they do not fit.
json guess_json(const std::string& text) {
  if (text == "true") return true;
  if (text == "false") return false;
  if (text == "null") return nullptr;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_discarded() && j.is_number()) return j;
  return text;
}

void set_nested(json& obj, const std::string& dotted, json value) {
  json* cur = &obj;
  size_t start = 0;
  for (size_t dot; (dot = dotted.find('.', start)) != std::string::npos; start = dot + 1) {
    json& next = (*cur)[dotted.substr(start, dot - start)];
    if (!next.is_object()) next = json::object();
    cur = &next;
  }
  (*cur)[dotted.substr(start)] = std::move(value);
}

void check_cross_fields(const TrainConfig& c, const std::string& source) {
  MOE_CHECK(c.schedule.min_lr <= c.optimizer.lr,
            "{}: schedule.min_lr: expected a number <= optimizer.lr ({}), got {}", source,
            c.optimizer.lr, c.schedule.min_lr);
  if (!c.finetune) {
    MOE_CHECK(c.data.format == "auto" || c.data.format == "text" || c.data.format == "jsonl",
              "{}: data.format = \"{}\" is a fine-tuning format (moe finetune); pretraining "
              "reads auto, text or jsonl", source, c.data.format);
    return;
  }
  MOE_CHECK(!c.model.weights.empty(),
            "{}: model.weights: expected the base model's directory (fine-tuning adapts an "
            "existing model)", source);
  MOE_CHECK(c.optimizer.bias_update_rate == 0,
            "{}: optimizer.bias_update_rate = {}: the base model is frozen in a fine-tune, "
            "router biases included; expected 0", source, c.optimizer.bias_update_rate);
  lora_settings(c).validate(source + ": lora");
}

}  // namespace

std::vector<ConfigOverride> parse_override_args(const std::vector<std::string>& args) {
  std::vector<ConfigOverride> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    MOE_CHECK(a.rfind("--", 0) == 0 && a.find('.') != std::string::npos,
              "unexpected argument '{}' (config overrides look like --section.key value)", a);
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      out.push_back({a.substr(2, eq - 2), a.substr(eq + 1)});
      continue;
    }
    MOE_CHECK(i + 1 < args.size(), "command line: {}: missing value", a.substr(2));
    out.push_back({a.substr(2), args[++i]});
  }
  return out;
}

TrainConfig parse_train_config(const std::string& toml_text, const std::string& source,
                               const std::vector<ConfigOverride>& overrides,
                               ConfigPurpose purpose) {
  TrainConfig c;
  if (purpose == ConfigPurpose::Finetune) {
    // A fine-tune's defaults: the base model names itself, its tokenizer, no bias updates.
    c.finetune = true;
    c.model.preset = "";
    c.data.tokenizer = "";
    c.optimizer.bias_update_rate = 0.0;
    c.optimizer.weight_decay = 0.0;
    c.run.out_dir = "runs/finetune";
  }
  const ConfigKeys keys = bind(c);
  const auto check_purpose = [&](const std::string& section, const std::string& where) {
    MOE_CHECK(section != "lora" || c.finetune,
              "{}: [lora] configures `moe finetune`; `moe train` pretrains all weights", where);
  };
  const std::vector<std::string> sections = keys.sections();
  auto section_list = [&] {
    std::string s;
    for (const std::string& n : sections) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  auto known_section = [&](const std::string& s) {
    return std::find(sections.begin(), sections.end(), s) != sections.end();
  };

  toml::table root;
  try {
    root = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    fail("{}:{}:{}: {}", source, e.source().begin.line, e.source().begin.column, e.description());
  }
  for (const auto& [sk, node] : root) {
    const std::string section(sk.str());
    MOE_CHECK(node.is_table(), "{}: '{}' must be a section like [{}] (sections: {})", source,
              section, section, section_list());
    MOE_CHECK(known_section(section), "{}: unknown section [{}] (sections: {})", source, section,
              section_list());
    check_purpose(section, source);
    for (const auto& [kk, value] : *node.as_table()) {
      const std::string name = section + "." + std::string(kk.str());
      if (section == "model" && !keys.contains(name)) {
        c.model.overrides[std::string(kk.str())] = toml_to_json(value);
        continue;
      }
      MOE_CHECK(keys.contains(name), "{}: unknown key '{}' (keys of [{}]: {})", source, name,
                section, keys.keys_of(section));
      keys.set_from_toml(name, value, source);
    }
  }

  for (const ConfigOverride& o : overrides) {
    const std::string section = o.key.substr(0, o.key.find('.'));
    MOE_CHECK(known_section(section), "command line: --{}: unknown section [{}] (sections: {})",
              o.key, section, section_list());
    check_purpose(section, "command line: --" + o.key);
    if (section == "model" && !keys.contains(o.key)) {
      set_nested(c.model.overrides, o.key.substr(6), guess_json(o.value));
      continue;
    }
    MOE_CHECK(keys.contains(o.key), "command line: unknown key '{}' (keys of [{}]: {})", o.key,
              section, keys.keys_of(section));
    keys.set_from_string(o.key, o.value, "command line");
  }
  check_cross_fields(c, overrides.empty() ? source : source + " with command-line overrides");
  return c;
}

TrainConfig load_train_config(const std::filesystem::path& file,
                              const std::vector<ConfigOverride>& overrides,
                              ConfigPurpose purpose) {
  return parse_train_config(read_text_file_capped(file, "the config file"), file.string(), overrides,
                            purpose);
}

LoraSettings lora_settings(const TrainConfig& cfg) {
  LoraSettings s;
  s.r = cfg.lora.r;
  s.alpha = cfg.lora.alpha;
  s.dropout = cfg.lora.dropout;
  s.rslora = cfg.lora.rslora;
  // Module names hold no commas, so "q_a_proj,o_proj" (handy on a command line) is two targets.
  s.targets.clear();
  for (const std::string& t : cfg.lora.targets)
    for (size_t start = 0;;) {
      const size_t comma = t.find(',', start);
      s.targets.push_back(t.substr(start, comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  s.target_regex = cfg.lora.target_regex;
  if (!s.target_regex.empty()) s.targets.clear();
  s.expert_r = cfg.lora.expert_r;
  s.expert_alpha = cfg.lora.expert_alpha;
  return s;
}

std::string train_config_to_toml(const TrainConfig& cfg) {
  TrainConfig copy = cfg;
  toml::table root;
  bind(copy).write_toml(root);
  if (!cfg.finetune) root.erase("lora");
  toml::table& model = *root["model"].as_table();
  for (const auto& [k, v] : cfg.model.overrides.items()) json_to_toml(v, model, k);
  // Basic strings only ("..." with escapes). toml++ 3.3 writes a string holding a newline as a
  // multi-line one, and TOML drops a newline right after the opening quotes, so a value that
  // starts with one read back without it (found by fuzz_train_config); without multi-line
  // strings it wrote a literal '...' string with the newline in it, which TOML forbids.
  constexpr toml::format_flags flags = toml::toml_formatter::default_flags &
                                       ~toml::format_flags::allow_multi_line_strings &
                                       ~toml::format_flags::allow_literal_strings;
  std::ostringstream os;
  os << toml::toml_formatter(root, flags) << "\n";
  return os.str();
}

ModelConfig resolve_train_model(const TrainConfig& cfg, int64_t vocab_size, int64_t end_of_text) {
  // A fine-tune's model is its base's unless the preset says otherwise.
  const std::string& preset = cfg.model.preset.empty() && cfg.finetune ? cfg.model.weights
                                                                        : cfg.model.preset;
  MOE_CHECK(!preset.empty(), "model.preset: expected a preset name, a config.json or a model "
            "directory, got \"\"");
  const ModelConfig base = resolve_model_config(preset);
  json j = model_config_to_json(base);
  // Fields the trainer owns, and fields transformers reads but this engine does not use (an
  // override of those would silently do nothing).
  static const std::set<std::string> owned = {"vocab_size", "bos_token_id", "eos_token_id"};
  static const std::set<std::string> unused = {"architectures", "hidden_act", "attention_bias",
                                               "attention_dropout", "num_key_value_heads",
                                               "use_cache", "torch_dtype"};
  // The engine's own fields, which config.json holds only away from their defaults.
  static const std::set<std::string> absent_at_default = {"quantization_simulation"};
  for (const auto& [key, value] : cfg.model.overrides.items()) {
    MOE_CHECK(!owned.count(key), "model.{}: set by the tokenizer, cannot be overridden", key);
    MOE_CHECK(!unused.count(key),
              "model.{}: not used by this engine (checkpoints are written in float32)", key);
    if (!j.contains(key) && !absent_at_default.count(key)) {
      std::string fields;
      for (const auto& [f, v] : j.items())
        if (!owned.count(f) && !unused.count(f) && !absent_at_default.count(f))
          fields += (fields.empty() ? "" : ", ") + f;
      for (const std::string& f : absent_at_default) fields += ", " + f;
      fail("model.{}: unknown model config field (fields: preset, weights, experts, {})", key,
           fields);
    }
    j[key] = value;
  }
  if (cfg.finetune) {
    // The base model's vocabulary and special ids stay; the tokenizer only has to fit in it.
    MOE_CHECK(vocab_size <= base.vocab_size,
              "data.tokenizer: {} ids do not fit the base model's vocabulary of {} "
              "(model.weights = {}); use the base model's tokenizer", vocab_size,
              base.vocab_size, cfg.model.weights);
  } else {
    j["vocab_size"] = vocab_size;
    j["bos_token_id"] = end_of_text;
    j["eos_token_id"] = end_of_text;
  }
  ModelConfig m = parse_hf_config(j, "config [model]");
  if (cfg.model.experts != "auto") m.expert_format = cfg.model.experts;
  m.validate("config [model] with experts = \"" + cfg.model.experts + "\"");
  MOE_CHECK(cfg.data.seq_len <= m.max_position_embeddings,
            "data.seq_len: expected an integer <= model.max_position_embeddings ({}), got {}",
            m.max_position_embeddings, cfg.data.seq_len);
  return m;
}

}  // namespace moe
