#include "moe/moe_layer.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/activations.h"
#include "kernels/gemm.h"
#include "kernels/vector_math.h"
#include "moe/mxfp4_expert_weights.h"

namespace moe {

namespace {

Tensor activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemCategory::Activations);
}

}  // namespace

void MoELayer::init(const std::string& prefix, const ModelConfig& cfg, Dispatcher& dispatcher,
                    ExpertSelection selection, FfnKeys keys) {
  router_ = RouterConfig::from(cfg);
  selection_ = selection;
  MOE_CHECK(cfg.swiglu_limit >= 0, "{}: field 'swiglu_limit' must be >= 0, got {}", prefix,
            cfg.swiglu_limit);
  swiglu_limit_ = static_cast<float>(cfg.swiglu_limit);
  MOE_CHECK(cfg.hidden_size > 0 && cfg.moe_intermediate_size > 0 && cfg.n_shared_experts >= 0,
            "{}: MoE layer needs hidden_size > 0, moe_intermediate_size > 0 and "
            "n_shared_experts >= 0, got {}, {}, {}",
            prefix, cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts);
  MOE_CHECK(cfg.aux_loss_alpha >= 0, "{}: field 'aux_loss_alpha' must be >= 0, got {}", prefix,
            cfg.aux_loss_alpha);
  // HF's seq_aux = false selects a batch-wise variant this engine does not implement; failing
  // beats silently training with a different loss.
  MOE_CHECK(cfg.seq_aux || cfg.aux_loss_alpha == 0,
            "{}: only the sequence-wise auxiliary loss is implemented (seq_aux = true), but "
            "seq_aux = false with aux_loss_alpha = {}",
            prefix, cfg.aux_loss_alpha);
  dim_ = cfg.hidden_size;
  hidden_ = cfg.moe_intermediate_size;
  aux_alpha_ = cfg.aux_loss_alpha;
  dispatcher_ = &dispatcher;
  const int64_t E = router_.num_experts;
  local_ = dispatcher.local_experts(E);
  MOE_CHECK(local_.first >= 0 && local_.count >= 0 && local_.first + local_.count <= E,
            "{}: dispatcher gave local experts [{}, {}) outside [0, {})", prefix, local_.first,
            local_.first + local_.count, E);

  gate_weight.init(prefix + "gate.weight", {E, dim_}, /*decay=*/true);
  gate_bias.init(prefix + (keys == FfnKeys::V4 ? "gate.bias" : "gate.e_score_correction_bias"),
                 {E}, /*decay=*/false);
  gate_bias.trainable = false;
  if (selection_ == ExpertSelection::Hash) {
    MOE_CHECK(cfg.vocab_size > 0, "{}: a hash-routed MoE layer needs vocab_size > 0 (the rows of "
              "tid2eid), got {}", prefix, cfg.vocab_size);
    tid2eid.init(prefix + "gate.tid2eid", {cfg.vocab_size, router_.top_k}, /*decay=*/false);
    tid2eid.trainable = false;
    tid2eid.id_bound = E;  // loaded from the released I64 table with a range check
    // A valid table from the start (token v -> experts v, v+1, ... mod E); loading replaces it.
    float* t = tid2eid.w();
    for (int64_t v = 0; v < cfg.vocab_size; ++v)
      for (int64_t j = 0; j < router_.top_k; ++j)
        t[v * router_.top_k + j] = static_cast<float>((v + j) % E);
  }

  if (cfg.mxfp4_experts()) {
    auto packed = std::make_unique<Mxfp4ExpertWeights>();
    packed->init(prefix, local_, dim_, hidden_, keys);
    packed_ = packed.get();
    experts_ = std::move(packed);
  } else {
    auto dense = std::make_unique<DenseExpertWeights>();
    dense->init(prefix, local_, dim_, hidden_, keys);
    dense_ = dense.get();
    experts_ = std::move(dense);
  }

  if (cfg.n_shared_experts > 0) {
    shared_ = std::make_unique<SwiGLU>();
    shared_->init(prefix + "shared_experts.", dim_, hidden_ * cfg.n_shared_experts,
                  swiglu_limit_, keys);
  }
  counts_.assign(static_cast<size_t>(E), 0);
}

void MoELayer::collect(ParamList& out) {
  out.push_back(&gate_weight);
  if (selection_ == ExpertSelection::Hash)
    out.push_back(&tid2eid);
  else
    out.push_back(&gate_bias);
  experts_->collect(out);
  if (shared_) shared_->collect(out);
}

void MoELayer::allocate_grads() {
  if (gate_weight.trainable) gate_weight.allocate_grad();
  experts_->allocate_grads();
  for (auto* a : {lora_.gate.get(), lora_.up.get(), lora_.down.get()})
    if (a) a->allocate_grads();
  if (shared_) {
    ParamList ps;
    shared_->collect(ps);
    for (Param* p : ps)
      if (p->trainable) p->allocate_grad();
  }
}

void MoELayer::set_expert_activations(ExpertActivations activations) {
  MOE_CHECK(activations == ExpertActivations::Fp32 || packed_ != nullptr,
            "{}: {} expert activations need MXFP4 routed experts, but this layer's are fp32",
            gate_weight.name, expert_activations_name(activations));
  expert_activations_ = activations;
}

bool MoELayer::has_saved() const {
  return saved_.x.defined() || saved_.handle.live() || (shared_ && shared_->has_saved());
}

Tensor MoELayer::forward(const Tensor& x, const BatchShape& shape, Pass pass,
                         SaveInput save_input) {
  return forward(x, Tensor(), shape, pass, save_input);
}

Tensor MoELayer::forward(const Tensor& x, const Tensor& token_ids, const BatchShape& shape,
                         Pass pass, SaveInput save_input) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dim_, "{}: expected input [T, {}], got {}",
            gate_weight.name, dim_, shape_str(x.shape()));
  const int64_t T = x.dim(0), E = router_.num_experts, H = hidden_;
  MOE_CHECK(shape.tokens() == T, "{}: {} input rows but batch {} x seq {}", gate_weight.name, T,
            shape.batch, shape.seq);
  const bool train = needs_backward(pass);
  MOE_CHECK(!(train && expert_activations_ == ExpertActivations::Int8),
            "{}: a training forward with int8 expert activations: their rounding has no "
            "backward (inference only); set fp32 expert activations to train",
            gate_weight.name);
  if (train) saved_ = Saved{};  // a Train forward without its backward is superseded

  // Router logits stay fp32 whatever the weights' storage: selection flips on small rounding.
  Tensor logits = activation({T, E});
  gemm_nt(T, E, dim_, x.f32(), dim_, gate_weight.w(), dim_, logits.f32(), E, false);
  Routing routing;
  if (selection_ == ExpertSelection::Hash) {
    MOE_CHECK(token_ids.defined(), "{}: a hash-routed layer needs the token ids of its rows "
              "(forward(x, token_ids, ...))", gate_weight.name);
    routing = route_hash(router_, logits, token_ids, tid2eid.value);
  } else {
    routing = route(router_, logits, gate_bias.w());
  }
  logits.reset();

  SeqAux aux;
  const bool with_aux = train && aux_alpha_ > 0;
  if (train) {
    const int32_t* ids = routing.ids.i32();
    for (int64_t s = 0; s < routing.ids.numel(); ++s) ++counts_[static_cast<size_t>(ids[s])];
    aux_loss_ = 0.0;
    if (with_aux) {
      aux = seq_aux_loss(router_, routing, shape, aux_alpha_);
      aux_loss_ = aux.loss;
    }
  }

  Dispatched d = dispatcher_->dispatch(x, routing.ids, routing.weights, E);
  const ExpertSegments seg = ExpertSegments::from(d.handle);
  const int64_t R = seg.total_rows();

  Tensor g = activation({R, H}), u = activation({R, H});
  experts_->gate_up_forward(seg, d.rows.f32(), g.f32(), u.f32(), expert_activations_);
  const Tensor keys = lora_row_keys(d.handle, T);
  const int32_t* kp = keys.defined() ? keys.i32() : nullptr;
  if (lora_.gate) lora_.gate->forward_add(seg, d.rows.f32(), kp, g.f32());
  if (lora_.up) lora_.up->forward_add(seg, d.rows.f32(), kp, u.f32());
  // The expert weight gradients need the dispatched rows again in backward. With the local
  // dispatcher row r is a copy of x[slot_of_row[r] / k], and x is saved anyway (router and
  // shared experts), so backward re-gathers them (one copy of R·dim floats) instead of keeping
  // k·dim more floats per token alive. Other dispatchers (expert parallelism: rows came from
  // other ranks) keep them.
  // Trainable experts under expert parallelism keep them (backward's communication stays as
  // it was); gate/up adapters alone have them re-fetched in backward, one more exchange of the
  // rows instead of R x dim floats per MoE layer held all step (the memory a LoRA fine-tune of a
  // large model is short of).
  const bool keep_rows = train && experts_->trainable() && !dispatcher_->can_regather_rows();
  if (!keep_rows) d.rows.reset();  // lowers the peak of every forward from here on
  Tensor h = activation({R, H});
  {
    // SwiGLU, then the routing weight, row by row while the row is in cache.
    const float *gp = g.f32(), *up = u.f32(), *rw = d.row_weights.f32();
    float* hp = h.f32();
    parallel_for(0, R, [&](int64_t r) {
      swiglu_row(gp + r * H, up + r * H, hp + r * H, H, swiglu_limit_);
      scale_row(hp + r * H, H, rw[r]);
    });
  }
  if (!train) g.reset(), u.reset();
  Tensor o = activation({R, dim_});
  experts_->down_forward(seg, h.f32(), o.f32(), expert_activations_);
  if (lora_.down) lora_.down->forward_add(seg, h.f32(), kp, o.f32());
  h.reset();
  Tensor y = dispatcher_->combine(o, d.handle, pass);
  o.reset();

  if (shared_) {
    Tensor ys = shared_->forward(x, pass, save_input);
    add_inplace(y.f32(), ys.f32(), y.numel());
  }

  if (train) {
    if (save_input == SaveInput::Yes) saved_.x = x;
    saved_.routing = std::move(routing);
    saved_.rows = std::move(d.rows);
    saved_.g = std::move(g);
    saved_.u = std::move(u);
    saved_.row_weights = std::move(d.row_weights);
    saved_.aux = std::move(aux);
    saved_.has_aux = with_aux;
    saved_.handle = std::move(d.handle);
    saved_.shape = shape;
    saved_.row_keys = keys;
  }
  return y;
}

Tensor MoELayer::backward(const Tensor& dy, float aux_grad_scale) {
  MOE_CHECK(saved_.handle.live(), "{}: backward without a training forward", gate_weight.name);
  MOE_CHECK(saved_.x.defined(), "{}: the forward did not save its input: call backward(dy, x)",
            gate_weight.name);
  const Tensor x = saved_.x;
  return backward(dy, x, aux_grad_scale);
}

Tensor MoELayer::backward(const Tensor& dy, const Tensor& x_in, float aux_grad_scale) {
  MOE_CHECK(saved_.handle.live(), "{}: backward without a training forward", gate_weight.name);
  const int64_t T = saved_.shape.tokens(), E = router_.num_experts, H = hidden_, D = dim_;
  MOE_CHECK(x_in.ndim() == 2 && x_in.dim(0) == T && x_in.dim(1) == D,
            "{}: backward input must be [{}, {}], got {}", gate_weight.name, T, D,
            shape_str(x_in.shape()));
  MOE_CHECK(dy.ndim() == 2 && dy.dim(0) == T && dy.dim(1) == D, "{}: expected dy [{}, {}], got {}",
            gate_weight.name, T, D, shape_str(dy.shape()));
  Handle& handle = saved_.handle;
  const ExpertSegments seg = ExpertSegments::from(handle);
  const int64_t R = seg.total_rows();

  // Shared experts first: their saved g, u (2·hidden floats per token) are released before the
  // routed experts' [R, dim] + [R, hidden] gradient buffers exist, which lowers the step's peak
  // (this backward runs while nearly every activation of the model is still saved).
  // The shared experts saved x themselves exactly when this layer did.
  Tensor dx_shared =
      shared_ ? (saved_.x.defined() ? shared_->backward(dy) : shared_->backward(dy, x_in))
              : Tensor();

  Tensor d_out = dispatcher_->combine_backward(dy, handle);
  Tensor d_h = activation({R, H});
  experts_->down_backward_input(seg, d_out.f32(), d_h.f32());
  const int32_t* kp = saved_.row_keys.defined() ? saved_.row_keys.i32() : nullptr;
  const Tensor g_down =
      lora_.down ? lora_.down->grad_input(seg, d_out.f32(), kp, d_h.f32()) : Tensor();

  // One fused pass per row r, so that no third [R, H] buffer is needed next to d_out and d_h:
  //   h = silu(g)·u, recomputed into a per-thread row (h is not saved: R·H floats);
  //   d_row_w = <dh, h>;  dh *= w;  (dg, du) = swiglu'(g, u, dh), written over the saved g, u;
  //   then dh, no longer needed, is overwritten with w·h, the down projection's input for its
  //   weight gradient below.
  Tensor d_row_w = activation({R});
  {
    const Tensor h_rows = Tensor::empty({num_threads(), H}, DType::F32, MemCategory::Scratch);
    const float* rw = saved_.row_weights.f32();
    float* gp = saved_.g.f32();
    float* up = saved_.u.f32();
    float* dhp = d_h.f32();
    float* dw = d_row_w.f32();
    parallel_for(0, R, [&](int64_t r) {
      float* h = h_rows.f32() + thread_index() * H;
      float* g = gp + r * H;
      float* u = up + r * H;
      float* dh = dhp + r * H;
      swiglu_row(g, u, h, H, swiglu_limit_);
      dw[r] = static_cast<float>(dot_product(dh, h, H));
      scale_row(dh, H, rw[r]);
      swiglu_backward_row(g, u, dh, g, u, H, swiglu_limit_);
      std::memcpy(dh, h, sizeof(float) * static_cast<size_t>(H));
      scale_row(dh, H, rw[r]);
    });
  }
  const bool weight_grads = experts_->trainable();
  if (weight_grads) experts_->down_backward_weight(seg, d_out.f32(), d_h.f32());
  if (lora_.down) lora_.down->grad_weights(seg, d_h.f32(), kp, d_out.f32(), g_down);
  d_out.reset();
  d_h.reset();
  const float* dg = saved_.g.f32();
  const float* du = saved_.u.f32();
  // Weight gradients first, so the (re-gathered) rows are gone before d_rows exists; gate/up
  // adapters need the rows for their own weight gradients after d_rows, so they keep them.
  Tensor rows;
  if (weight_grads || lora_.gate || lora_.up)
    rows = saved_.rows.defined() ? std::move(saved_.rows) : dispatcher_->refetch_rows(x_in, handle);
  if (weight_grads) experts_->gate_up_backward_weight(seg, dg, du, rows.f32());
  saved_.rows.reset();
  if (!lora_.gate && !lora_.up) rows.reset();
  Tensor d_rows = activation({R, D});
  experts_->gate_up_backward_input(seg, dg, du, d_rows.f32());
  for (const auto& [adapter, d] : {std::pair{lora_.gate.get(), dg}, std::pair{lora_.up.get(), du}}) {
    if (!adapter) continue;
    const Tensor g = adapter->grad_input(seg, d, kp, d_rows.f32());
    adapter->grad_weights(seg, rows.f32(), kp, d, g);
  }
  rows.reset();
  saved_.g.reset();
  saved_.u.reset();

  Tensor d_weights = dispatcher_->row_weights_backward(d_row_w, handle);
  Tensor dx = dispatcher_->dispatch_backward(d_rows, handle);  // releases the handle
  d_rows.reset();

  Tensor d_logits =
      route_backward(router_, saved_.routing, d_weights, saved_.has_aux ? &saved_.aux : nullptr,
                     saved_.shape, aux_alpha_, aux_grad_scale);
  const float* x = x_in.f32();
  if (gate_weight.grad.defined())
    gemm_tn(E, D, T, d_logits.f32(), E, x, D, gate_weight.g(), D, true);
  gemm_nn(T, D, E, d_logits.f32(), E, gate_weight.w(), D, dx.f32(), D, true);

  if (dx_shared.defined()) add_inplace(dx.f32(), dx_shared.f32(), dx.numel());
  saved_ = Saved{};
  return dx;
}

Tensor MoELayer::lora_row_keys(const Handle& handle, int64_t T) const {
  const auto drops = [&](const std::unique_ptr<GroupedLoraAdapter>& a) {
    return a && a->shape().dropout > 0.0f;
  };
  if (!lora_runtime_ || !lora_runtime_->dropout_active ||
      !(drops(lora_.gate) || drops(lora_.up) || drops(lora_.down)))
    return Tensor();
  Tensor token_keys = Tensor::empty({T}, DType::I32, MemCategory::Routing);
  int32_t* k = token_keys.i32();
  for (int64_t t = 0; t < T; ++t) k[t] = static_cast<int32_t>(lora_runtime_->row_offset + t);
  return dispatcher_->row_token_keys(token_keys, handle);
}

void MoELayer::update_bias(double rate) {
  const int64_t E = router_.num_experts;
  if (selection_ == ExpertSelection::Hash) {
    std::fill(counts_.begin(), counts_.end(), 0);
    return;
  }
  double mean = 0;
  for (int64_t c : counts_) mean += static_cast<double>(c);
  mean /= static_cast<double>(E);
  std::vector<double> delta(static_cast<size_t>(E));
  double mean_delta = 0;
  for (int64_t i = 0; i < E; ++i) {
    const double gap = mean - static_cast<double>(counts_[static_cast<size_t>(i)]);
    delta[static_cast<size_t>(i)] = rate * static_cast<double>((gap > 0) - (gap < 0));
    mean_delta += delta[static_cast<size_t>(i)];
  }
  mean_delta /= static_cast<double>(E);
  float* b = gate_bias.w();
  for (int64_t i = 0; i < E; ++i)
    b[i] = static_cast<float>(b[i] + (delta[static_cast<size_t>(i)] - mean_delta));
  std::fill(counts_.begin(), counts_.end(), 0);
}

}  // namespace moe
