#pragma once
// A trainable (or frozen) parameter: fp32 master value plus a gradient that exists only while
// the model trains. `name` is the Hugging Face checkpoint key.
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moe {

struct Param {
  std::string name;
  Tensor value;  // MemCategory::Weights
  Tensor grad;   // MemCategory::Grads; undefined until allocate_grad()
  bool weight_decay = true;  // false for norms, biases and the router correction bias
  bool trainable = true;     // false for frozen weights and for the bias (updated by balancing)

  void init(std::string key, const Shape& shape, bool decay) {
    name = std::move(key);
    value = Tensor::zeros(shape, DType::F32, MemCategory::Weights);
    weight_decay = decay;
  }
  void allocate_grad() {
    if (!grad.defined()) grad = Tensor::zeros(value.shape(), DType::F32, MemCategory::Grads);
  }
  void zero_grad() const {
    if (grad.defined()) grad.zero();
  }
  float* w() const { return value.f32(); }
  float* g() const { return grad.f32(); }
};

using ParamList = std::vector<Param*>;

// Whether a backward will follow this forward. Only Train keeps activations and dispatch
// handles; Eval and Inference forwards must leave nothing behind.
enum class Pass { Train, Eval, Inference };
inline bool needs_backward(Pass p) { return p == Pass::Train; }

// Layout of the token rows flowing through the model: T = batch * seq rows, sequence-major.
struct BatchShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t tokens() const { return batch * seq; }
};

}  // namespace moe
