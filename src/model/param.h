#pragma once
// A trainable (or frozen) parameter: fp32 master value plus a gradient that exists only while
// the model trains. `name` is the Hugging Face checkpoint key.
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moe {

// How a parameter's value is stored. Frozen routed experts in MXFP4 (SPEC §5) are two U8
// tensors per matrix W [out, in]: `<key>.weight` the E2M1 pairs [out, in/2] (element 2i in the
// low nibble; on disk dtype I8) and `<key>.scale` the E8M0 block scales [out, in/32] (on disk
// F8_E8M0). Neither has a gradient.
enum class ParamFormat { F32, Mxfp4Data, Mxfp4Scales };

struct Param {
  std::string name;
  Tensor value;  // MemCategory::Weights
  Tensor grad;   // MemCategory::Grads; undefined until allocate_grad()
  bool weight_decay = true;  // false for norms, biases and the router correction bias
  bool trainable = true;     // false for frozen weights and for the bias (updated by balancing)
  ParamFormat format = ParamFormat::F32;
  // > 0: the fp32 value holds integer ids in [0, id_bound) (DeepSeek-V4's gate.tid2eid, expert
  // ids). Checkpoints may store it as I64 or I32, which load_weights converts after checking
  // every entry against the bound.
  int64_t id_bound = 0;
  bool packed() const { return format != ParamFormat::F32; }

  void init(std::string key, const Shape& shape, bool decay,
            MemCategory category = MemCategory::Weights) {
    name = std::move(key);
    value = Tensor::zeros(shape, DType::F32, category);
    weight_decay = decay;
  }
  void allocate_grad() {
    if (!grad.defined())
      grad = Tensor::zeros(value.shape(), DType::F32, grad_category_of(value.category()));
  }
  void zero_grad() const {
    if (grad.defined()) grad.zero();
  }
  float* w() const { return value.f32(); }
  float* g() const { return grad.f32(); }
};

using ParamList = std::vector<Param*>;

// The gradients of `params` (those that have one) cut into pieces of at most `chunk` values,
// parameter by parameter and in order: the work items of a pass over every gradient.
struct GradPiece {
  float* at;
  int64_t n;
};
std::vector<GradPiece> gradient_pieces(const ParamList& params, int64_t chunk);

// Zeroes the gradients of `params` (those that have one), spread over the threads: a step's
// gradients are as large as the model, too much for one thread's memset.
void zero_grads(const ParamList& params);

// Fills one MXFP4 pair (`data`, `scales`: the two Params of a matrix [out, in]) row by row:
// `row(r, values)` writes row r's `in` fp32 values, which are quantized straight into the pair.
// Streaming one row at a time is what keeps initialising or loading packed experts free of any
// full-precision matrix.
void quantize_rows_into(const Param& data, const Param& scales,
                        const std::function<void(int64_t row, float* values)>& row);

// Packed stores list each MXFP4 matrix as its data then its scales: the scales of the data at
// params[data_index] (an internal error when they are not there).
const Param& mxfp4_scales_after(const ParamList& params, size_t data_index);

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
