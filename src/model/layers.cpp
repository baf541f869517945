#include "model/layers.h"

#include <algorithm>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/activations.h"
#include "kernels/gemm.h"

namespace moe {

static Tensor activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemCategory::Activations);
}

// ---------------------------------------------------------------- Linear

void Linear::init(const std::string& name, int64_t in_features, int64_t out_features) {
  in = in_features;
  out = out_features;
  weight.init(name, {out, in}, /*decay=*/true);
}

Tensor Linear::forward(const Tensor& x, Pass pass) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == in, "{}: expected input [T, {}], got {}", weight.name, in,
            shape_str(x.shape()));
  const int64_t T = x.dim(0);
  Tensor y = activation({T, out});
  linear_forward(x.f32(), weight.w(), y.f32(), T, in, out);
  if (lora) lora->forward_add(x, y.f32(), out);
  if (needs_backward(pass)) {
    if (needs_input()) saved_input_ = x;
    else backward_pending_ = true;
  }
  return y;
}

void Linear::check_train_forward() const {
  MOE_CHECK(saved_input_.defined() || backward_pending_, "{}: backward without a training forward",
            weight.name);
}

std::string Linear::module_name() const {
  const std::string& n = weight.name;
  const std::string suffix = ".weight";
  return n.size() > suffix.size() && n.ends_with(suffix) ? n.substr(0, n.size() - suffix.size())
                                                          : n;
}

void Linear::add_lora_grads(const Tensor& dy, const Tensor& dx, const Tensor& input) {
  if (!lora) return;
  MOE_CHECK(input.defined(), "{}: LoRA backward without the forward's input", weight.name);
  const Tensor g = lora->grad_input(dy.f32(), out, dy.dim(0), dx.f32(), in);
  lora->grad_weights(input, dy.f32(), out, g);
}

void Linear::accumulate_weight_grad(const Tensor& dy, const Tensor& input) {
  if (weight.grad.defined()) {
    MOE_CHECK(input.defined(), "{}: backward without a training forward", weight.name);
    MOE_CHECK(input.ndim() == 2 && input.dim(0) == dy.dim(0) && input.dim(1) == in,
              "{}: backward input must be [{}, {}], got {}", weight.name, dy.dim(0), in,
              shape_str(input.shape()));
    linear_backward_weight(dy.f32(), input.f32(), weight.g(), dy.dim(0), in, out);
  }
  saved_input_.reset();
  backward_pending_ = false;
}

Tensor Linear::backward(const Tensor& dy) {
  check_train_forward();
  return backward(dy, saved_input_);
}

Tensor Linear::backward(const Tensor& dy, const Tensor& input) {
  Tensor x = input;  // may be saved_input_, which accumulate_weight_grad releases
  Tensor dx = activation({dy.dim(0), in});
  linear_backward_input(dy.f32(), weight.w(), dx.f32(), dy.dim(0), in, out, false);
  add_lora_grads(dy, dx, x);
  accumulate_weight_grad(dy, x);
  return dx;
}

void Linear::backward_accumulate(const Tensor& dy, const Tensor& dx) {
  check_train_forward();
  backward_accumulate(dy, dx, saved_input_);
}

void Linear::backward_accumulate(const Tensor& dy, const Tensor& dx, const Tensor& input) {
  Tensor x = input;  // may be saved_input_, which accumulate_weight_grad releases
  linear_backward_input(dy.f32(), weight.w(), dx.f32(), dy.dim(0), in, out, true);
  add_lora_grads(dy, dx, x);
  accumulate_weight_grad(dy, x);
}

// ---------------------------------------------------------------- RMSNorm

void RMSNorm::init(const std::string& name, int64_t d, double epsilon) {
  dim = d;
  eps = static_cast<float>(epsilon);
  weight.init(name, {dim}, /*decay=*/false);
  float* w = weight.w();
  std::fill(w, w + dim, 1.0f);
}

Tensor RMSNorm::forward(const Tensor& x, Pass pass) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dim, "{}: expected input [T, {}], got {}", weight.name,
            dim, shape_str(x.shape()));
  const int64_t T = x.dim(0);
  Tensor y = activation({T, dim});
  Tensor rstd = needs_backward(pass) ? activation({T}) : Tensor();
  rmsnorm_forward(x.f32(), weight.w(), y.f32(), rstd.defined() ? rstd.f32() : nullptr, T, dim, eps);
  if (needs_backward(pass)) {
    saved_input_ = x;
    saved_rstd_ = rstd;
  }
  return y;
}

Tensor RMSNorm::recompute_output() const {
  MOE_CHECK(saved_input_.defined(), "{}: recompute without a training forward", weight.name);
  const int64_t T = saved_input_.dim(0);
  Tensor y = activation({T, dim});
  rmsnorm_forward(saved_input_.f32(), weight.w(), y.f32(), nullptr, T, dim, eps);
  return y;
}

Tensor RMSNorm::backward(const Tensor& dy) {
  MOE_CHECK(saved_input_.defined(), "{}: backward without a training forward", weight.name);
  const int64_t T = dy.dim(0);
  Tensor dx = activation({T, dim});
  rmsnorm_backward(saved_input_.f32(), weight.w(), saved_rstd_.f32(), dy.f32(), dx.f32(),
                   weight.grad.defined() ? weight.g() : nullptr, T, dim);
  saved_input_.reset();
  saved_rstd_.reset();
  return dx;
}

// ---------------------------------------------------------------- Embedding

void Embedding::init(const std::string& name, int64_t vocab_size, int64_t d) {
  vocab = vocab_size;
  dim = d;
  weight.init(name, {vocab, dim}, /*decay=*/true);
}

Tensor Embedding::forward(const Tensor& tokens, Pass pass) {
  const int64_t T = tokens.numel();
  const int32_t* ids = tokens.i32();
  for (int64_t t = 0; t < T; ++t)
    MOE_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id {} at position {} is outside the vocabulary "
              "[0, {})", ids[t], t, vocab);
  Tensor y = activation({T, dim});
  const float* w = weight.w();
  float* out = y.f32();
  parallel_for(0, T, [&](int64_t t) {
    std::copy(w + ids[t] * dim, w + (ids[t] + 1) * dim, out + t * dim);
  });
  if (needs_backward(pass)) saved_tokens_ = tokens;
  return y;
}

void Embedding::backward(const Tensor& dy) {
  MOE_CHECK(saved_tokens_.defined(), "{}: backward without a training forward", weight.name);
  if (weight.grad.defined()) {
    const int32_t* ids = saved_tokens_.i32();
    const int64_t T = saved_tokens_.numel();
    const float* d = dy.f32();
    float* g = weight.g();
    // Column blocks own their slices and visit tokens in order: deterministic scatter-add. Blocks
    // of 32 columns split dim 320 evenly between two threads.
    const int64_t width = 32, blocks = (dim + width - 1) / width;
    parallel_for(0, blocks, [&](int64_t b) {
      const int64_t lo = b * width, hi = std::min(dim, lo + width);
      for (int64_t t = 0; t < T; ++t) {
        float* gr = g + ids[t] * dim;
        const float* dr = d + t * dim;
        for (int64_t i = lo; i < hi; ++i) gr[i] += dr[i];
      }
    });
  }
  saved_tokens_.reset();
}

// ---------------------------------------------------------------- SwiGLU

void SwiGLU::init(const std::string& prefix, int64_t d, int64_t h, float clamp_limit,
                  FfnKeys keys) {
  dim = d;
  hidden = h;
  limit = clamp_limit;
  gate.init(prefix + ffn_key(keys, 0) + ".weight", dim, hidden);
  up.init(prefix + ffn_key(keys, 1) + ".weight", dim, hidden);
  down.init(prefix + ffn_key(keys, 2) + ".weight", hidden, dim);
}

void SwiGLU::collect(ParamList& out) {
  gate.collect(out);
  up.collect(out);
  down.collect(out);
}

Tensor SwiGLU::forward(const Tensor& x, Pass pass, SaveInput save_input) {
  const Pass linear_pass = save_input == SaveInput::Yes ? pass : Pass::Eval;
  Tensor g = gate.forward(x, linear_pass);
  Tensor u = up.forward(x, linear_pass);
  Tensor h = activation(g.shape());
  swiglu_forward(g.f32(), u.f32(), h.f32(), h.numel(), limit);
  if (needs_backward(pass)) {
    saved_gate_ = g;
    saved_up_ = u;
  }
  // down saves nothing: backward rebuilds h from g and u (see the class comment).
  return down.forward(h, Pass::Eval);
}

Tensor SwiGLU::backward(const Tensor& dy) {
  MOE_CHECK(gate.has_saved(), "{}: backward without a training forward (or after one that "
            "did not save its input)", gate.weight.name);
  return backward(dy, Tensor());  // undefined x: gate and up use the input they saved
}

Tensor SwiGLU::backward(const Tensor& dy, const Tensor& x) {
  MOE_CHECK(saved_gate_.defined(), "{}: backward without a training forward", gate.weight.name);
  Tensor dh;
  {
    Tensor h;  // down's input, rebuilt only when its backward reads it
    if (down.needs_input()) {
      h = activation(saved_gate_.shape());
      swiglu_forward(saved_gate_.f32(), saved_up_.f32(), h.f32(), h.numel(), limit);
    }
    dh = down.backward(dy, h);
  }
  // dg and du overwrite the saved pre-activations: they are not needed afterwards.
  swiglu_backward(saved_gate_.f32(), saved_up_.f32(), dh.f32(), saved_gate_.f32(),
                  saved_up_.f32(), dh.numel(), limit);
  Tensor dx = x.defined() ? gate.backward(saved_gate_, x) : gate.backward(saved_gate_);
  if (x.defined())
    up.backward_accumulate(saved_up_, dx, x);
  else
    up.backward_accumulate(saved_up_, dx);
  saved_gate_.reset();
  saved_up_.reset();
  return dx;
}

}  // namespace moe
