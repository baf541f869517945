#pragma once
// DeepSeek-V2/V3/V4 hyper-parameters, named after the Hugging Face config.json fields.
#include <cstdint>
#include <string>
#include <vector>

namespace moe {

// Sizes from config.json multiply into parameter counts, FLOPs, memory plans and tensor shapes.
// Each is bounded far above any release (DeepSeek-V3: vocabulary 129,280, 61 layers) so that a
// product of a few fits in 128 bits; the model's total then bounds every product inside 64.
inline constexpr int64_t kMaxConfigSize = int64_t{1} << 24;
inline constexpr int64_t kMaxConfigLayers = int64_t{1} << 12;

struct RopeScaling {
  std::string type;  // "" (none) or "yarn"
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  bool is_yarn() const { return type == "yarn"; }
};

struct ModelConfig {
  std::string model_type = "deepseek_v3";  // or "deepseek_v2", "deepseek_v4"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;       // dense FFN width
  int64_t moe_intermediate_size = 0;   // per routed expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  int64_t n_routed_experts = 0;        // 0 = dense model
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  std::string topk_method = "noaux_tc";  // noaux_tc | group_limited_greedy | greedy
  std::string scoring_func = "sigmoid";  // sigmoid | softmax | sqrtsoftplus (DeepSeek-V4)
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  double aux_loss_alpha = 0.0;          // sequence-wise auxiliary loss coefficient (0 = off)
  bool seq_aux = true;
  // DeepSeek-V4's clamped SwiGLU in the routed and shared experts: gate = min(g, limit),
  // up = clamp(u, -limit, limit). 0 = no clamp (V2/V3).
  double swiglu_limit = 0.0;
  int64_t q_lora_rank = 0;              // 0 = a single q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 4096;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  std::string torch_dtype = "float32";  // dtype used when saving: float32 | bfloat16
  // Routed experts: "fp32" (trainable) or "mxfp4" (frozen, packed; config.json
  // quantization_config.quant_method = "mxfp4").
  std::string expert_format = "fp32";
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;

  // DeepSeek-V4 (model_type "deepseek_v4", SPEC §6; model/v4/v4_model.h). Zero / empty for V2/V3,
  // whose MLA fields (kv_lora_rank, qk_nope_head_dim, v_head_dim) and dense FFN
  // (intermediate_size, first_k_dense_replace) V4 leaves at zero in turn. V4 shares
  // q_lora_rank, qk_rope_head_dim (the rotated tail of every head), the MoE fields,
  // swiglu_limit, rope_theta (sliding-window layers) and rope_scaling (YaRN of the compressed
  // layers, always on, no mscale).
  int64_t head_dim = 0;        // q, key and value width of the single shared KV head
  int64_t o_groups = 0;        // grouped output projection: groups ...
  int64_t o_lora_rank = 0;     // ... and each group's rank
  int64_t sliding_window = 0;  // keys of a query: the last sliding_window positions, itself included
  // One entry per layer, then one per MTP layer (the released config has num_hidden_layers + 1):
  // 0 sliding window only, 4 CSA (overlapping windows + the lightning indexer), any other HCA.
  // Entries beyond num_hidden_layers + num_nextn_predict_layers are kept but unused.
  std::vector<int64_t> compress_ratios;
  double compress_rope_theta = 0.0;  // RoPE base of the compressed layers
  int64_t index_n_heads = 0;         // the lightning indexer (CSA layers)
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  int64_t num_hash_layers = 0;           // the first layers route by gate.tid2eid[token]
  int64_t num_nextn_predict_layers = 0;  // MTP depth (0 or 1)
  int64_t hc_mult = 0;                   // hyper-connection streams
  int64_t hc_sinkhorn_iters = 0;
  double hc_eps = 0.0;
  // DeepSeek-V4's simulated low precision (kernels/quant_sim.h), config.json
  // "quantization_simulation", written only when not "none":
  //   "none" (default)  none, as Hugging Face transformers and NeMo Automodel compute V4;
  //   "reference"       what DeepSeek's reference inference forward (and its quantization-aware
  //                     training) does: the attention's shared KV and the main compressor's
  //                     entries FP8-E4M3 quantize-dequantized on their non-RoPE features (blocks
  //                     of 64, power-of-two scales), the lightning indexer's queries and keys
  //                     Hadamard-rotated and FP4-E2M1 quantize-dequantized (blocks of 32).
  //                     The backward passes the KV's quantization as identity (straight-through);
  //                     the indexer has no gradient.
  std::string quantization_simulation = "none";

  bool is_v4() const { return model_type == "deepseek_v4"; }
  bool simulates_reference_quantization() const { return quantization_simulation == "reference"; }
  // V4: the compress ratio of layer `layer` (num_hidden_layers + d is MTP depth d).
  int64_t compress_ratio(int64_t layer) const {
    return compress_ratios.at(static_cast<size_t>(layer));
  }

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool mxfp4_experts() const { return expert_format == "mxfp4"; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // Raises moe::Error naming the first inconsistent field.
  void validate(const std::string& source) const;

 private:
  void validate_v4(const std::string& source) const;
};

struct ParamCounts {
  int64_t total = 0;
  int64_t active_per_token = 0;  // embedding row + everything but the unchosen routed experts
  int64_t routed_expert = 0;     // all routed expert weights
  // DeepSeek-V4: the MTP layers' parameters (routed experts included), which `total` leaves out
  // as the released figures do (284B total / 13B active for V4-Flash); 0 for V2/V3, whose MTP
  // layers this engine does not build. V4's hash tables (gate.tid2eid) are integer buffers and
  // counted nowhere.
  int64_t mtp = 0;
};

ParamCounts count_params(const ModelConfig& c);

// Matmul FLOPs of one training step (forward + backward = 3x forward) per token at sequence
// length `seq`: 6 x active matmul weights, plus causal attention scores and values (V4: over
// its window and compressed entries, MTP included, the indexer forward only). Norms,
// activations and the optimizer are not counted (the usual MFU convention).
double train_flops_per_token(const ModelConfig& c, int64_t seq);
// The same for LoRA fine-tuning of a frozen base with `adapter_weights_active` adapter weights
// used per token (every dense adapter, top-k of the routed experts' ones).
double finetune_flops_per_token(const ModelConfig& c, int64_t seq, double adapter_weights_active);

}  // namespace moe
