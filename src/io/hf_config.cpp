#include "io/hf_config.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"
#include "io/atomic_file.h"

namespace moe {

namespace {

using json = nlohmann::json;

// Typed access to one JSON object's fields; every error names the source and the full field
// path (e.g. "rope_scaling.factor").
class Fields {
 public:
  Fields(const json& obj, const std::string& source, std::string prefix = "")
      : obj_(obj), source_(source), prefix_(std::move(prefix)) {}

  // nullptr when the field is absent or null: transformers treats both as "use the default".
  const json* get(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has_key(const char* key) const { return obj_.contains(key); }

  int64_t integer(const char* key, const json& v) const {
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return static_cast<int64_t>(v.get<uint64_t>());
    if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
    wrong_type(key, "an integer", v);
  }
  int64_t int_or(const char* key, int64_t fallback) const {
    const json* v = get(key);
    return v ? integer(key, *v) : fallback;
  }
  int64_t required_int(const char* key) const {
    const json* v = get(key);
    MOE_CHECK(v != nullptr, "{}: field '{}' is required (an integer)", source_, name(key));
    return integer(key, *v);
  }
  // Present but allowed to be null (e.g. q_lora_rank: null = no query compression).
  int64_t required_nullable_int(const char* key, int64_t if_null) const {
    MOE_CHECK(has_key(key), "{}: field '{}' is required (an integer or null)", source_, name(key));
    return int_or(key, if_null);
  }
  double number(const char* key, const json& v) const {
    if (!v.is_number()) wrong_type(key, "a number", v);
    return v.get<double>();
  }
  double number_or(const char* key, double fallback) const {
    const json* v = get(key);
    return v ? number(key, *v) : fallback;
  }
  double required_number(const char* key) const {
    const json* v = get(key);
    MOE_CHECK(v != nullptr, "{}: field '{}' is required (a number)", source_, name(key));
    return number(key, *v);
  }
  bool bool_or(const char* key, bool fallback) const {
    const json* v = get(key);
    if (!v) return fallback;
    if (!v->is_boolean()) wrong_type(key, "true or false", *v);
    return v->get<bool>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    const json* v = get(key);
    if (!v) return fallback;
    if (!v->is_string()) wrong_type(key, "a string", *v);
    return v->get<std::string>();
  }
  std::string required_string(const char* key) const {
    MOE_CHECK(get(key) != nullptr, "{}: field '{}' is required (a string)", source_, name(key));
    return string_or(key, "");
  }

  std::string name(const char* key) const { return prefix_ + key; }
  [[noreturn]] void wrong_type(const char* key, const char* expected, const json& v) const {
    fail("{}: field '{}' must be {}, got {} {}", source_, name(key), expected, v.type_name(),
         v.dump());
  }
  [[noreturn]] void bad_value(const char* key, const char* expected, const json& v) const {
    fail("{}: field '{}' must be {}, got {}", source_, name(key), expected, v.dump());
  }

 private:
  const json& obj_;
  const std::string& source_;
  std::string prefix_;
};

// transformers writes a single id, but generation configs sometimes carry a list of stop ids;
// the first is the canonical end-of-sequence token.
int64_t token_id(const Fields& f, const char* key, int64_t fallback) {
  const json* v = f.get(key);
  if (!v) return fallback;
  if (v->is_array()) {
    if (v->empty()) f.wrong_type(key, "an integer or a non-empty list of integers", *v);
    return f.integer(key, v->front());
  }
  return f.integer(key, *v);
}

RopeScaling parse_rope_scaling(const json& rs, const Fields& top, const char* field,
                               const std::string& source, int64_t max_position_embeddings) {
  RopeScaling r;
  if (!rs.is_object()) top.wrong_type(field, "an object or null", rs);
  Fields f(rs, source, std::string(field) + ".");
  // Older configs (the DeepSeek remote code) say "type", newer transformers "rope_type".
  const std::string type = f.string_or("type", "");
  const std::string rope_type = f.string_or("rope_type", "");
  MOE_CHECK(!type.empty() || !rope_type.empty(), "{}: field '{}' needs a 'type' (or "
            "'rope_type'): \"yarn\" or \"default\"", source, field);
  if (type != "yarn" && rope_type != "yarn") {
    for (const char* key : {"type", "rope_type"}) {
      const json* v = f.get(key);
      if (v && v->get<std::string>() != "default")
        f.bad_value(key, "\"yarn\" or \"default\" (this engine implements no other RoPE scaling)",
                    *v);
    }
    return r;
  }
  r.type = "yarn";
  r.factor = f.required_number("factor");
  // transformers' YaRN falls back to max_position_embeddings when the original length is absent.
  r.original_max_position_embeddings =
      f.int_or("original_max_position_embeddings", max_position_embeddings);
  r.beta_fast = f.number_or("beta_fast", r.beta_fast);
  r.beta_slow = f.number_or("beta_slow", r.beta_slow);
  r.mscale = f.number_or("mscale", r.mscale);
  r.mscale_all_dim = f.number_or("mscale_all_dim", r.mscale_all_dim);
  return r;
}

// Fields every model type reads the same way: dtype, MXFP4 experts, token ids, and the features
// transformers supports but this engine does not (computing without them would silently give a
// different model).
void parse_common_tail(const json& j, const Fields& f, const std::string& source, ModelConfig& c,
                       int64_t bos, int64_t eos) {
  c.tie_word_embeddings = f.bool_or("tie_word_embeddings", false);
  // transformers 4.56 renamed torch_dtype to dtype.
  const char* dtype_key = f.get("torch_dtype") || !f.get("dtype") ? "torch_dtype" : "dtype";
  c.torch_dtype = f.string_or(dtype_key, "float32");
  if (c.torch_dtype != "float32" && c.torch_dtype != "bfloat16")
    f.bad_value(dtype_key, "\"bfloat16\" or \"float32\"", json(c.torch_dtype));
  // Packed routed experts are described the way transformers describes gpt-oss's; DeepSeek's
  // own "fp8" describes the weight files (dequantized on load) and leaves the model as it is.
  if (parse_hf_weights_info(j, source).quant_method == "mxfp4") c.expert_format = "mxfp4";
  c.bos_token_id = token_id(f, "bos_token_id", bos);
  c.eos_token_id = token_id(f, "eos_token_id", eos);
  if (const std::string act = f.string_or("hidden_act", "silu"); act != "silu")
    f.bad_value("hidden_act", "\"silu\"", json(act));
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (f.bool_or(key, false)) f.bad_value(key, "false", json(true));
  // Not a transformers field: the engine's own switch (model/config.h), checked by validate().
  c.quantization_simulation = f.string_or("quantization_simulation", "none");
}

void parse_rope(const Fields& f, const std::string& source, ModelConfig& c) {
  c.rope_theta = f.number_or("rope_theta", 10000.0);
  if (const json* rs = f.get("rope_scaling")) {
    c.rope_scaling = parse_rope_scaling(*rs, f, "rope_scaling", source, c.max_position_embeddings);
  } else if (const json* rp = f.get("rope_parameters")) {
    // transformers 5 moved rope_theta and the scaling into one rope_parameters object.
    c.rope_scaling = parse_rope_scaling(*rp, f, "rope_parameters", source, c.max_position_embeddings);
    if (!f.get("rope_theta") && rp->is_object())
      c.rope_theta = Fields(*rp, source, "rope_parameters.").number_or("rope_theta", c.rope_theta);
  }
}

// DeepSeek-V4 (SPEC §6.1). Fields that fix parameter shapes or which layers have which
// tensors (head_dim, o_groups, compress_ratios, num_hash_layers, the indexer's sizes when a
// layer is CSA, ...) are required; the others default to the released V4-Flash values, which
// are also transformers' DeepseekV4Config defaults. The MLA and dense-FFN fields of V2/V3 do not
// exist here and stay 0.
ModelConfig parse_v4_config(const json& j, const Fields& f, const std::string& source) {
  ModelConfig c;
  c.model_type = "deepseek_v4";
  c.vocab_size = f.required_int("vocab_size");
  c.hidden_size = f.required_int("hidden_size");
  c.num_hidden_layers = f.required_int("num_hidden_layers");
  c.num_attention_heads = f.required_int("num_attention_heads");
  // One KV head shared by every query head; a config saying otherwise is another model.
  if (const json* kv = f.get("num_key_value_heads"); kv && f.integer("num_key_value_heads", *kv) != 1)
    f.bad_value("num_key_value_heads", "1 (DeepSeek-V4 attends one shared KV head)", *kv);
  c.head_dim = f.required_int("head_dim");
  c.qk_rope_head_dim = f.required_int("qk_rope_head_dim");
  c.q_lora_rank = f.required_int("q_lora_rank");
  c.o_groups = f.required_int("o_groups");
  c.o_lora_rank = f.required_int("o_lora_rank");
  c.sliding_window = f.required_int("sliding_window");

  c.n_routed_experts = f.required_int("n_routed_experts");
  c.n_shared_experts = f.required_int("n_shared_experts");
  c.moe_intermediate_size = f.required_int("moe_intermediate_size");
  c.num_experts_per_tok = f.required_int("num_experts_per_tok");
  c.num_hash_layers = f.required_int("num_hash_layers");
  c.first_k_dense_replace = f.int_or("first_k_dense_replace", 0);
  c.moe_layer_freq = f.int_or("moe_layer_freq", 1);
  c.n_group = f.int_or("n_group", 1);
  c.topk_group = f.int_or("topk_group", 1);
  c.topk_method = f.string_or("topk_method", "noaux_tc");
  c.scoring_func = f.string_or("scoring_func", "sqrtsoftplus");
  c.norm_topk_prob = f.bool_or("norm_topk_prob", true);
  c.routed_scaling_factor = f.number_or("routed_scaling_factor", 1.5);
  c.aux_loss_alpha = f.number_or("aux_loss_alpha", 0.0);
  c.seq_aux = f.bool_or("seq_aux", true);
  c.swiglu_limit = f.number_or("swiglu_limit", 10.0);

  c.num_nextn_predict_layers = f.int_or("num_nextn_predict_layers", 0);
  const json* ratios = f.get("compress_ratios");
  MOE_CHECK(ratios != nullptr, "{}: field 'compress_ratios' is required (a list of integers, one "
            "per layer and one per MTP layer)", source);
  if (!ratios->is_array()) f.wrong_type("compress_ratios", "a list of integers", *ratios);
  for (const json& r : *ratios) c.compress_ratios.push_back(f.integer("compress_ratios", r));
  c.compress_rope_theta = f.number_or("compress_rope_theta", 160000.0);
  const bool csa = std::find(c.compress_ratios.begin(), c.compress_ratios.end(), 4) !=
                   c.compress_ratios.end();
  if (csa) {
    c.index_n_heads = f.required_int("index_n_heads");
    c.index_head_dim = f.required_int("index_head_dim");
    c.index_topk = f.required_int("index_topk");
  } else {
    c.index_n_heads = f.int_or("index_n_heads", 0);
    c.index_head_dim = f.int_or("index_head_dim", 0);
    c.index_topk = f.int_or("index_topk", 0);
  }
  c.hc_mult = f.required_int("hc_mult");
  c.hc_sinkhorn_iters = f.int_or("hc_sinkhorn_iters", 20);
  c.hc_eps = f.number_or("hc_eps", 1e-6);

  c.rms_norm_eps = f.number_or("rms_norm_eps", 1e-6);
  c.max_position_embeddings = f.int_or("max_position_embeddings", 1048576);
  parse_rope(f, source, c);
  parse_common_tail(j, f, source, c, 0, 1);
  // The release describes its routed experts apart from quantization_config (which says fp8):
  // "fp4" = packed MXFP4 (SPEC §6.3), kept packed by a load; "fp8" (128x128 blocks, as
  // V4-Flash-Base ships them) and "bf16" are decoded into fp32 experts.
  if (const std::string experts = f.string_or("expert_dtype", ""); experts == "fp4")
    c.expert_format = "mxfp4";
  else if (!experts.empty() && experts != "fp8" && experts != "bf16")
    f.bad_value("expert_dtype", "\"fp4\" (packed MXFP4 experts), \"fp8\" or \"bf16\"",
                json(experts));
  c.validate(source);
  return c;
}

}  // namespace

ModelConfig parse_hf_config(const json& j, const std::string& source) {
  MOE_CHECK(j.is_object(), "{}: config must be a JSON object, got {}", source, j.type_name());
  Fields f(j, source);
  ModelConfig c;

  c.model_type = f.required_string("model_type");
  if (c.model_type == "deepseek_v4") return parse_v4_config(j, f, source);
  if (c.model_type != "deepseek_v3" && c.model_type != "deepseek_v2")
    f.bad_value("model_type", "\"deepseek_v3\", \"deepseek_v2\" or \"deepseek_v4\"",
                j["model_type"]);
  const bool v2 = c.model_type == "deepseek_v2";

  c.vocab_size = f.required_int("vocab_size");
  c.hidden_size = f.required_int("hidden_size");
  c.intermediate_size = f.required_int("intermediate_size");
  c.num_hidden_layers = f.required_int("num_hidden_layers");
  c.num_attention_heads = f.required_int("num_attention_heads");
  c.q_lora_rank = f.required_nullable_int("q_lora_rank", 0);
  c.kv_lora_rank = f.required_int("kv_lora_rank");
  c.qk_nope_head_dim = f.required_int("qk_nope_head_dim");
  c.qk_rope_head_dim = f.required_int("qk_rope_head_dim");
  c.v_head_dim = f.required_int("v_head_dim");

  c.n_routed_experts = f.int_or("n_routed_experts", 0);
  c.n_shared_experts = f.int_or("n_shared_experts", 0);
  if (c.n_routed_experts > 0) {
    c.moe_intermediate_size = f.required_int("moe_intermediate_size");
    c.num_experts_per_tok = f.required_int("num_experts_per_tok");
    c.first_k_dense_replace = f.required_int("first_k_dense_replace");
  } else {
    c.moe_intermediate_size = f.int_or("moe_intermediate_size", 0);
    c.num_experts_per_tok = f.int_or("num_experts_per_tok", 0);
    c.first_k_dense_replace = f.int_or("first_k_dense_replace", 0);
  }
  c.moe_layer_freq = f.int_or("moe_layer_freq", 1);
  c.n_group = f.int_or("n_group", 1);
  c.topk_group = f.int_or("topk_group", 1);
  c.topk_method = f.string_or("topk_method", v2 ? "greedy" : "noaux_tc");
  c.scoring_func = f.string_or("scoring_func", v2 ? "softmax" : "sigmoid");
  c.norm_topk_prob = f.bool_or("norm_topk_prob", !v2);
  c.routed_scaling_factor = f.number_or("routed_scaling_factor", v2 ? 1.0 : 2.5);
  // Native transformers DeepSeek models have no sequence-wise auxiliary loss, so a config
  // without the field trains without one.
  c.aux_loss_alpha = f.number_or("aux_loss_alpha", 0.0);
  c.seq_aux = f.bool_or("seq_aux", true);
  // DeepSeek-V4 clamps its experts' SwiGLU; absent (V2/V3) means no clamp.
  c.swiglu_limit = f.number_or("swiglu_limit", 0.0);

  c.rms_norm_eps = f.number_or("rms_norm_eps", 1e-6);
  c.max_position_embeddings = f.int_or("max_position_embeddings", v2 ? 2048 : 4096);
  parse_rope(f, source, c);
  parse_common_tail(j, f, source, c, v2 ? 100000 : 0, v2 ? 100001 : 1);
  // transformers' DeepseekV3 de-interleaves the rope dims of checkpoints that store them as
  // adjacent pairs (rope_interleave = true, its default and every release); false would mean
  // weights in rotate-half order, a different model for this engine's pairwise RoPE.
  if (!f.bool_or("rope_interleave", true))
    f.bad_value("rope_interleave", "true (RoPE on adjacent pairs, as every DeepSeek release)",
                json(false));

  c.validate(source);
  return c;
}

HfWeightsInfo parse_hf_weights_info(const json& j, const std::string& source) {
  MOE_CHECK(j.is_object(), "{}: config must be a JSON object, got {}", source, j.type_name());
  Fields f(j, source);
  HfWeightsInfo w;
  w.model_type = f.string_or("model_type", "");
  w.num_hidden_layers = f.int_or("num_hidden_layers", 0);
  w.num_nextn_predict_layers = f.int_or("num_nextn_predict_layers", 0);
  // Read before the config is validated; bounded here so layer arithmetic cannot overflow.
  const std::string layer_range = fmt::format("an integer in [0, {}]", kMaxConfigLayers);
  if (w.num_hidden_layers < 0 || w.num_hidden_layers > kMaxConfigLayers)
    f.bad_value("num_hidden_layers", layer_range.c_str(), j.at("num_hidden_layers"));
  if (w.num_nextn_predict_layers < 0 || w.num_nextn_predict_layers > kMaxConfigLayers)
    f.bad_value("num_nextn_predict_layers", layer_range.c_str(), j.at("num_nextn_predict_layers"));
  const json* q = f.get("quantization_config");
  if (q == nullptr) return w;
  if (!q->is_object()) f.wrong_type("quantization_config", "an object or null", *q);
  Fields qf(*q, source, "quantization_config.");
  const std::string method = qf.required_string("quant_method");
  if (method == "mxfp4") {
    w.quant_method = method;
    return w;
  }
  if (method != "fp8")
    qf.bad_value("quant_method",
                 "\"fp8\" (DeepSeek-V3/R1 block-scaled F8_E4M3 weights) or \"mxfp4\" (packed "
                 "routed experts); no other quantization can be loaded",
                 json(method));
  w.quant_method = method;
  if (const std::string fmt = qf.string_or("fmt", "e4m3"); fmt != "e4m3")
    qf.bad_value("fmt", "\"e4m3\" (F8_E4M3 weights, as DeepSeek publishes them)", json(fmt));
  if (const json* b = qf.get("weight_block_size")) {
    // Bounded like the model's sizes: block counts are rounded-up divisions.
    // (An unsigned value above 2^63 reads back negative.)
    const auto in_range = [](const json& v) {
      return v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= kMaxConfigSize;
    };
    const bool ok = b->is_array() && b->size() == 2 && in_range((*b)[0]) && in_range((*b)[1]);
    if (!ok)
      qf.wrong_type("weight_block_size", "two positive integers [rows, columns] of at most 2^24", *b);
    w.fp8_block_rows = (*b)[0].get<int64_t>();
    w.fp8_block_cols = (*b)[1].get<int64_t>();
  }
  // Activations are never quantized here (weights are dequantized, matmuls run in fp32), so the
  // dynamic scheme needs nothing; a static one would come with activation scales to apply.
  if (const std::string act = qf.string_or("activation_scheme", "dynamic"); act != "dynamic")
    qf.bad_value("activation_scheme",
                 "\"dynamic\" (a static scheme's input scales are not supported)", json(act));
  w.fp8_scale_fmt = qf.string_or("scale_fmt", "");
  if (!w.fp8_scale_fmt.empty() && w.fp8_scale_fmt != "ue8m0")
    qf.bad_value("scale_fmt", "\"ue8m0\" (V3.1's power-of-two scales) or absent",
                 json(w.fp8_scale_fmt));
  return w;
}

int64_t HfWeightsInfo::mtp_layer_of(const std::string& name) const {
  const std::string_view head = "model.layers.";
  if (v4() || num_nextn_predict_layers <= 0 || !std::string_view(name).starts_with(head))
    return -1;
  const char* begin = name.data() + head.size();
  const char* end = name.data() + name.size();
  int64_t layer = 0;
  auto [p, ec] = std::from_chars(begin, end, layer);
  if (ec != std::errc() || p == begin || p == end || *p != '.') return -1;
  return layer >= num_hidden_layers && layer < num_hidden_layers + num_nextn_predict_layers
             ? layer
             : -1;
}

namespace {

json read_config_json(const std::filesystem::path& file) {
  const std::string text = read_text_file_capped(file, "the model config");
  try {
    return json::parse(text, json_depth_limit<json>(file.string()));
  } catch (const json::exception& ex) {
    fail("{}: not valid JSON: {}", file.string(), ex.what());
  }
}

}  // namespace

HfWeightsInfo read_hf_weights_info(const std::filesystem::path& path) {
  std::error_code ec;
  const bool dir = std::filesystem::is_directory(path, ec);
  const std::filesystem::path file = dir ? path / kHfConfigFile : path;
  if (dir && !std::filesystem::exists(file, ec)) return {};
  return parse_hf_weights_info(read_config_json(file), file.string());
}

ModelConfig read_hf_config(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::path file =
      std::filesystem::is_directory(path, ec) ? path / kHfConfigFile : path;
  return parse_hf_config(read_config_json(file), file.string());
}

namespace {

// The released V4-Flash config.json's fields (SPEC §6.1), every one parse_v4_config reads.
json v4_config_to_json(const ModelConfig& c) {
  json j;
  j["architectures"] = json::array({"DeepseekV4ForCausalLM"});
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = 1;
  j["head_dim"] = c.head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["q_lora_rank"] = c.q_lora_rank;
  j["o_lora_rank"] = c.o_lora_rank;
  j["o_groups"] = c.o_groups;
  j["n_routed_experts"] = c.n_routed_experts;
  j["n_shared_experts"] = c.n_shared_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["scoring_func"] = c.scoring_func;
  j["topk_method"] = c.topk_method;
  j["aux_loss_alpha"] = c.aux_loss_alpha;
  j["seq_aux"] = c.seq_aux;
  j["num_hash_layers"] = c.num_hash_layers;
  j["hidden_act"] = "silu";
  j["swiglu_limit"] = c.swiglu_limit;
  j["hc_mult"] = c.hc_mult;
  j["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  j["hc_eps"] = c.hc_eps;
  j["index_n_heads"] = c.index_n_heads;
  j["index_head_dim"] = c.index_head_dim;
  j["index_topk"] = c.index_topk;
  j["sliding_window"] = c.sliding_window;
  j["compress_ratios"] = c.compress_ratios;
  j["compress_rope_theta"] = c.compress_rope_theta;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.is_yarn()) {
    const RopeScaling& r = c.rope_scaling;
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", r.factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings},
                         {"beta_fast", r.beta_fast},
                         {"beta_slow", r.beta_slow}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["num_nextn_predict_layers"] = c.num_nextn_predict_layers;
  j["attention_bias"] = false;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype;
  if (c.mxfp4_experts())
    j["quantization_config"] = {{"quant_method", "mxfp4"},
                                {"modules_to_convert", {"ffn.experts"}}};
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["use_cache"] = true;
  // Absent at its default, so a config.json stays what transformers writes.
  if (c.quantization_simulation != "none") j["quantization_simulation"] = c.quantization_simulation;
  return j;
}

}  // namespace

json model_config_to_json(const ModelConfig& c) {
  if (c.is_v4()) return v4_config_to_json(c);
  const bool v2 = c.model_type == "deepseek_v2";
  json j;
  j["architectures"] = json::array({v2 ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM"});
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  // MLA has no grouped KV heads; transformers still expects the field.
  j["num_key_value_heads"] = c.num_attention_heads;
  j["n_routed_experts"] = c.n_routed_experts > 0 ? json(c.n_routed_experts) : json(nullptr);
  j["n_shared_experts"] = c.n_shared_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["first_k_dense_replace"] = c.first_k_dense_replace;
  j["moe_layer_freq"] = c.moe_layer_freq;
  j["n_group"] = c.n_group;
  j["topk_group"] = c.topk_group;
  j["topk_method"] = c.topk_method;
  j["scoring_func"] = c.scoring_func;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["aux_loss_alpha"] = c.aux_loss_alpha;
  j["seq_aux"] = c.seq_aux;
  if (c.swiglu_limit > 0) j["swiglu_limit"] = c.swiglu_limit;
  j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["max_position_embeddings"] = c.max_position_embeddings;
  if (c.rope_scaling.is_yarn()) {
    const RopeScaling& r = c.rope_scaling;
    j["rope_scaling"] = {{"type", "yarn"},
                         {"rope_type", "yarn"},
                         {"factor", r.factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings},
                         {"beta_fast", r.beta_fast},
                         {"beta_slow", r.beta_slow},
                         {"mscale", r.mscale},
                         {"mscale_all_dim", r.mscale_all_dim}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype;
  if (c.mxfp4_experts())
    j["quantization_config"] = {{"quant_method", "mxfp4"},
                                {"modules_to_convert", {"mlp.experts"}}};
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["use_cache"] = true;
  return j;
}

void write_hf_config(const std::filesystem::path& dir, const ModelConfig& cfg) {
  const std::filesystem::path file = dir / kHfConfigFile;
  cfg.validate(file.string());
  write_file_atomic(file, model_config_to_json(cfg).dump(2) + "\n");
}

}  // namespace moe
