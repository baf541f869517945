#include "model/model.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/activations.h"
#include "moe/mxfp4_expert_weights.h"

namespace moe {

// ---------------------------------------------------------------- Block

Block::Block(const ModelConfig& cfg, int64_t layer, Dispatcher& dispatcher) {
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  input_norm.init(prefix + "input_layernorm.weight", cfg.hidden_size, cfg.rms_norm_eps);
  post_attention_norm.init(prefix + "post_attention_layernorm.weight", cfg.hidden_size,
                           cfg.rms_norm_eps);
  attention.init(prefix + "self_attn.", cfg);
  if (cfg.is_moe_layer(layer)) {
    moe = std::make_unique<MoELayer>();
    moe->init(prefix + "mlp.", cfg, dispatcher);
  } else {
    mlp = std::make_unique<SwiGLU>();
    mlp->init(prefix + "mlp.", cfg.hidden_size, cfg.intermediate_size);
  }
}

void Block::collect(ParamList& out) {
  input_norm.collect(out);
  attention.collect(out);
  post_attention_norm.collect(out);
  if (mlp) mlp->collect(out);
  if (moe) moe->collect(out);
}

bool Block::has_saved() const {
  return input_norm.has_saved() || post_attention_norm.has_saved() || attention.has_saved() ||
         (mlp && mlp->has_saved()) || (moe && moe->has_saved());
}

Tensor Block::forward(const Tensor& x, const BatchShape& shape, Pass pass) {
  // Residual sums are formed in the sub-layer's fresh output; x itself stays intact because
  // the norm saved it for backward. The norms' outputs are not kept for backward by the
  // sub-layers (SaveInput::No): backward rebuilds them from what the norms saved.
  Tensor h = attention.forward(input_norm.forward(x, pass), shape, pass, SaveInput::No);
  add_inplace(h.f32(), x.f32(), h.numel());
  Tensor normed = post_attention_norm.forward(h, pass);
  Tensor out = mlp ? mlp->forward(normed, pass, SaveInput::No)
                   : moe->forward(normed, shape, pass, SaveInput::No);
  normed.reset();
  add_inplace(out.f32(), h.f32(), out.numel());
  return out;
}

Tensor Block::backward(const Tensor& dy, float aux_grad_scale) {
  // Each norm's output, rebuilt bitwise from its saved input (one elementwise pass), lives only
  // while the sub-layer it feeds runs its backward.
  Tensor d_ffn;
  {
    const Tensor normed = post_attention_norm.recompute_output();
    d_ffn = mlp ? mlp->backward(dy, normed) : moe->backward(dy, normed, aux_grad_scale);
  }
  Tensor dh = post_attention_norm.backward(d_ffn);
  d_ffn.reset();
  add_inplace(dh.f32(), dy.f32(), dh.numel());
  Tensor d_attn;
  {
    const Tensor normed = input_norm.recompute_output();
    d_attn = attention.backward(dh, normed);
  }
  Tensor dx = input_norm.backward(d_attn);
  d_attn.reset();
  add_inplace(dx.f32(), dh.f32(), dx.numel());
  return dx;
}

Tensor Block::forward_cached(const Tensor& x, std::span<const CachedChunk> chunks,
                            const LatentCacheLayer& cache) {
  const Pass pass = Pass::Inference;
  Tensor h = attention.forward_cached(input_norm.forward(x, pass), chunks, cache);
  add_inplace(h.f32(), x.f32(), h.numel());
  Tensor normed = post_attention_norm.forward(h, pass);
  Tensor out = mlp ? mlp->forward(normed, pass)
                   : moe->forward(normed, BatchShape{1, normed.dim(0)}, pass);
  normed.reset();
  add_inplace(out.f32(), h.f32(), out.numel());
  return out;
}

// ---------------------------------------------------------------- DeepSeekModel

DeepSeekModel::DeepSeekModel(const ModelConfig& cfg, std::shared_ptr<Dispatcher> dispatcher)
    : cfg_(cfg), dispatcher_(std::move(dispatcher)) {
  // V4 shares the config struct but not the architecture (model/v4/v4_model.h).
  MOE_CHECK(!cfg_.is_v4(), "model config: model_type \"deepseek_v4\" is not supported here yet "
            "(DeepSeek-V4 runs in DeepSeekV4Model; only deepseek_v2 / deepseek_v3 models train, "
            "fine-tune and generate)");
  cfg_.validate("model config");
  if (!dispatcher_) dispatcher_ = std::make_shared<LocalDispatcher>();
  embed_.init("model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size);
  // The RoPE table depends only on the config: one for every layer, grown on first use.
  auto rope = std::make_shared<RopeTable>(cfg_, 0);
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    blocks_.push_back(std::make_unique<Block>(cfg_, l, *dispatcher_));
    blocks_.back()->attention.share_rope(rope);
  }
  final_norm_.init("model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps);
  head_.init("lm_head.weight", cfg.hidden_size, cfg.vocab_size);
  embed_.collect(params_);
  for (auto& b : blocks_) b->collect(params_);
  final_norm_.collect(params_);
  head_.collect(params_);
  for (MoELayer* m : moe_layers()) m->set_lora_runtime(lora_runtime_.get());
}

ParamList DeepSeekModel::trainable_params() const {
  ParamList out;
  for (Param* p : params_)
    if (p->trainable) out.push_back(p);
  for (Param* p : lora_params_) out.push_back(p);
  return out;
}

void DeepSeekModel::freeze_base() {
  for (Param* p : params_) p->trainable = false;
  for (MoELayer* m : moe_layers())
    if (m->dense_experts()) m->dense_experts()->freeze();
}

namespace {

// Attaches an adapter to `linear` when the matcher selects its module.
void maybe_adapt(Linear& linear, LoraTargetMatcher& match, const LoraSettings& s,
                 const LoraRuntime* rt, uint64_t seed, ParamList& out) {
  const std::string module = linear.module_name();
  if (!match.matches(module)) return;
  linear.lora = std::make_unique<LoraAdapter>();
  linear.lora->init(module, linear.in, linear.out, s.shape_for(false), rt);
  linear.lora->init_weights(seed);
  linear.lora->collect(out);
}

// All routed experts of a layer share one grouped adapter per projection, so a target must
// select every expert's projection or none. Every rank asks about all E experts, so expert
// parallelism sees the same decision everywhere.
void maybe_adapt_experts(MoELayer& m, const std::string& prefix, const std::string& proj,
                         int64_t num_experts, LoraTargetMatcher& match, const LoraSettings& s,
                         const LoraRuntime* rt, uint64_t seed, ParamList& out,
                         const std::string& section) {
  int64_t hits = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    hits += match.matches(prefix + "experts." + std::to_string(e) + "." + proj);
  if (hits == 0) return;
  MOE_CHECK(hits == num_experts,
            "{}: the targets select {} of the {} routed experts' {} in {}experts.*; routed "
            "experts are adapted all together (one grouped adapter per layer): select all or none",
            section, hits, num_experts, proj, prefix);
  ExpertWeights& x = m.experts();
  const bool down = proj == "down_proj";
  auto a = std::make_unique<GroupedLoraAdapter>();
  a->init(prefix, proj, x.experts(), down ? x.hidden() : x.dim(), down ? x.dim() : x.hidden(),
          s.shape_for(true), rt);
  a->init_weights(seed);
  a->collect(out);
  MoELayer::ExpertLora& l = m.expert_lora();
  (proj == "gate_proj" ? l.gate : proj == "up_proj" ? l.up : l.down) = std::move(a);
}

}  // namespace

const ParamList& DeepSeekModel::add_lora(const LoraSettings& s, uint64_t seed,
                                         const std::string& section) {
  MOE_CHECK(lora_params_.empty(), "{}: the model already has LoRA adapters", section);
  s.validate(section);
  LoraTargetMatcher match(s);
  const LoraRuntime* rt = lora_runtime_.get();
  ParamList& out = lora_params_;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    Block& b = *blocks_[l];
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    MLAttention& a = b.attention;
    if (a.q_lora_rank > 0) {
      maybe_adapt(a.q_a_proj, match, s, rt, seed, out);
      maybe_adapt(a.q_b_proj, match, s, rt, seed, out);
    } else {
      maybe_adapt(a.q_proj, match, s, rt, seed, out);
    }
    const std::string kv_a = prefix + "self_attn.kv_a_proj_with_mqa";
    if (match.matches(kv_a)) {
      a.kv_a_lora = std::make_unique<LoraAdapter>();
      a.kv_a_lora->init(kv_a, a.hidden, a.kv_lora_rank + a.rope_dim, s.shape_for(false), rt);
      a.kv_a_lora->init_weights(seed);
      a.kv_a_lora->collect(out);
    }
    maybe_adapt(a.kv_b_proj, match, s, rt, seed, out);
    maybe_adapt(a.o_proj, match, s, rt, seed, out);
    SwiGLU* mlp = b.mlp ? b.mlp.get() : b.moe->shared_experts();
    if (mlp)
      for (Linear* lin : {&mlp->gate, &mlp->up, &mlp->down})
        maybe_adapt(*lin, match, s, rt, seed, out);
    if (b.moe)
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
        maybe_adapt_experts(*b.moe, prefix + "mlp.", proj, cfg_.n_routed_experts, match, s, rt,
                            seed, out, section);
  }
  match.check_all_used(section);
  return lora_params_;
}

void DeepSeekModel::drop_lora() {
  for (auto& b : blocks_) {
    MLAttention& a = b->attention;
    for (Linear* lin : {&a.q_proj, &a.q_a_proj, &a.q_b_proj, &a.kv_b_proj, &a.o_proj})
      lin->lora.reset();
    a.kv_a_lora.reset();
    SwiGLU* mlp = b->mlp ? b->mlp.get() : b->moe->shared_experts();
    if (mlp)
      for (Linear* lin : {&mlp->gate, &mlp->up, &mlp->down}) lin->lora.reset();
    if (b->moe) {
      MoELayer::ExpertLora& l = b->moe->expert_lora();
      l.gate.reset(), l.up.reset(), l.down.reset();
    }
  }
  lora_params_.clear();
}

void DeepSeekModel::init_weights(uint64_t seed) {
  // Residual-branch outputs are scaled down with depth (GPT-2 style) so the stream's variance
  // stays bounded at initialisation.
  const float std_dev = 0.02f;
  const float out_std = std_dev / std::sqrt(2.0f * static_cast<float>(cfg_.num_hidden_layers));
  auto ends_with = [](const std::string& s, const char* suffix) {
    const std::string suf(suffix);
    return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    if (p->format == ParamFormat::Mxfp4Scales) continue;  // written with its data, below
    const bool residual_out = ends_with(p->name, "o_proj.weight") || ends_with(p->name, "down_proj.weight");
    const float s = residual_out ? out_std : std_dev;
    if (p->format == ParamFormat::Mxfp4Data) {
      // The values an fp32 model draws for the same name, quantized row by row: a packed
      // model is exactly the quantized fp32 one, and no fp32 matrix exists on the way.
      Rng rng(seed ^ fnv1a(p->name.c_str()));
      quantize_rows_into(*p, mxfp4_scales_of(i), [&](int64_t, float* row) {
        for (int64_t j = 0; j < 2 * p->value.dim(1); ++j) row[j] = s * rng.normal();
      });
      continue;
    }
    float* w = p->w();
    const int64_t n = p->value.numel();
    if (ends_with(p->name, "norm.weight") || ends_with(p->name, "layernorm.weight")) {
      std::fill(w, w + n, 1.0f);
      continue;
    }
    if (ends_with(p->name, "e_score_correction_bias")) {
      std::fill(w, w + n, 0.0f);
      continue;
    }
    Rng rng(seed ^ fnv1a(p->name.c_str()));
    for (int64_t j = 0; j < n; ++j) w[j] = s * rng.normal();
  }
}

const Param& DeepSeekModel::mxfp4_scales_of(size_t data_index) const {
  return mxfp4_scales_after(params_, data_index);
}

void DeepSeekModel::allocate_grads() {
  for (MoELayer* m : moe_layers()) m->allocate_grads();
  for (Param* p : params_)
    if (p->trainable) p->allocate_grad();
  for (Param* p : lora_params_) p->allocate_grad();
}

void DeepSeekModel::zero_grads() {
  moe::zero_grads(params_);
  moe::zero_grads(lora_params_);
}

std::vector<MoELayer*> DeepSeekModel::moe_layers() const {
  std::vector<MoELayer*> out;
  for (auto& b : blocks_)
    if (b->moe) out.push_back(b->moe.get());
  return out;
}

Tensor DeepSeekModel::hidden_states(const Tensor& tokens, const BatchShape& shape, Pass pass) {
  MOE_CHECK(tokens.numel() == shape.tokens(), "expected {} tokens (batch {} x seq {}), got {}",
            shape.tokens(), shape.batch, shape.seq, tokens.numel());
  Tensor x = embed_.forward(tokens, pass);
  for (auto& b : blocks_) x = b->forward(x, shape, pass);
  return final_norm_.forward(x, pass);
}

LossResult DeepSeekModel::forward(const Tensor& tokens, const Tensor& targets,
                                  const BatchShape& shape, Pass pass, const LossOptions& options) {
  lora_runtime_->dropout_active = needs_backward(pass);
  Tensor h = hidden_states(tokens, shape, pass);
  LossResult r = head_.forward(h, targets, pass, options.z_loss, options.grad_scale);
  if (needs_backward(pass))
    for (MoELayer* m : moe_layers()) r.aux += m->aux_loss();
  last_aux_grad_scale_ = options.aux_grad_scale.value_or(options.grad_scale);
  return r;
}

void DeepSeekModel::backward() {
  Tensor dx = final_norm_.backward(head_.backward());
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
    dx = (*it)->backward(dx, last_aux_grad_scale_);
  embed_.backward(dx);
}

Tensor DeepSeekModel::logits(const Tensor& tokens, const BatchShape& shape) {
  lora_runtime_->dropout_active = false;
  return head_.logits(hidden_states(tokens, shape, Pass::Inference));
}

std::unique_ptr<InferenceCache> DeepSeekModel::make_cache(int64_t slots, int64_t max_len) const {
  return std::make_unique<LatentKvCache>(cfg_, slots, max_len);
}

Tensor DeepSeekModel::forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                                     InferenceCache& cache, bool all_rows) {
  const auto* latent = dynamic_cast<const LatentKvCache*>(&cache);
  MOE_CHECK(latent != nullptr, "cached forward: the cache was not made by a {} model",
            cfg_.model_type);
  return forward_cached(tokens, chunks, latent->layers(), all_rows);
}

Tensor DeepSeekModel::forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                                     std::span<const LatentCacheLayer> cache, bool all_rows) {
  MOE_CHECK(static_cast<int64_t>(cache.size()) == cfg_.num_hidden_layers,
            "cached forward: {} cache layers for {} model layers", cache.size(),
            cfg_.num_hidden_layers);
  lora_runtime_->dropout_active = false;
  Tensor x = embed_.forward(tokens, Pass::Inference);
  for (size_t l = 0; l < blocks_.size(); ++l) x = blocks_[l]->forward_cached(x, chunks, cache[l]);
  // Only the rows that predict a next token go through the final norm and the head.
  if (!all_rows) x = last_rows_of_chunks(x, chunks);
  return head_.logits(final_norm_.forward(x, Pass::Inference));
}

void DeepSeekModel::reserve_positions(int64_t positions) {
  if (!blocks_.empty()) blocks_.front()->attention.rope()->ensure(positions);
}

void DeepSeekModel::update_router_biases(double rate) {
  for (MoELayer* m : moe_layers()) m->update_bias(rate);
}

bool DeepSeekModel::has_saved() const {
  if (embed_.has_saved() || final_norm_.has_saved() || head_.has_saved()) return true;
  for (auto& b : blocks_)
    if (b->has_saved()) return true;
  return false;
}

}  // namespace moe
