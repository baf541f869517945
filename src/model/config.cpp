#include "model/config.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/quant_sim.h"

namespace moe {

namespace {

// The total parameter count's bound (kMaxConfigSize and kMaxConfigLayers: model/config.h).
constexpr int64_t kMaxConfigParams = int64_t{1} << 56;

// The bounds above, then the total parameter count (defined below, beside the count).
void check_sizes(const ModelConfig& c, const std::string& source);

// The checks V2/V3 and V4 configs share: norms, RoPE / YaRN and the SwiGLU clamp.
void check_norm_rope_and_clamp(const ModelConfig& c, const std::string& source) {
  MOE_CHECK(c.rms_norm_eps > 0 && std::isfinite(c.rms_norm_eps),
            "{}: field 'rms_norm_eps' must be a finite number > 0, got {}", source, c.rms_norm_eps);
  for (const auto& [field, v] : {std::pair<const char*, double>{"routed_scaling_factor", c.routed_scaling_factor},
                                 {"aux_loss_alpha", c.aux_loss_alpha},
                                 {"rope_scaling.factor", c.rope_scaling.factor},
                                 {"rope_scaling.beta_fast", c.rope_scaling.beta_fast},
                                 {"rope_scaling.beta_slow", c.rope_scaling.beta_slow},
                                 {"rope_scaling.mscale", c.rope_scaling.mscale},
                                 {"rope_scaling.mscale_all_dim", c.rope_scaling.mscale_all_dim}})
    MOE_CHECK(std::isfinite(v), "{}: field '{}' must be a finite number, got {}", source, field, v);
  MOE_CHECK(c.swiglu_limit >= 0 && std::isfinite(c.swiglu_limit),
            "{}: field 'swiglu_limit' must be a finite number >= 0 (0 = no clamp), got {}", source,
            c.swiglu_limit);
  MOE_CHECK(c.rope_theta > 0 && std::isfinite(c.rope_theta),
            "{}: field 'rope_theta' must be a finite number > 0, got {}", source, c.rope_theta);
  MOE_CHECK(c.rope_scaling.type.empty() || c.rope_scaling.type == "yarn",
            "{}: field 'rope_scaling.type' must be \"yarn\" or absent, got \"{}\"", source,
            c.rope_scaling.type);
  if (c.rope_scaling.is_yarn()) {
    MOE_CHECK(c.rope_scaling.factor > 0, "{}: field 'rope_scaling.factor' must be > 0", source);
    MOE_CHECK(c.rope_scaling.original_max_position_embeddings > 0,
              "{}: field 'rope_scaling.original_max_position_embeddings' must be a positive "
              "integer, got {}", source, c.rope_scaling.original_max_position_embeddings);
  }
}

}  // namespace

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](int64_t v, const char* field) {
    MOE_CHECK(v > 0, "{}: field '{}' must be a positive integer, got {}", source, field, v);
  };
  MOE_CHECK(model_type == "deepseek_v3" || model_type == "deepseek_v2" || model_type == "deepseek_v4",
            "{}: field 'model_type' must be \"deepseek_v3\", \"deepseek_v2\" or \"deepseek_v4\", "
            "got \"{}\"", source, model_type);
  MOE_CHECK(quantization_simulation == "none" || quantization_simulation == "reference",
            "{}: field 'quantization_simulation' must be \"none\" or \"reference\", got \"{}\"",
            source, quantization_simulation);
  // Before anything adds to or loops over the layer count.
  MOE_CHECK(num_hidden_layers <= kMaxConfigLayers,
            "{}: field 'num_hidden_layers' must be at most {}, got {}", source, kMaxConfigLayers,
            num_hidden_layers);
  if (is_v4()) return validate_v4(source);
  MOE_CHECK(quantization_simulation == "none", "{}: field 'quantization_simulation' must be "
            "\"none\" for {} (DeepSeek-V4's simulated FP8 / FP4 applies to deepseek_v4 only), got "
            "\"{}\"", source, model_type, quantization_simulation);
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(kv_lora_rank, "kv_lora_rank");
  positive(qk_rope_head_dim, "qk_rope_head_dim");
  positive(v_head_dim, "v_head_dim");
  MOE_CHECK(qk_nope_head_dim >= 0, "{}: field 'qk_nope_head_dim' must be >= 0, got {}", source,
            qk_nope_head_dim);
  MOE_CHECK(qk_rope_head_dim % 2 == 0, "{}: field 'qk_rope_head_dim' must be even, got {}", source,
            qk_rope_head_dim);
  MOE_CHECK(q_lora_rank >= 0, "{}: field 'q_lora_rank' must be >= 0 or null, got {}", source,
            q_lora_rank);
  MOE_CHECK(!tie_word_embeddings, "{}: field 'tie_word_embeddings' must be false (DeepSeek models "
            "use an untied LM head)", source);
  MOE_CHECK(first_k_dense_replace >= 0 && first_k_dense_replace <= num_hidden_layers,
            "{}: field 'first_k_dense_replace' must be in [0, num_hidden_layers={}], got {}", source,
            num_hidden_layers, first_k_dense_replace);
  MOE_CHECK(moe_layer_freq == 1, "{}: field 'moe_layer_freq' must be 1, got {}", source,
            moe_layer_freq);
  if (first_k_dense_replace > 0 || n_routed_experts == 0) positive(intermediate_size, "intermediate_size");
  check_norm_rope_and_clamp(*this, source);
  MOE_CHECK(torch_dtype == "float32" || torch_dtype == "bfloat16",
            "{}: field 'torch_dtype' must be \"float32\" or \"bfloat16\", got \"{}\"", source,
            torch_dtype);
  MOE_CHECK(expert_format == "fp32" || expert_format == "mxfp4",
            "{}: routed expert format must be \"fp32\" or \"mxfp4\", got \"{}\"", source,
            expert_format);
  if (mxfp4_experts()) {
    MOE_CHECK(n_routed_experts > 0, "{}: quantization_config asks for MXFP4 routed experts, but "
              "the model has none (n_routed_experts = 0)", source);
    // A scale covers 32 consecutive inputs of every expert matrix (gate/up: hidden_size, down:
    // moe_intermediate_size).
    MOE_CHECK(hidden_size % 32 == 0 && moe_intermediate_size % 32 == 0,
              "{}: MXFP4 experts need hidden_size and moe_intermediate_size divisible by 32 "
              "(32-element scale blocks), got {} and {}", source, hidden_size,
              moe_intermediate_size);
  }
  if (n_routed_experts > 0) {
    positive(moe_intermediate_size, "moe_intermediate_size");
    MOE_CHECK(n_shared_experts >= 0, "{}: field 'n_shared_experts' must be >= 0", source);
    MOE_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= n_routed_experts,
              "{}: field 'num_experts_per_tok' must be in [1, n_routed_experts={}], got {}", source,
              n_routed_experts, num_experts_per_tok);
    MOE_CHECK(n_group >= 1 && n_routed_experts % n_group == 0,
              "{}: field 'n_group' must divide n_routed_experts={}, got {}", source,
              n_routed_experts, n_group);
    MOE_CHECK(topk_group >= 1 && topk_group <= n_group,
              "{}: field 'topk_group' must be in [1, n_group={}], got {}", source, n_group,
              topk_group);
    MOE_CHECK(topk_method == "noaux_tc" || topk_method == "group_limited_greedy" ||
                  topk_method == "greedy",
              "{}: field 'topk_method' must be \"noaux_tc\", \"group_limited_greedy\" or "
              "\"greedy\", got \"{}\"", source, topk_method);
    MOE_CHECK(scoring_func == "sigmoid" || scoring_func == "softmax" ||
                  scoring_func == "sqrtsoftplus",
              "{}: field 'scoring_func' must be \"sigmoid\", \"softmax\" or \"sqrtsoftplus\", "
              "got \"{}\"", source, scoring_func);
    MOE_CHECK(scoring_func != "sqrtsoftplus" || n_group == 1,
              "{}: the sqrtsoftplus router (DeepSeek-V4) has no expert groups, but n_group = {}",
              source, n_group);
    if (n_group > 1 && topk_method == "noaux_tc")
      MOE_CHECK(n_routed_experts / n_group >= 2,
                "{}: noaux_tc group scoring needs at least 2 experts per group (n_routed_experts / "
                "n_group), got {}", source, n_routed_experts / n_group);
    MOE_CHECK(num_experts_per_tok <= topk_group * (n_routed_experts / n_group),
              "{}: field 'num_experts_per_tok' ({}) exceeds the experts in topk_group groups ({})",
              source, num_experts_per_tok, topk_group * (n_routed_experts / n_group));
  }
  check_sizes(*this, source);
}

void ModelConfig::validate_v4(const std::string& source) const {
  auto positive = [&](int64_t v, const char* field) {
    MOE_CHECK(v > 0, "{}: field '{}' must be a positive integer, got {}", source, field, v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(head_dim, "head_dim");
  positive(q_lora_rank, "q_lora_rank");
  positive(o_groups, "o_groups");
  positive(o_lora_rank, "o_lora_rank");
  positive(sliding_window, "sliding_window");
  positive(hc_mult, "hc_mult");
  positive(hc_sinkhorn_iters, "hc_sinkhorn_iters");
  MOE_CHECK(qk_rope_head_dim >= 0 && qk_rope_head_dim % 2 == 0 && qk_rope_head_dim <= head_dim,
            "{}: field 'qk_rope_head_dim' must be even and in [0, head_dim={}], got {}", source,
            head_dim, qk_rope_head_dim);
  MOE_CHECK(num_attention_heads % o_groups == 0,
            "{}: field 'o_groups' must divide num_attention_heads={}, got {}", source,
            num_attention_heads, o_groups);
  MOE_CHECK(num_nextn_predict_layers == 0 || num_nextn_predict_layers == 1,
            "{}: field 'num_nextn_predict_layers' must be 0 or 1 (this engine implements MTP "
            "depth 1), got {}", source, num_nextn_predict_layers);
  const int64_t layers = num_hidden_layers + num_nextn_predict_layers;
  MOE_CHECK(static_cast<int64_t>(compress_ratios.size()) >= layers,
            "{}: field 'compress_ratios' must have num_hidden_layers + num_nextn_predict_layers = "
            "{} entries (one per layer, then one per MTP layer), got {}", source, layers,
            compress_ratios.size());
  bool csa = false, compressed = false;
  for (size_t i = 0; i < compress_ratios.size(); ++i) {
    MOE_CHECK(compress_ratios[i] >= 0,
              "{}: field 'compress_ratios[{}]' must be >= 0 (0 sliding window only, 4 CSA, other "
              "HCA), got {}", source, i, compress_ratios[i]);
    if (static_cast<int64_t>(i) >= layers) continue;
    csa |= compress_ratios[i] == 4;
    compressed |= compress_ratios[i] > 0;
  }
  if (compressed)
    MOE_CHECK(compress_rope_theta > 0, "{}: field 'compress_rope_theta' must be > 0, got {}",
              source, compress_rope_theta);
  if (csa) {
    // The indexer scores through its own compressor, whose entries rotate their rope tail.
    positive(index_n_heads, "index_n_heads");
    positive(index_topk, "index_topk");
    MOE_CHECK(index_head_dim >= qk_rope_head_dim && index_head_dim > 0,
              "{}: field 'index_head_dim' must be positive and at least qk_rope_head_dim={}, got "
              "{}", source, qk_rope_head_dim, index_head_dim);
  }
  if (simulates_reference_quantization()) {
    // The reference's kernels quantize whole blocks and rotate power-of-two widths only.
    MOE_CHECK((head_dim - qk_rope_head_dim) % kSimFp8Block == 0,
              "{}: quantization_simulation \"reference\" quantizes the non-RoPE features of the "
              "KV in blocks of {}, so head_dim - qk_rope_head_dim must be a multiple of {}, got "
              "{} - {} = {}", source, kSimFp8Block, kSimFp8Block, head_dim, qk_rope_head_dim,
              head_dim - qk_rope_head_dim);
    if (csa)
      MOE_CHECK(index_head_dim % kSimFp4Block == 0 && (index_head_dim & (index_head_dim - 1)) == 0,
                "{}: quantization_simulation \"reference\" Hadamard-rotates the indexer's heads "
                "and quantizes them in blocks of {}, so index_head_dim must be a power of two "
                ">= {}, got {}", source, kSimFp4Block, kSimFp4Block, index_head_dim);
  }
  MOE_CHECK(hc_eps >= 0 && std::isfinite(hc_eps), "{}: field 'hc_eps' must be a finite number >= 0, "
            "got {}", source, hc_eps);
  MOE_CHECK(num_hash_layers >= 0 && num_hash_layers <= num_hidden_layers,
            "{}: field 'num_hash_layers' must be in [0, num_hidden_layers={}], got {}", source,
            num_hidden_layers, num_hash_layers);
  MOE_CHECK(!tie_word_embeddings, "{}: field 'tie_word_embeddings' must be false (DeepSeek models "
            "use an untied LM head)", source);
  check_norm_rope_and_clamp(*this, source);
  if (rope_scaling.is_yarn()) {
    // V4 rotates the attention output back with the transpose rotation, exact only for
    // unscaled cos/sin; HF forces attention_factor 1.0 for the same reason.
    MOE_CHECK(rope_scaling.mscale == 1.0 && rope_scaling.mscale_all_dim == 0.0,
              "{}: fields 'rope_scaling.mscale' / 'rope_scaling.mscale_all_dim' must be absent "
              "(1 / 0): DeepSeek-V4 applies no YaRN mscale, got {} / {}", source,
              rope_scaling.mscale, rope_scaling.mscale_all_dim);
  }
  MOE_CHECK(torch_dtype == "float32" || torch_dtype == "bfloat16",
            "{}: field 'torch_dtype' must be \"float32\" or \"bfloat16\", got \"{}\"", source,
            torch_dtype);
  // Every V4 block is attention + MoE: no dense layers, no expert groups, sqrtsoftplus scores.
  positive(n_routed_experts, "n_routed_experts");
  positive(moe_intermediate_size, "moe_intermediate_size");
  MOE_CHECK(n_shared_experts >= 0, "{}: field 'n_shared_experts' must be >= 0, got {}", source,
            n_shared_experts);
  MOE_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= n_routed_experts,
            "{}: field 'num_experts_per_tok' must be in [1, n_routed_experts={}], got {}", source,
            n_routed_experts, num_experts_per_tok);
  MOE_CHECK(first_k_dense_replace == 0, "{}: field 'first_k_dense_replace' must be 0 (every "
            "DeepSeek-V4 layer is MoE), got {}", source, first_k_dense_replace);
  MOE_CHECK(moe_layer_freq == 1, "{}: field 'moe_layer_freq' must be 1, got {}", source,
            moe_layer_freq);
  MOE_CHECK(scoring_func == "sqrtsoftplus", "{}: field 'scoring_func' must be \"sqrtsoftplus\" "
            "for deepseek_v4, got \"{}\"", source, scoring_func);
  MOE_CHECK(topk_method == "noaux_tc", "{}: field 'topk_method' must be \"noaux_tc\" for "
            "deepseek_v4, got \"{}\"", source, topk_method);
  MOE_CHECK(n_group == 1 && topk_group == 1, "{}: fields 'n_group' / 'topk_group' must be 1 "
            "(DeepSeek-V4 routes without expert groups), got {} / {}", source, n_group, topk_group);
  MOE_CHECK(expert_format == "fp32" || expert_format == "mxfp4",
            "{}: routed expert format must be \"fp32\" or \"mxfp4\", got \"{}\"", source,
            expert_format);
  if (mxfp4_experts())
    MOE_CHECK(hidden_size % 32 == 0 && moe_intermediate_size % 32 == 0,
              "{}: MXFP4 experts need hidden_size and moe_intermediate_size divisible by 32 "
              "(32-element scale blocks), got {} and {}", source, hidden_size,
              moe_intermediate_size);
  check_sizes(*this, source);
}

namespace {

// Counted in N: int64_t for count_params, __int128 for validate(), whose bounds on every field
// keep all of these products inside 128 bits and whose bound on the total then keeps them
// inside 64.
template <typename N>
struct Counts {
  N total = 0, active_per_token = 0, routed_expert = 0, mtp = 0;
};

// DeepSeek-V4 (SPEC §6.10): the tensors of DeepSeekV4Model, layer by layer.
template <typename N>
Counts<N> count_params_v4(const ModelConfig& c) {
  const N D = c.hidden_size, n = c.hc_mult, M = (2 + n) * n, H = c.num_attention_heads;
  const N d = c.head_dim, ql = c.q_lora_rank, go = N{c.o_groups} * c.o_lora_rank;
  const N expert = 3 * D * c.moe_intermediate_size;
  const N hc_head = n * n * D + n + 1;
  // Everything of a block but its routed experts: two mHC sites, two norms, the attention,
  // compressor and indexer of its ratio, the router (weight + bias; a hash layer's table is not
  // a parameter, and its bias is absent) and the shared experts.
  auto block_fixed = [&](int64_t layer) {
    const N ratio = c.compress_ratio(layer);
    N p = 2 * (M * n * D + M + 3) + 2 * D;
    p += ql * D + ql + H * d * ql + d * D + d + go * (H * d / c.o_groups) + D * go + H;
    if (ratio > 0) {
      const N coff = ratio == 4 ? 2 : 1;
      p += 2 * coff * d * D + ratio * coff * d + d;
    }
    if (ratio == 4) {
      const N di = c.index_head_dim, hi = c.index_n_heads;
      p += hi * di * ql + hi * D + 2 * 2 * di * D + 4 * 2 * di + di;
    }
    p += N{c.n_routed_experts} * D + (layer < c.num_hash_layers ? 0 : c.n_routed_experts);
    return p + N{c.n_shared_experts} * expert;
  };
  Counts<N> p;
  p.total = 2 * c.vocab_size * D + D + hc_head;  // embed, head, norm, hc_head
  p.active_per_token = c.vocab_size * D + D + hc_head + D;  // head, norm, hc_head, one embed row
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const N fixed = block_fixed(l);
    p.total += fixed + c.n_routed_experts * expert;
    p.active_per_token += fixed + c.num_experts_per_tok * expert;
    p.routed_expert += c.n_routed_experts * expert;
  }
  for (int64_t k = 0; k < c.num_nextn_predict_layers; ++k)
    p.mtp += block_fixed(c.num_hidden_layers + k) + c.n_routed_experts * expert + 2 * D * D +
             3 * D + hc_head;  // + e_proj, h_proj, enorm, hnorm, norm, hc_head
  return p;
}

template <typename N>
Counts<N> count_params_as(const ModelConfig& c) {
  if (c.is_v4()) return count_params_v4<N>(c);
  const N d = c.hidden_size, H = c.num_attention_heads;
  N attn = 0;
  if (c.q_lora_rank > 0)
    attn += c.q_lora_rank * d + c.q_lora_rank + H * c.qk_head_dim() * c.q_lora_rank;
  else
    attn += H * c.qk_head_dim() * d;
  attn += (c.kv_lora_rank + c.qk_rope_head_dim) * d + c.kv_lora_rank;
  attn += H * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank;
  attn += d * H * c.v_head_dim;
  const N norms = 2 * d;
  const N dense_ffn = 3 * d * c.intermediate_size;
  const N expert = 3 * d * c.moe_intermediate_size;
  const N moe_fixed = c.n_routed_experts * d + c.n_shared_experts * expert;  // router, shared
  Counts<N> p;
  p.total = 2 * c.vocab_size * d + d;
  p.active_per_token = c.vocab_size * d + d;      // LM head + final norm
  p.active_per_token += d;                        // the token's embedding row
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    N layer = attn + norms;
    N active = layer;
    if (c.is_moe_layer(l)) {
      layer += moe_fixed + c.n_routed_experts * expert;
      active += moe_fixed + c.num_experts_per_tok * expert;
      p.routed_expert += c.n_routed_experts * expert;
    } else {
      layer += dense_ffn;
      active += dense_ffn;
    }
    p.total += layer;
    p.active_per_token += active;
  }
  return p;
}

void check_sizes(const ModelConfig& c, const std::string& source) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size}, {"moe_intermediate_size", c.moe_intermediate_size},
      {"num_attention_heads", c.num_attention_heads}, {"n_routed_experts", c.n_routed_experts},
      {"n_shared_experts", c.n_shared_experts}, {"num_experts_per_tok", c.num_experts_per_tok},
      {"n_group", c.n_group}, {"topk_group", c.topk_group}, {"q_lora_rank", c.q_lora_rank},
      {"kv_lora_rank", c.kv_lora_rank}, {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim}, {"v_head_dim", c.v_head_dim},
      {"head_dim", c.head_dim}, {"o_groups", c.o_groups}, {"o_lora_rank", c.o_lora_rank},
      {"sliding_window", c.sliding_window}, {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim}, {"index_topk", c.index_topk},
      {"hc_mult", c.hc_mult}, {"hc_sinkhorn_iters", c.hc_sinkhorn_iters}};
  for (const auto& [field, v] : sizes)
    MOE_CHECK(v >= 0 && v <= kMaxConfigSize, "{}: field '{}' must be in [0, {}], got {}", source,
              field, kMaxConfigSize, v);
  for (size_t i = 0; i < c.compress_ratios.size(); ++i)
    MOE_CHECK(c.compress_ratios[i] <= kMaxConfigSize,
              "{}: field 'compress_ratios[{}]' must be at most {}, got {}", source, i,
              kMaxConfigSize, c.compress_ratios[i]);
  const Counts<__int128> n = count_params_as<__int128>(c);
  MOE_CHECK(n.total + n.mtp <= kMaxConfigParams,
            "{}: the sizes give {:.3g} parameters, more than 2^56: not a model this engine can "
            "hold", source, static_cast<double>(n.total + n.mtp));
}

}  // namespace

ParamCounts count_params(const ModelConfig& c) {
  const Counts<int64_t> n = count_params_as<int64_t>(c);
  return {n.total, n.active_per_token, n.routed_expert, n.mtp};
}

namespace {

// The per-token work of one training step, split by how it is differentiated.
struct TokenWork {
  double matmul_weights = 0;  // weights of matmuls the backward differentiates (2 + 2 + 2 FLOPs)
  double attention = 0;       // forward FLOPs of scores and values (backward: 2x more)
  double forward_only = 0;    // FLOPs of parts with no gradient (V4's indexer)
};

TokenWork token_work_v3(const ModelConfig& c, int64_t seq) {
  const ParamCounts p = count_params(c);
  TokenWork w;
  // Active weights that take part in a matmul: not the embedding row, not the norm vectors.
  w.matmul_weights = static_cast<double>(p.active_per_token - 2 * c.hidden_size);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    w.matmul_weights -= static_cast<double>(2 * c.hidden_size + c.kv_lora_rank +
                                            (c.q_lora_rank > 0 ? c.q_lora_rank : 0));
  // Causal attention: on average a token attends to (seq + 1) / 2 keys.
  const double keys = static_cast<double>(seq + 1) / 2.0;
  w.attention = 2.0 * static_cast<double>(c.num_attention_heads) * keys *
                static_cast<double>(c.qk_head_dim() + c.v_head_dim) *
                static_cast<double>(c.num_hidden_layers);
  return w;
}

// DeepSeek-V4 (SPEC §6), counted from its parts: every block's projections, mHC mixes, router
// and experts (top-k routed), the head, and the MTP block with its own pass through the head.
// Attention keys per query, averaged over the positions of a sequence: the sliding window's,
// plus the compressed entries a query sees (CSA: at most index_topk picks; HCA: every complete
// block). The indexer scores every visible CSA entry, forward only.
TokenWork token_work_v4(const ModelConfig& c, int64_t seq) {
  const double D = static_cast<double>(c.hidden_size), n = static_cast<double>(c.hc_mult);
  const double H = static_cast<double>(c.num_attention_heads), d = static_cast<double>(c.head_dim);
  const double ql = static_cast<double>(c.q_lora_rank);
  const double go = static_cast<double>(c.o_groups * c.o_lora_rank);
  const double expert = 3.0 * D * static_cast<double>(c.moe_intermediate_size);
  const double mix = (2.0 + n) * n * n * D;  // one hc site's mixing projection
  auto mean_over_positions = [&](auto keys_at) {
    double sum = 0;
    for (int64_t t = 0; t < seq; ++t) sum += keys_at(t);
    return seq > 0 ? sum / static_cast<double>(seq) : 0.0;
  };
  TokenWork w;
  auto block = [&](int64_t layer) {
    const int64_t ratio = c.compress_ratio(layer);
    w.matmul_weights += 2 * mix + ql * D + H * d * ql + d * D + go * (H * d / c.o_groups) + D * go;
    w.matmul_weights += static_cast<double>(c.n_routed_experts) * D +
                        static_cast<double>(c.n_shared_experts + c.num_experts_per_tok) * expert;
    double keys = mean_over_positions(
        [&](int64_t t) { return static_cast<double>(std::min<int64_t>(t + 1, c.sliding_window)); });
    if (ratio > 0) {
      w.matmul_weights += 2.0 * (ratio == 4 ? 2 : 1) * d * D;  // compressor wkv, wgate
      const auto entries = [&](int64_t t) { return static_cast<double>((t + 1) / ratio); };
      if (ratio == 4) {
        const double hi = static_cast<double>(c.index_n_heads);
        const double di = static_cast<double>(c.index_head_dim);
        keys += mean_over_positions([&](int64_t t) {
          return std::min(entries(t), static_cast<double>(c.index_topk));
        });
        w.forward_only += 2.0 * (hi * di * ql + hi * D + 2.0 * 2.0 * di * D);
        w.forward_only += 2.0 * hi * di * mean_over_positions(entries);
      } else {
        keys += mean_over_positions(entries);
      }
    }
    w.attention += 2.0 * H * keys * 2.0 * d;  // scores and values over the shared KV
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) block(l);
  const double head = static_cast<double>(c.vocab_size) * D + n * n * D;  // head + hc_head mix
  w.matmul_weights += head;
  for (int64_t k = 0; k < c.num_nextn_predict_layers; ++k) {
    block(c.num_hidden_layers + k);
    w.matmul_weights += 2.0 * D * D + head;  // e_proj, h_proj, its pass through the head
  }
  return w;
}

TokenWork token_work(const ModelConfig& c, int64_t seq) {
  return c.is_v4() ? token_work_v4(c, seq) : token_work_v3(c, seq);
}

}  // namespace

double train_flops_per_token(const ModelConfig& c, int64_t seq) {
  const TokenWork w = token_work(c, seq);
  return 3.0 * (2.0 * w.matmul_weights + w.attention) + w.forward_only;
}

double finetune_flops_per_token(const ModelConfig& c, int64_t seq, double adapter_weights_active) {
  // A frozen base computes no weight gradients: forward and input gradient of every matmul
  // (2 + 2 FLOPs per weight) instead of 6; attention is differentiated in full; each active
  // adapter weight costs 6 as in training.
  const TokenWork w = token_work(c, seq);
  return train_flops_per_token(c, seq) - 2.0 * w.matmul_weights + 6.0 * adapter_weights_active;
}

}  // namespace moe
