#include "model/v4/v4_model.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "kernels/activations.h"

namespace moe {

namespace {

bool ends_with(const std::string& s, std::string_view suffix) { return s.ends_with(suffix); }

}  // namespace

Tensor shift_left(const Tensor& v, const BatchShape& shape, int32_t fill) {
  MOE_CHECK(v.dtype() == DType::I32 && v.numel() == shape.tokens(),
            "shift_left: expected I32 [{} x {}], got {}", shape.batch, shape.seq,
            shape_str(v.shape()));
  Tensor out = Tensor::empty({shape.tokens()}, DType::I32, MemCategory::Activations);
  const int32_t* src = v.i32();
  int32_t* dst = out.i32();
  for (int64_t b = 0; b < shape.batch; ++b)
    for (int64_t s = 0; s < shape.seq; ++s)
      dst[b * shape.seq + s] = s + 1 < shape.seq ? src[b * shape.seq + s + 1] : fill;
  return out;
}

// ---------------------------------------------------------------- RoPE flavours

RopeParams V4RopeTables::window_params(const ModelConfig& cfg) {
  // REF: "disable YaRN and use base rope_theta in pure sliding-window attention".
  return RopeParams{.dim = cfg.qk_rope_head_dim, .theta = cfg.rope_theta};
}

RopeParams V4RopeTables::compressed_params(const ModelConfig& cfg) {
  RopeParams p{.dim = cfg.qk_rope_head_dim, .theta = cfg.compress_rope_theta};
  if (cfg.rope_scaling.is_yarn()) {
    p.yarn = true;
    p.yarn_factor = cfg.rope_scaling.factor;
    p.yarn_original_max_position = cfg.rope_scaling.original_max_position_embeddings;
    p.beta_fast = cfg.rope_scaling.beta_fast;
    p.beta_slow = cfg.rope_scaling.beta_slow;
    p.yarn_always = true;  // V4 blends whenever original_seq_len > 0, whatever the length
  }
  p.mscale = 1.0;  // HF forces attention_factor 1.0: no YaRN temperature in V4
  return p;
}

// ---------------------------------------------------------------- V4Block

V4Block::V4Block(const ModelConfig& cfg, int64_t layer, const std::string& prefix,
                 Dispatcher& dispatcher, const V4RopeTables& ropes) {
  ratio = cfg.compress_ratio(layer);
  const int64_t D = cfg.hidden_size, n = cfg.hc_mult;
  hc_attn.init(prefix + "hc_attn", n, D, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters);
  hc_ffn.init(prefix + "hc_ffn", n, D, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters);
  attn_norm.init(prefix + "attn_norm.weight", D, cfg.rms_norm_eps);
  ffn_norm.init(prefix + "ffn_norm.weight", D, cfg.rms_norm_eps);
  // quantization_simulation "reference": FP8 on the KV and the main entries, Hadamard + FP4 in
  // the indexer, at DeepSeek's reference's sites (model/v4/simulated_precision.h).
  const bool reference = cfg.simulates_reference_quantization();
  const SimulatedPrecision kv_precision =
      reference ? SimulatedPrecision::Fp8NonRope : SimulatedPrecision::None;
  const V4AttentionDims dims{.hidden = D,
                             .heads = cfg.num_attention_heads,
                             .head_dim = cfg.head_dim,
                             .rope_dim = cfg.qk_rope_head_dim,
                             .q_lora_rank = cfg.q_lora_rank,
                             .o_groups = cfg.o_groups,
                             .o_lora_rank = cfg.o_lora_rank,
                             .window = cfg.sliding_window,
                             .eps = cfg.rms_norm_eps,
                             .kv_precision = kv_precision};
  const std::shared_ptr<RopeTable>& rope = ratio > 0 ? ropes.compressed : ropes.window;
  attn.init(prefix + "attn.", dims,
            ratio > 0 ? V4RopeTables::compressed_params(cfg) : V4RopeTables::window_params(cfg));
  attn.share_rope(rope);
  if (ratio > 0) {
    compressor = std::make_unique<V4Compressor>();
    compressor->init(prefix + "attn.compressor.", {.dim = D,
                                                   .head_dim = cfg.head_dim,
                                                   .rope_dim = cfg.qk_rope_head_dim,
                                                   .ratio = ratio,
                                                   .eps = cfg.rms_norm_eps,
                                                   .entry_precision = kv_precision});
    compressor->share_rope(rope);
  }
  if (ratio == 4) {
    indexer = std::make_unique<V4Indexer>();
    indexer->init(prefix + "attn.indexer.", {.dim = D,
                                             .q_lora = cfg.q_lora_rank,
                                             .n_heads = cfg.index_n_heads,
                                             .head_dim = cfg.index_head_dim,
                                             .rope_dim = cfg.qk_rope_head_dim,
                                             .topk = cfg.index_topk,
                                             .ratio = ratio,
                                             .eps = cfg.rms_norm_eps,
                                             .qk_precision = reference
                                                                 ? SimulatedPrecision::HadamardFp4
                                                                 : SimulatedPrecision::None});
    indexer->share_rope(rope);
  }
  ffn.init(prefix + "ffn.", cfg, dispatcher,
           layer < cfg.num_hash_layers ? ExpertSelection::Hash : ExpertSelection::TopK,
           FfnKeys::V4);
}

void V4Block::collect(ParamList& out) {
  hc_attn.collect(out);
  attn_norm.collect(out);
  attn.collect(out);
  if (compressor) compressor->collect(out);
  if (indexer) indexer->collect(out);
  hc_ffn.collect(out);
  ffn_norm.collect(out);
  ffn.collect(out);
}

bool V4Block::has_saved() const {
  return hc_attn.has_saved() || hc_ffn.has_saved() || attn_norm.has_saved() ||
         ffn_norm.has_saved() || attn.has_saved() || (compressor && compressor->has_saved()) ||
         ffn.has_saved();
}

Tensor V4Block::forward(const Tensor& X, const Tensor& token_ids, const BatchShape& shape,
                        Pass pass) {
  // The norms' outputs are not kept by the layers they feed (SaveInput::No): backward rebuilds
  // them bitwise from what the norms saved, as the V3 block does.
  Tensor a;
  {
    Tensor x = attn_norm.forward(hc_attn.pre(X, pass), pass);
    Tensor qr = attn.query_residual(x, pass, SaveInput::No);
    CompressedKv ckv;
    if (compressor) {
      ckv = compressor->forward(x, shape, pass, SaveInput::No);
      // The indexer reads the same qr as the attention and keeps nothing (integer picks).
      if (indexer) ckv.picked = indexer->forward(x, qr, shape);
    }
    a = attn.forward(x, shape, pass, ckv, qr, SaveInput::No);
  }
  Tensor X1 = hc_attn.post(a, X);
  a.reset();
  Tensor f;
  {
    Tensor x = ffn_norm.forward(hc_ffn.pre(X1, pass), pass);
    f = ffn.forward(x, token_ids, shape, pass, SaveInput::No);
  }
  Tensor X2 = hc_ffn.post(f, X1);
  if (needs_backward(pass)) saved_shape_ = shape;
  return X2;
}

Tensor V4Block::backward(const Tensor& dX2, float aux_grad_scale) {
  Tensor du;
  {
    Tensor d_f = hc_ffn.backward_post(dX2);
    Tensor d_x;
    {
      const Tensor x = ffn_norm.recompute_output();
      d_x = ffn.backward(d_f, x, aux_grad_scale);
    }
    d_f.reset();
    du = ffn_norm.backward(d_x);
  }
  Tensor dX1 = hc_ffn.backward_pre(du);
  du.reset();
  Tensor d_a = hc_attn.backward_post(dX1);
  dX1.reset();
  Tensor d_x;
  {
    const Tensor x = attn_norm.recompute_output();
    // The entries' gradient (key and value side) is summed by the attention into a zeroed
    // buffer, then taken through the compressor, which adds its input gradient to d_x.
    Tensor d_entries;
    if (compressor)
      d_entries = Tensor::zeros({saved_shape_.batch, compressor->windows(saved_shape_.seq),
                                 compressor->head_dim},
                                DType::F32, MemCategory::Activations);
    d_x = attn.backward(d_a, x, d_entries);
    d_a.reset();
    if (compressor) compressor->backward(d_entries, d_x, x);
  }
  du = attn_norm.backward(d_x);
  d_x.reset();
  return hc_attn.backward_pre(du);
}

// ---------------------------------------------------------------- DeepSeekV4Model

DeepSeekV4Model::DeepSeekV4Model(const ModelConfig& cfg, std::shared_ptr<Dispatcher> dispatcher)
    : cfg_(cfg), dispatcher_(std::move(dispatcher)) {
  MOE_CHECK(cfg_.is_v4(), "model config: DeepSeekV4Model needs model_type \"deepseek_v4\", got "
            "\"{}\"", cfg_.model_type);
  cfg_.validate("model config");
  if (!dispatcher_) dispatcher_ = std::make_shared<LocalDispatcher>();
  const int64_t D = cfg_.hidden_size, n = cfg_.hc_mult;
  ropes_.window = std::make_shared<RopeTable>(V4RopeTables::window_params(cfg_), 0);
  ropes_.compressed = std::make_shared<RopeTable>(V4RopeTables::compressed_params(cfg_), 0);
  embed_.init("embed.weight", cfg_.vocab_size, D);
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l)
    blocks_.push_back(std::make_unique<V4Block>(cfg_, l, "layers." + std::to_string(l) + ".",
                                                *dispatcher_, ropes_));
  hc_head_.init("hc_head", n, D, cfg_.rms_norm_eps, cfg_.hc_eps);
  norm_.init("norm.weight", D, cfg_.rms_norm_eps);
  head_.init("head.weight", D, cfg_.vocab_size);
  if (cfg_.num_nextn_predict_layers > 0) {
    mtp_ = std::make_unique<Mtp>();
    const std::string p = "mtp.0.";
    mtp_->enorm.init(p + "enorm.weight", D, cfg_.rms_norm_eps);
    mtp_->hnorm.init(p + "hnorm.weight", D, cfg_.rms_norm_eps);
    mtp_->e_proj.init(p + "e_proj.weight", D, D);
    mtp_->h_proj.init(p + "h_proj.weight", D, D);
    mtp_->block = std::make_unique<V4Block>(cfg_, cfg_.num_hidden_layers, p, *dispatcher_, ropes_);
    mtp_->hc_head.init(p + "hc_head", n, D, cfg_.rms_norm_eps, cfg_.hc_eps);
    mtp_->norm.init(p + "norm.weight", D, cfg_.rms_norm_eps);
    // Not a parameter of its own: a view of embed.weight (see Mtp), so no init() (which would
    // allocate a second table).
    mtp_->embed.vocab = cfg_.vocab_size;
    mtp_->embed.dim = D;
    mtp_->embed.weight.name = embed_.weight.name;
    mtp_->embed.weight.value = embed_.weight.value;
  }

  embed_.collect(params_);
  for (auto& b : blocks_) b->collect(params_);
  hc_head_.collect(params_);
  norm_.collect(params_);
  head_.collect(params_);
  if (mtp_) {
    mtp_->enorm.collect(params_);
    mtp_->hnorm.collect(params_);
    mtp_->e_proj.collect(params_);
    mtp_->h_proj.collect(params_);
    mtp_->block->collect(params_);
    mtp_->hc_head.collect(params_);
    mtp_->norm.collect(params_);
  }
  for (MoELayer* m : moe_layers()) m->set_lora_runtime(lora_runtime_.get());
}

ParamList DeepSeekV4Model::trainable_params() const {
  ParamList out;
  for (Param* p : params_)
    if (p->trainable) out.push_back(p);
  for (Param* p : lora_params_) out.push_back(p);
  return out;
}

void DeepSeekV4Model::freeze_base() {
  for (Param* p : params_) p->trainable = false;
  for (MoELayer* m : moe_layers())
    if (m->dense_experts()) m->dense_experts()->freeze();
}

std::vector<MoELayer*> DeepSeekV4Model::moe_layers() const {
  std::vector<MoELayer*> out;
  for (auto& b : blocks_) out.push_back(&b->ffn);
  if (mtp_) out.push_back(&mtp_->block->ffn);
  return out;
}

void DeepSeekV4Model::update_router_biases(double rate) {
  for (MoELayer* m : moe_layers()) m->update_bias(rate);
}

void DeepSeekV4Model::reserve_positions(int64_t positions) {
  ropes_.window->ensure(positions);
  ropes_.compressed->ensure(positions);
}

// Initialisation, per kind of tensor (every draw from the stream keyed by (seed, name), so a
// tensor's values do not depend on the others or on the thread count):
//  * linears, embedding, head, compressor projections, frozen indexer weights: N(0, 0.02²); the
//    residual branches' last projections (attn.wo_b, the experts' and shared experts' w2) use
//    0.02 / sqrt(2 · layers), as the V3 model does (GPT-2 style);
//  * norms 1; the router's gate.bias 0; the hash tables keep MoELayer's balanced table
//    (token v -> experts v, v+1, ... mod E);
//  * attn_sink 0 (one phantom key of score 0 per head), compressor ape 0 (plain softmax pooling
//    over a window's tokens at the start);
//  * mHC: scale 1 and base 0, so a site starts at pre = 1/2 (+ hc_eps), post = 1 (the sublayer's
//    output enters every stream as in a plain residual) and the uniform doubly-stochastic C
//    (each stream continues as the streams' mean); fn ~ N(0, σ²) with σ = 0.1 / sqrt(n·D): the
//    normalised input vec(X)·rsqrt(mean(vec(X)²)) has n·D entries of unit RMS, so each mix starts
//    at about ±0.1, a small perturbation of those coefficients. It is what makes the streams
//    differ at all: with fn = 0 every stream would get the same coefficients and, starting
//    equal (the embedding enters each), stay equal forever. The heads' hc_head_* likewise.
void DeepSeekV4Model::init_weights(uint64_t seed) {
  const float std_dev = 0.02f;
  const float out_std = std_dev / std::sqrt(2.0f * static_cast<float>(cfg_.num_hidden_layers));
  const float fn_std = 0.1f / std::sqrt(static_cast<float>(cfg_.hc_mult * cfg_.hidden_size));
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    if (p->format == ParamFormat::Mxfp4Scales || p->id_bound > 0) continue;
    const std::string& name = p->name;
    const bool residual_out = ends_with(name, "attn.wo_b.weight") || ends_with(name, "w2.weight");
    float s = residual_out ? out_std : std_dev;
    if (ends_with(name, "_fn")) s = fn_std;
    if (p->format == ParamFormat::Mxfp4Data) {
      // The values an fp32 model draws for the same name, quantized row by row (as V3 does).
      Rng rng(seed ^ fnv1a(name.c_str()));
      quantize_rows_into(*p, mxfp4_scales_of(i), [&](int64_t, float* row) {
        for (int64_t j = 0; j < 2 * p->value.dim(1); ++j) row[j] = s * rng.normal();
      });
      continue;
    }
    float* w = p->w();
    const int64_t n = p->value.numel();
    if (ends_with(name, "norm.weight") || ends_with(name, "_scale")) {
      std::fill(w, w + n, 1.0f);
      continue;
    }
    if (ends_with(name, "gate.bias") || ends_with(name, "_base") || ends_with(name, "attn_sink") ||
        ends_with(name, ".ape")) {
      std::fill(w, w + n, 0.0f);
      continue;
    }
    Rng rng(seed ^ fnv1a(name.c_str()));
    for (int64_t j = 0; j < n; ++j) w[j] = s * rng.normal();
  }
}

const Param& DeepSeekV4Model::mxfp4_scales_of(size_t data_index) const {
  return mxfp4_scales_after(params_, data_index);
}

void DeepSeekV4Model::allocate_grads() {
  for (MoELayer* m : moe_layers()) m->allocate_grads();
  for (Param* p : params_)
    if (p->trainable) p->allocate_grad();
  for (Param* p : lora_params_) p->allocate_grad();
}

void DeepSeekV4Model::zero_grads() {
  moe::zero_grads(params_);
  moe::zero_grads(lora_params_);
}

Tensor DeepSeekV4Model::streams(const Tensor& tokens, const BatchShape& shape, Pass pass) {
  MOE_CHECK(tokens.dtype() == DType::I32 && tokens.numel() == shape.tokens(),
            "expected {} I32 tokens (batch {} x seq {}), got {}", shape.tokens(), shape.batch,
            shape.seq, shape_str(tokens.shape()));
  Tensor X = expand_streams(embed_.forward(tokens, pass), cfg_.hc_mult);
  for (auto& b : blocks_) X = b->forward(X, tokens, shape, pass);
  return X;
}

Tensor DeepSeekV4Model::mtp_streams(const Tensor& X, const Tensor& ids, const BatchShape& shape,
                                    Pass pass) {
  Mtp& m = *mtp_;
  const int64_t T = shape.tokens(), n = cfg_.hc_mult, D = cfg_.hidden_size;
  // The embedding view follows whatever embed.weight holds now (a loader may have replaced it).
  m.embed.weight.value = embed_.weight.value;
  m.embed.weight.grad = embed_.weight.grad;
  // The projections keep nothing (Pass::Eval): backward rebuilds their inputs from the norms.
  Tensor e = m.e_proj.forward(m.enorm.forward(m.embed.forward(ids, pass), pass), Pass::Eval);
  Tensor Xin = m.h_proj.forward(m.hnorm.forward(X.view({T * n, D}), pass), Pass::Eval);
  {
    float* xp = Xin.f32();
    const float* ep = e.f32();
    parallel_for(0, T, [&](int64_t t) {
      for (int64_t i = 0; i < n; ++i) {
        float* row = xp + (t * n + i) * D;
        const float* et = ep + t * D;
        for (int64_t c = 0; c < D; ++c) row[c] += et[c];
      }
    });
  }
  e.reset();
  return m.block->forward(Xin.view({T, n, D}), ids, shape, pass);
}

Tensor DeepSeekV4Model::mtp_backward(const Tensor& dXm) {
  Mtp& m = *mtp_;
  const int64_t T = dXm.dim(0), n = cfg_.hc_mult, D = cfg_.hidden_size;
  const Tensor dXin = m.block->backward(dXm, last_aux_grad_scale_);
  // Xin_i = e + h_proj(hnorm(X_i)): e's gradient is the streams' sum.
  Tensor de = sum_streams(dXin);
  Tensor dX;
  {
    Tensor dh;
    {
      const Tensor hn = m.hnorm.recompute_output();
      dh = m.h_proj.backward(dXin.view({T * n, D}), hn);
    }
    dX = m.hnorm.backward(dh).view({T, n, D});
  }
  Tensor d_en;
  {
    const Tensor en = m.enorm.recompute_output();
    d_en = m.e_proj.backward(de, en);
  }
  de.reset();
  m.embed.weight.grad = embed_.weight.grad;
  m.embed.backward(m.enorm.backward(d_en));
  return dX;
}

LossResult DeepSeekV4Model::forward(const Tensor& tokens, const Tensor& targets,
                                    const BatchShape& shape, Pass pass,
                                    const LossOptions& options) {
  MOE_CHECK(targets.dtype() == DType::I32 && targets.numel() == shape.tokens(),
            "expected {} I32 targets (batch {} x seq {}), got {}", shape.tokens(), shape.batch,
            shape.seq, shape_str(targets.shape()));
  const bool train = needs_backward(pass);
  // Adapter dropout only while training (the trainer sets the masks' seed and draw).
  lora_runtime_->dropout_active = train;
  d_head_in_.reset();
  d_mtp_head_in_.reset();
  Tensor X = streams(tokens, shape, pass);
  LossResult r = head_.forward(norm_.forward(hc_head_.forward(X, pass), pass), targets, pass,
                               options.z_loss, options.grad_scale);
  // The fused head formed its input gradient now; it waits here for backward().
  if (train) d_head_in_ = head_.backward();
  if (mtp_) {
    const Tensor ids = shift_left(tokens, shape, 0);
    const Tensor mtp_targets = shift_left(targets, shape, kIgnoreIndex);
    Tensor Xm = mtp_streams(X, ids, shape, pass);
    X.reset();
    const float mtp_scale = static_cast<float>(options.mtp_loss_scale);
    const LossResult m =
        head_.forward(mtp_->norm.forward(mtp_->hc_head.forward(Xm, pass), pass), mtp_targets,
                      pass, 0.0, options.grad_scale * mtp_scale);
    if (train) d_mtp_head_in_ = head_.backward();
    r.mtp_ce = m.ce;
    r.mtp_weight = options.mtp_loss_scale;
  }
  if (train)
    for (MoELayer* m : moe_layers()) r.aux += m->aux_loss();
  last_aux_grad_scale_ = options.aux_grad_scale.value_or(options.grad_scale);
  return r;
}

void DeepSeekV4Model::backward() {
  MOE_CHECK(d_head_in_.defined(), "DeepSeekV4Model: backward without a training forward");
  // The MTP path first: its state gradient is added to the main head's below, in a fixed order.
  Tensor dX_mtp;
  if (mtp_) {
    Tensor d = mtp_->norm.backward(d_mtp_head_in_);
    d_mtp_head_in_.reset();
    dX_mtp = mtp_backward(mtp_->hc_head.backward(d));
  }
  Tensor dX = hc_head_.backward(norm_.backward(d_head_in_));
  d_head_in_.reset();
  if (dX_mtp.defined()) {
    add_inplace(dX.f32(), dX_mtp.f32(), dX.numel());
    dX_mtp.reset();
  }
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
    dX = (*it)->backward(dX, last_aux_grad_scale_);
  embed_.backward(sum_streams(dX));
}

Tensor DeepSeekV4Model::logits(const Tensor& tokens, const BatchShape& shape, Tensor* mtp_logits) {
  const Pass pass = Pass::Inference;
  lora_runtime_->dropout_active = false;
  Tensor X = streams(tokens, shape, pass);
  Tensor out = head_.logits(norm_.forward(hc_head_.forward(X, pass), pass));
  if (mtp_logits) {
    MOE_CHECK(mtp_ != nullptr, "DeepSeekV4Model: MTP logits asked of a model without MTP layers "
              "(num_nextn_predict_layers = 0)");
    const Tensor ids = shift_left(tokens, shape, 0);
    const Tensor Xm = mtp_streams(X, ids, shape, pass);
    *mtp_logits = head_.logits(mtp_->norm.forward(mtp_->hc_head.forward(Xm, pass), pass));
  }
  return out;
}

bool DeepSeekV4Model::has_saved() const {
  if (embed_.has_saved() || hc_head_.has_saved() || norm_.has_saved() || head_.has_saved() ||
      d_head_in_.defined() || d_mtp_head_in_.defined())
    return true;
  for (auto& b : blocks_)
    if (b->has_saved()) return true;
  if (mtp_) {
    const Mtp& m = *mtp_;
    if (m.enorm.has_saved() || m.hnorm.has_saved() || m.norm.has_saved() || m.e_proj.has_saved() ||
        m.h_proj.has_saved() || m.block->has_saved() || m.hc_head.has_saved() ||
        m.embed.has_saved())
      return true;
  }
  return false;
}

}  // namespace moe
