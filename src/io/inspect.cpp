#include "io/inspect.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/memory.h"
#include "io/fp8.h"
#include "io/safetensors.h"

namespace moe {

namespace fs = std::filesystem;

const char* tensor_kind_name(TensorKind k) {
  switch (k) {
    case TensorKind::Embedding: return "embedding";
    case TensorKind::Attention: return "attention";
    case TensorKind::DenseMlp: return "dense MLP";
    case TensorKind::Router: return "router";
    case TensorKind::SharedExperts: return "shared experts";
    case TensorKind::RoutedExperts: return "routed experts";
    case TensorKind::Norms: return "norms";
    case TensorKind::Head: return "head";
    case TensorKind::HyperConnections: return "hyper-conn.";
    case TensorKind::Mtp: return "MTP";
    case TensorKind::Unknown: return "unknown";
  }
  return "?";
}

namespace {

// For `name` = head + "<digits>." + rest: sets `rest` and returns true.
bool after_layer_index(std::string_view name, std::string_view head, std::string_view& rest) {
  if (!name.starts_with(head)) return false;
  rest = name.substr(head.size());
  const size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string_view::npos ||
      !std::all_of(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(dot),
                   [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  rest.remove_prefix(dot + 1);
  return true;
}

// DeepSeek-V4's released names (SPEC §6.10).
TensorKind v4_kind_of(std::string_view name) {
  if (name == "embed.weight") return TensorKind::Embedding;
  if (name == "head.weight") return TensorKind::Head;
  if (name == "norm.weight") return TensorKind::Norms;
  if (name.starts_with("hc_head_")) return TensorKind::HyperConnections;
  const bool mtp = name.starts_with("mtp.");
  if (name.find(".ffn.experts.") != std::string_view::npos) return TensorKind::RoutedExperts;
  if (mtp) return TensorKind::Mtp;
  std::string_view rest;
  if (!after_layer_index(name, "layers.", rest)) return TensorKind::Unknown;
  if (rest.starts_with("hc_")) return TensorKind::HyperConnections;
  if (rest.ends_with("norm.weight")) return TensorKind::Norms;
  if (rest.starts_with("attn.")) return TensorKind::Attention;
  if (rest.starts_with("ffn.gate.")) return TensorKind::Router;
  if (rest.starts_with("ffn.shared_experts.")) return TensorKind::SharedExperts;
  return TensorKind::Unknown;
}

}  // namespace

TensorKind tensor_kind_of(const std::string& name, const HfWeightsInfo& info) {
  if (info.v4()) return v4_kind_of(name);
  if (info.mtp_layer_of(name) >= 0) return TensorKind::Mtp;
  if (name == "model.embed_tokens.weight") return TensorKind::Embedding;
  if (name == "lm_head.weight") return TensorKind::Head;
  if (name == "model.norm.weight") return TensorKind::Norms;
  std::string_view rest;
  if (!after_layer_index(name, "model.layers.", rest)) return TensorKind::Unknown;
  if (rest.ends_with("layernorm.weight")) return TensorKind::Norms;
  if (rest.starts_with("self_attn.")) return TensorKind::Attention;
  if (rest.starts_with("mlp.gate.")) return TensorKind::Router;
  if (rest.starts_with("mlp.shared_experts.")) return TensorKind::SharedExperts;
  if (rest.starts_with("mlp.experts.")) return TensorKind::RoutedExperts;
  if (rest.starts_with("mlp.")) return TensorKind::DenseMlp;
  return TensorKind::Unknown;
}

namespace {

// The order of DeepSeekV4Model::params() (model/v4/v4_model.h) with fp32 routed experts.
std::vector<ExpectedTensor> expected_v4_tensors(const ModelConfig& c) {
  std::vector<ExpectedTensor> out;
  auto add = [&](std::string name, Shape shape, bool matrix) {
    const TensorKind kind = v4_kind_of(name);
    out.push_back({std::move(name), std::move(shape), kind, matrix, false});
  };
  auto vec = [&](const std::string& name, int64_t n) { add(name, {n}, false); };
  auto mat = [&](const std::string& name, int64_t rows, int64_t cols) { add(name, {rows, cols}, true); };
  const int64_t D = c.hidden_size, n = c.hc_mult, mix = (2 + n) * n;
  const int64_t H = c.num_attention_heads, d = c.head_dim, I = c.moe_intermediate_size;
  auto hc_site = [&](const std::string& key) {
    add(key + "_fn", {mix, n * D}, false);
    vec(key + "_base", mix);
    vec(key + "_scale", 3);
  };
  auto compressor = [&](const std::string& p, int64_t head_dim, int64_t ratio) {
    const int64_t features = (ratio == 4 ? 2 : 1) * head_dim;  // CSA windows overlap: coff 2
    mat(p + "wkv.weight", features, D);
    mat(p + "wgate.weight", features, D);
    add(p + "ape", {ratio, features}, false);
    vec(p + "norm.weight", head_dim);
  };
  auto swiglu = [&](const std::string& p, int64_t hidden) {
    mat(p + "w1.weight", hidden, D);
    mat(p + "w3.weight", hidden, D);
    mat(p + "w2.weight", D, hidden);
  };
  auto block = [&](const std::string& p, int64_t layer) {
    hc_site(p + "hc_attn");
    vec(p + "attn_norm.weight", D);
    const std::string a = p + "attn.";
    mat(a + "wq_a.weight", c.q_lora_rank, D);
    vec(a + "q_norm.weight", c.q_lora_rank);
    mat(a + "wq_b.weight", H * d, c.q_lora_rank);
    mat(a + "wkv.weight", d, D);
    vec(a + "kv_norm.weight", d);
    mat(a + "wo_a.weight", c.o_groups * c.o_lora_rank, H * d / c.o_groups);
    mat(a + "wo_b.weight", D, c.o_groups * c.o_lora_rank);
    vec(a + "attn_sink", H);
    const int64_t ratio = c.compress_ratio(layer);
    if (ratio > 0) compressor(a + "compressor.", d, ratio);
    if (ratio == 4) {
      mat(a + "indexer.wq_b.weight", c.index_n_heads * c.index_head_dim, c.q_lora_rank);
      mat(a + "indexer.weights_proj.weight", c.index_n_heads, D);
      compressor(a + "indexer.compressor.", c.index_head_dim, ratio);
    }
    hc_site(p + "hc_ffn");
    vec(p + "ffn_norm.weight", D);
    mat(p + "ffn.gate.weight", c.n_routed_experts, D);
    if (layer < c.num_hash_layers) {
      add(p + "ffn.gate.tid2eid", {c.vocab_size, c.num_experts_per_tok}, false);
      out.back().ids = true;
    } else {
      vec(p + "ffn.gate.bias", c.n_routed_experts);
    }
    for (int64_t e = 0; e < c.n_routed_experts; ++e)
      swiglu(fmt::format("{}ffn.experts.{}.", p, e), I);
    if (c.n_shared_experts > 0) swiglu(p + "ffn.shared_experts.", I * c.n_shared_experts);
  };
  mat("embed.weight", c.vocab_size, D);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) block(fmt::format("layers.{}.", l), l);
  add("hc_head_fn", {n, n * D}, false);
  vec("hc_head_base", n);
  vec("hc_head_scale", 1);
  vec("norm.weight", D);
  mat("head.weight", c.vocab_size, D);
  if (c.num_nextn_predict_layers > 0) {
    const std::string p = "mtp.0.";
    vec(p + "enorm.weight", D);
    vec(p + "hnorm.weight", D);
    mat(p + "e_proj.weight", D, D);
    mat(p + "h_proj.weight", D, D);
    block(p, c.num_hidden_layers);
    add(p + "hc_head_fn", {n, n * D}, false);
    vec(p + "hc_head_base", n);
    vec(p + "hc_head_scale", 1);
    vec(p + "norm.weight", D);
  }
  return out;
}

}  // namespace

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c) {
  if (c.is_v4()) return expected_v4_tensors(c);
  std::vector<ExpectedTensor> out;
  auto vec = [&](std::string name, int64_t n, TensorKind kind, bool optional = false) {
    out.push_back({std::move(name), {n}, kind, false, optional});
  };
  auto mat = [&](std::string name, int64_t rows, int64_t cols, TensorKind kind) {
    out.push_back({std::move(name), {rows, cols}, kind, true, false});
  };
  auto swiglu = [&](const std::string& prefix, int64_t hidden, TensorKind kind) {
    mat(prefix + "gate_proj.weight", hidden, c.hidden_size, kind);
    mat(prefix + "up_proj.weight", hidden, c.hidden_size, kind);
    mat(prefix + "down_proj.weight", c.hidden_size, hidden, kind);
  };
  const int64_t D = c.hidden_size, H = c.num_attention_heads;
  mat("model.embed_tokens.weight", c.vocab_size, D, TensorKind::Embedding);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    vec(p + "input_layernorm.weight", D, TensorKind::Norms);
    const std::string a = p + "self_attn.";
    if (c.q_lora_rank > 0) {
      mat(a + "q_a_proj.weight", c.q_lora_rank, D, TensorKind::Attention);
      vec(a + "q_a_layernorm.weight", c.q_lora_rank, TensorKind::Norms);
      mat(a + "q_b_proj.weight", H * c.qk_head_dim(), c.q_lora_rank, TensorKind::Attention);
    } else {
      mat(a + "q_proj.weight", H * c.qk_head_dim(), D, TensorKind::Attention);
    }
    mat(a + "kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, D,
        TensorKind::Attention);
    vec(a + "kv_a_layernorm.weight", c.kv_lora_rank, TensorKind::Norms);
    mat(a + "kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
        TensorKind::Attention);
    mat(a + "o_proj.weight", D, H * c.v_head_dim, TensorKind::Attention);
    vec(p + "post_attention_layernorm.weight", D, TensorKind::Norms);
    if (!c.is_moe_layer(l)) {
      swiglu(p + "mlp.", c.intermediate_size, TensorKind::DenseMlp);
      continue;
    }
    mat(p + "mlp.gate.weight", c.n_routed_experts, D, TensorKind::Router);
    vec(p + "mlp.gate.e_score_correction_bias", c.n_routed_experts, TensorKind::Router, true);
    for (int64_t e = 0; e < c.n_routed_experts; ++e)
      swiglu(fmt::format("{}mlp.experts.{}.", p, e), c.moe_intermediate_size,
             TensorKind::RoutedExperts);
    if (c.n_shared_experts > 0)
      swiglu(p + "mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts,
             TensorKind::SharedExperts);
  }
  vec("model.norm.weight", D, TensorKind::Norms);
  mat("lm_head.weight", c.vocab_size, D, TensorKind::Head);
  return out;
}

namespace {

bool is_packed(const std::string& dtype) { return dtype == "I8" || dtype == "U8"; }

std::string format_of_dtype(const std::string& dtype) {
  if (dtype == "F32") return "fp32";
  if (dtype == "BF16") return "bf16";
  if (dtype == "F8_E4M3") return "fp8";
  if (is_packed(dtype)) return "mxfp4";
  return dtype;
}

// FP8 rows buffered by a load (io/fp8.cpp): at least one row, up to 1 MiB.
int64_t fp8_chunk_bytes(int64_t rows, int64_t cols) {
  return std::clamp<int64_t>((int64_t{1} << 20) / std::max<int64_t>(cols, 1), 1, rows) * cols;
}

std::string where(const InspectTensor& t) { return fmt::format("{} ({})", t.name, t.file); }

}  // namespace

InspectReport inspect_model(const fs::path& dir) {
  InspectReport r;
  r.dir = dir;
  r.config = read_hf_config(dir);
  r.info = read_hf_weights_info(dir);
  r.counts = count_params(r.config);
  const SafetensorsIndex index = read_safetensors_index(dir);
  r.sharded = index.sharded;
  r.files = index.files;

  // Every header, and the index against them.
  std::map<std::string, size_t> by_name;  // tensor -> r.tensors index
  std::map<std::string, std::set<std::string>> indexed;  // file -> tensors the index puts there
  std::set<std::string> indexed_names;
  for (const auto& [tensor, file] : index.weight_map) {
    indexed[file].insert(tensor);
    indexed_names.insert(tensor);
  }
  std::error_code ec;
  for (const std::string& file : index.files) {
    const fs::path path = dir / file;
    if (!fs::is_regular_file(path, ec)) {
      r.problems.push_back(fmt::format("{}: the index maps {} tensors (e.g. '{}') to this file, "
                                       "which does not exist", path.string(),
                                       indexed[file].size(), *indexed[file].begin()));
      continue;
    }
    r.file_bytes += static_cast<int64_t>(fs::file_size(path, ec));
    const SafetensorsReader reader(path);  // header only; errors name the file and the tensor
    for (const SafetensorsEntry& e : reader.entries()) {
      if (index.sharded && !indexed[file].contains(e.name)) {
        r.problems.push_back(fmt::format("{}: holds tensor '{}', which {} does not list (a load "
                                         "would not see it)", path.string(), e.name,
                                         kSafetensorsIndexFile));
        continue;
      }
      const auto [it, fresh] = by_name.emplace(e.name, r.tensors.size());
      if (!fresh) {
        r.problems.push_back(fmt::format("{}: tensor '{}' is also in {}", path.string(), e.name,
                                         r.tensors[it->second].file));
        continue;
      }
      InspectTensor t;
      t.name = e.name;
      t.file = file;
      t.dtype = e.dtype;
      t.shape = e.shape;
      t.bytes = e.nbytes();
      t.kind = tensor_kind_of(e.name, r.info);
      t.format = format_of_dtype(e.dtype);
      r.tensors.push_back(std::move(t));
    }
  }
  for (const auto& [tensor, file] : index.weight_map)
    if (fs::is_regular_file(dir / file, ec) && !by_name.contains(tensor))
      r.problems.push_back(fmt::format("{}: maps tensor '{}' to {}, which does not hold it",
                                       (dir / kSafetensorsIndexFile).string(), tensor, file));
  // Scales take their weight's format (V4 names both FP8 and MXFP4 scales X.scale).
  for (InspectTensor& t : r.tensors) {
    const std::string fp8_weight = fp8_weight_of_scale_inv(t.name);
    if (!fp8_weight.empty()) {
      t.format = "fp8";
    } else if (t.name.ends_with(".scale") && (t.dtype == "F8_E8M0" || t.dtype == "U8")) {
      const auto w = by_name.find(t.name.substr(0, t.name.size() - 6) + ".weight");
      const bool fp8 = w != by_name.end() && r.tensors[w->second].dtype == "F8_E4M3";
      t.format = fp8 ? "fp8" : "mxfp4";
    }
  }

  // Against the model the config describes.
  std::set<std::string> accounted;
  const Fp8Block block = r.info.fp8_block();
  for (const ExpectedTensor& x : expected_tensors(r.config)) {
    const int64_t elements = shape_numel(x.shape);
    if (x.routed_expert()) {
      r.experts_fp32_bytes += elements * 4;
      r.experts_mxfp4_bytes += elements * 17 / 32;
    } else {
      r.nonexpert_bytes += elements * 4;
    }
    const auto it = by_name.find(x.name);
    if (it == by_name.end()) {
      if (x.optional && indexed_names.contains(x.name)) continue;  // its file is the problem
      if (x.optional)
        r.notes.push_back(fmt::format("'{}' is absent: a load sets it to zeros", x.name));
      else
        r.missing.push_back(x.name);
      continue;
    }
    const InspectTensor& t = r.tensors[it->second];
    accounted.insert(t.name);
    InspectFormatStats& fs_stats = r.formats[t.format];
    ++fs_stats.weights;
    fs_stats.elements += elements;
    fs_stats.bytes += t.bytes;
    const int64_t cols = x.shape.back(), rows = x.matrix ? x.shape[0] : 1;
    r.load_transient_bytes = std::max(r.load_transient_bytes, cols * 4);
    if (x.ids) {
      if ((t.dtype != "I64" && t.dtype != "I32") || t.shape != x.shape)
        r.problems.push_back(fmt::format("{}: {} {}; an id table loads from I64 or I32 {}",
                                         where(t), t.dtype, shape_str(t.shape),
                                         shape_str(x.shape)));
      continue;
    }
    if (t.dtype == "F32" || t.dtype == "BF16") {
      if (t.shape != x.shape)
        r.problems.push_back(fmt::format("{}: shape {}, the config implies {}", where(t),
                                         shape_str(t.shape), shape_str(x.shape)));
      continue;
    }
    if (!x.matrix) {
      r.problems.push_back(fmt::format("{}: dtype {}; a load needs F32 or BF16 here", where(t),
                                       t.dtype));
      continue;
    }
    if (t.dtype == "F8_E4M3") {
      const std::string scale = fp8_scale_name(t.name, block.scale_key);
      const Shape want_scale = {(rows + block.rows - 1) / block.rows,
                                (cols + block.cols - 1) / block.cols};
      if (t.shape != x.shape)
        r.problems.push_back(fmt::format("{}: shape {}, the config implies {}", where(t),
                                         shape_str(t.shape), shape_str(x.shape)));
      const auto sit = by_name.find(scale);
      if (sit == by_name.end()) {
        r.problems.push_back(fmt::format("{}: FP8 weight without its scale tensor '{}'",
                                         where(t), scale));
        continue;
      }
      const InspectTensor& s = r.tensors[sit->second];
      accounted.insert(s.name);
      fs_stats.bytes += s.bytes;
      if (s.shape != want_scale || !(s.dtype == "F32" || s.dtype == "BF16" || s.dtype == "F8_E8M0"))
        r.problems.push_back(fmt::format("{}: scale of '{}' is {} {}; blocks of {}x{} need {} {}",
                                         where(s), t.name, s.dtype, shape_str(s.shape),
                                         block.rows, block.cols, r.info.v4() ? "F8_E8M0" : "F32",
                                         shape_str(want_scale)));
      r.load_transient_bytes = std::max(
          r.load_transient_bytes, fp8_chunk_bytes(rows, cols) + shape_numel(want_scale) * 4);
      continue;
    }
    if (is_packed(t.dtype)) {
      const std::string scale = mxfp4_scale_name(t.name);
      const Shape want = {rows, cols / 2}, want_scale = {rows, cols / 32};
      if (!x.routed_expert())
        r.problems.push_back(fmt::format("{}: MXFP4-packed, but only routed experts can be "
                                         "packed", where(t)));
      if (t.shape != want || cols % 32 != 0)
        r.problems.push_back(fmt::format("{}: packed shape {}, the config implies {} ([out, "
                                         "in/2] bytes)", where(t), shape_str(t.shape),
                                         shape_str(want)));
      const auto sit = by_name.find(scale);
      if (sit == by_name.end()) {
        r.problems.push_back(fmt::format("{}: MXFP4 weight without its scale tensor '{}'",
                                         where(t), scale));
        continue;
      }
      const InspectTensor& s = r.tensors[sit->second];
      accounted.insert(s.name);
      fs_stats.bytes += s.bytes;
      if (s.shape != want_scale || !(s.dtype == "F8_E8M0" || s.dtype == "U8"))
        r.problems.push_back(fmt::format("{}: scale of '{}' is {} {}, expected F8_E8M0 {}",
                                         where(s), t.name, s.dtype, shape_str(s.shape),
                                         shape_str(want_scale)));
      continue;
    }
    r.problems.push_back(fmt::format("{}: dtype {}; a weight loads from F32, BF16, F8_E4M3 (with "
                                     "{}) or I8 + F8_E8M0 (MXFP4)", where(t), t.dtype,
                                     r.info.v4() ? ".scale" : "weight_scale_inv"));
  }
  r.experts = r.config.mxfp4_experts() ? "mxfp4" : "fp32";
  for (const InspectTensor& t : r.tensors) {
    InspectKindStats& k = r.kinds[t.kind];
    ++k.tensors;
    k.bytes += t.bytes;
    ++k.dtypes[t.dtype];
    if (t.kind == TensorKind::Mtp && !r.info.v4()) {  // V4's MTP module is part of the model
      ++r.mtp_tensors;
      continue;
    }
    if (!accounted.contains(t.name)) r.unexpected.push_back(where(t));
  }
  return r;
}

namespace {

std::string count_str(int64_t n) {
  const double v = static_cast<double>(n);
  if (n >= 1000000000) return fmt::format("{:.2f}B", v / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f}M", v / 1e6);
  if (n >= 1000) return fmt::format("{:.2f}K", v / 1e3);
  return fmt::format("{}", n);
}

void list(std::string& out, const char* title, const std::vector<std::string>& items,
          size_t limit = 20) {
  if (items.empty()) {
    out += fmt::format("{}: none\n", title);
    return;
  }
  out += fmt::format("{}: {}\n", title, items.size());
  for (size_t i = 0; i < items.size() && i < limit; ++i) out += fmt::format("  {}\n", items[i]);
  if (items.size() > limit) out += fmt::format("  ... and {} more\n", items.size() - limit);
}

std::string format_v3_summary(const InspectReport& r) {
  const ModelConfig& c = r.config;
  std::string out;
  const int64_t dense = c.n_routed_experts ? std::min(c.first_k_dense_replace, c.num_hidden_layers)
                                           : c.num_hidden_layers;
  out += fmt::format("  layers {} ({} dense, {} MoE)", c.num_hidden_layers, dense,
                     c.num_hidden_layers - dense);
  if (r.info.num_nextn_predict_layers > 0)
    out += fmt::format(" + {} MTP layer{} (model.layers.{}.*, not used by moe)",
                       r.info.num_nextn_predict_layers,
                       r.info.num_nextn_predict_layers == 1 ? "" : "s", c.num_hidden_layers);
  out += fmt::format("; hidden {}, heads {}, vocab {}\n", c.hidden_size, c.num_attention_heads,
                     c.vocab_size);
  out += fmt::format("  attention: MLA, {}, kv_lora_rank {}, qk {}+{} (nope+rope), v {}\n",
                     c.q_lora_rank > 0 ? fmt::format("q_lora_rank {}", c.q_lora_rank)
                                       : std::string("q_proj"),
                     c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
  out += fmt::format("  rope: theta {}", c.rope_theta);
  if (c.rope_scaling.is_yarn())
    out += fmt::format(", YaRN x{} on {} (beta {}/{}, mscale {}, mscale_all_dim {})",
                       c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings,
                       c.rope_scaling.beta_fast, c.rope_scaling.beta_slow, c.rope_scaling.mscale,
                       c.rope_scaling.mscale_all_dim);
  out += fmt::format("; max positions {}\n", c.max_position_embeddings);
  if (c.n_routed_experts > 0)
    out += fmt::format("  experts: {} routed (width {}) + {} shared, top-{}; {}, {}, {} group{} "
                       "keep {}, {}normalised, x{}\n",
                       c.n_routed_experts, c.moe_intermediate_size, c.n_shared_experts,
                       c.num_experts_per_tok, c.scoring_func, c.topk_method, c.n_group,
                       c.n_group == 1 ? "" : "s", c.topk_group, c.norm_topk_prob ? "" : "not ",
                       c.routed_scaling_factor);
  return out;
}

std::string format_v4_summary(const InspectReport& r) {
  const ModelConfig& c = r.config;
  int64_t csa = 0, hca = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    csa += c.compress_ratio(l) == 4;
    hca += c.compress_ratio(l) != 4 && c.compress_ratio(l) > 0;
  }
  std::string out;
  out += fmt::format("  layers {} (all MoE, the first {} hash-routed)", c.num_hidden_layers,
                     std::min(c.num_hash_layers, c.num_hidden_layers));
  if (c.num_nextn_predict_layers > 0)
    out += fmt::format(" + {} MTP layer (mtp.0.*)", c.num_nextn_predict_layers);
  out += fmt::format("; hidden {}, heads {}, vocab {}, {} hyper-connection streams\n",
                     c.hidden_size, c.num_attention_heads, c.vocab_size, c.hc_mult);
  out += fmt::format("  attention: one shared KV head of {} (rope {}), q_lora_rank {}, output {} "
                     "groups x rank {}, sliding window {}; {} CSA layers (ratio 4, indexer "
                     "top-{}), {} HCA, {} sliding only\n",
                     c.head_dim, c.qk_rope_head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank,
                     c.sliding_window, csa, c.index_topk, hca, c.num_hidden_layers - csa - hca);
  out += fmt::format("  rope: theta {} (sliding layers), {} (compressed layers", c.rope_theta,
                     c.compress_rope_theta);
  if (c.rope_scaling.is_yarn())
    out += fmt::format(", YaRN x{} on {}", c.rope_scaling.factor,
                       c.rope_scaling.original_max_position_embeddings);
  out += fmt::format("); max positions {}\n", c.max_position_embeddings);
  out += fmt::format("  experts: {} routed (width {}) + {} shared, top-{}; {}, x{}, SwiGLU clamp "
                     "{}\n",
                     c.n_routed_experts, c.moe_intermediate_size, c.n_shared_experts,
                     c.num_experts_per_tok, c.scoring_func, c.routed_scaling_factor,
                     c.swiglu_limit);
  return out;
}

std::string format_weights(const InspectReport& r) {
  std::string out;
  out += fmt::format("weights: {} file{} ({}), {}, {} tensors\n", r.files.size(),
                     r.files.size() == 1 ? "" : "s",
                     r.sharded ? kSafetensorsIndexFile : kSafetensorsSingleFile,
                     format_bytes(r.file_bytes), r.tensors.size());
  out += fmt::format("  {:<16} {:>8} {:>12}  {}\n", "kind", "tensors", "bytes", "dtypes");
  for (const auto& [kind, k] : r.kinds) {
    std::string dtypes;
    for (const auto& [d, n] : k.dtypes) dtypes += fmt::format("{}{} x{}", dtypes.empty() ? "" : ", ", d, n);
    out += fmt::format("  {:<16} {:>8} {:>12}  {}\n", tensor_kind_name(kind), k.tensors,
                       format_bytes(k.bytes), dtypes);
  }
  // One example per kind: its first weight by name (scales are listed with their weights).
  std::map<TensorKind, const InspectTensor*> first;
  for (const InspectTensor& t : r.tensors) {
    if (!fp8_weight_of_scale_inv(t.name).empty() || t.name.ends_with(".scale")) continue;
    const InspectTensor*& f = first[t.kind];
    if (f == nullptr || t.name < f->name) f = &t;
  }
  out += "  e.g.\n";
  for (const auto& [kind, t] : first) {
    std::string scale;
    for (const std::string& s : {fp8_scale_inv_name(t->name), mxfp4_scale_name(t->name)})
      for (const InspectTensor& u : r.tensors)
        if (u.name == s) scale = fmt::format(" + {} {}", u.dtype, shape_str(u.shape));
    out += fmt::format("    {} {} {}{} ({})\n", t->name, t->dtype, shape_str(t->shape), scale,
                       t->file);
  }
  out += "formats of the weights the model uses:\n";
  for (const auto& [f, s] : r.formats)
    out += fmt::format("  {:<6} {:>8} tensors {:>10} weights {:>12}{}\n", f, s.weights,
                       count_str(s.elements), format_bytes(s.bytes),
                       f == "fp8" ? " (with their scales)" : f == "mxfp4" ? " (with their scales)" : "");
  if (r.mtp_tensors > 0)
    out += fmt::format("MTP: {} tensors, skipped by a load (convert and quantize leave them out)\n",
                       r.mtp_tensors);
  list(out, "missing", r.missing);
  list(out, "unexpected (ignored by a load)", r.unexpected);
  list(out, "problems", r.problems);
  for (const std::string& n : r.notes) out += fmt::format("note: {}\n", n);
  out += "a load needs (weights in the engine's formats; everything else is fp32):\n";
  out += fmt::format("  non-expert weights fp32     {}\n", format_bytes(r.nonexpert_bytes));
  if (r.experts_fp32_bytes > 0) {
    out += fmt::format("  routed experts fp32         {}  -> total {}{}\n",
                       format_bytes(r.experts_fp32_bytes),
                       format_bytes(r.nonexpert_bytes + r.experts_fp32_bytes),
                       r.experts == "fp32" ? "  (this config)" : "");
    out += fmt::format("  routed experts mxfp4        {}  -> total {}{}\n",
                       format_bytes(r.experts_mxfp4_bytes),
                       format_bytes(r.nonexpert_bytes + r.experts_mxfp4_bytes),
                       r.experts == "mxfp4" ? "  (this config)"
                                            : "  (--model.experts mxfp4, or moe convert)");
  }
  out += fmt::format("  transient while loading     {} (one row, or one chunk of FP8 rows + "
                     "its scales)\n", format_bytes(r.load_transient_bytes));
  return out;
}

}  // namespace

std::string format_inspect_report(const InspectReport& r) {
  const ModelConfig& c = r.config;
  std::string out;
  out += fmt::format("model: {} ({}, {})\n", r.dir.string(), c.model_type,
                     c.is_v4()                       ? "DeepseekV4ForCausalLM"
                     : c.model_type == "deepseek_v2" ? "DeepseekV2ForCausalLM"
                                                     : "DeepseekV3ForCausalLM");
  if (c.is_v4()) {
    out += format_v4_summary(r);
  } else {
    out += format_v3_summary(r);
  }
  out += fmt::format("  parameters: {} total, {} active per token, {} in routed experts{}\n",
                     count_str(r.counts.total), count_str(r.counts.active_per_token),
                     count_str(r.counts.routed_expert),
                     r.counts.mtp > 0 ? fmt::format(" (+ {} in the MTP layer)", count_str(r.counts.mtp))
                                      : std::string());
  std::string quant = "none";
  if (r.info.quant_method == "fp8")
    quant = fmt::format("fp8 (F8_E4M3, {}x{} blocks, scales {})", r.info.fp8_block_rows,
                        r.info.fp8_block_cols,
                        r.info.v4()                    ? "F8_E8M0 X.scale"
                        : r.info.fp8_scale_fmt.empty() ? "F32"
                                                       : "ue8m0: powers of two");
  else if (r.info.quant_method == "mxfp4")
    quant = "mxfp4 (routed experts packed)";
  out += fmt::format("  quantization_config: {}; torch_dtype {}{}\n", quant, c.torch_dtype,
                     c.is_v4() ? fmt::format("; routed experts {} (config)", r.experts) : "");
  out += format_weights(r);
  return out;
}

}  // namespace moe
