#pragma once
// The building blocks the replays of train/memory_replay.h share (memory_replay.cpp for
// DeepSeekModel, memory_replay_v4.cpp for DeepSeekV4Model): tensor storages charged to the
// ledger while referenced, and the allocation sequences of the layers both models use (Linear
// with its LoRA adapter, RMSNorm, SwiGLU, the MoE layer with its dispatcher and grouped
// adapters, the fused LM head + loss), each in the engine's order and with the engine's sizes.
#include <memory>
#include <string>

#include "train/memory_replay.h"

namespace moe::memory_replay {

// One tensor storage of the replay: charged while a reference lives, like core/tensor.h's.
class Chunk {
 public:
  Chunk(Ledger& l, MemCategory c, int64_t bytes) : ledger_(l), category_(c), bytes_(bytes) {
    ledger_.alloc(c, bytes);
  }
  ~Chunk() { ledger_.release(category_, bytes_); }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

 private:
  Ledger& ledger_;
  MemCategory category_;
  int64_t bytes_;
};
using Buf = std::shared_ptr<Chunk>;

struct NormSaved {
  Buf x, rstd;
};
struct SwigluSaved {
  Buf g, u;
};
struct MoeSaved {
  Buf ids, weights, scores, f, rows, g, u, row_weights, state, extra, keys;
  SwigluSaved shared;
};

class ReplayParts {
 public:
  ReplayParts(const Dims& d, Ledger& ledger, Workspace& ws) : d_(d), ledger_(ledger), ws_(ws) {}

 protected:
  void phase(const std::string& p) { ledger_.set_phase(p); }
  Buf make(MemCategory c, int64_t bytes) { return std::make_shared<Chunk>(ledger_, c, bytes); }
  Buf f32(MemCategory c, int64_t n) { return make(c, 4 * n); }
  Buf i32(MemCategory c, int64_t n) { return make(c, 4 * n); }
  Buf act(int64_t n) { return f32(MemCategory::Activations, n); }
  // core/thread_slabs.h: `bytes` per pool thread, each slab rounded up to 64 bytes.
  Buf thread_slabs(int64_t bytes);

  // Linear (model/layers.cpp) over `rows` input rows; the overloads without rows take the
  // micro-batch's tokens.
  // Linear::needs_input: a trained weight or an adapter reads the input in backward.
  bool keeps_input(const Lin& l) const { return d_.base_grads || l.r > 0; }
  Buf lora_project(const Lin& l, int64_t rows);
  Buf linear_forward(const Lin& l, int64_t rows);
  // Linear::backward (a new dx) or backward_accumulate (into the caller's dx).
  Buf linear_backward(const Lin& l, int64_t rows, bool new_dx = true);
  Buf lora_project(const Lin& l) { return lora_project(l, d_.T); }
  Buf linear_forward(const Lin& l) { return linear_forward(l, d_.T); }
  Buf linear_backward(const Lin& l, bool new_dx = true) {
    return linear_backward(l, d_.T, new_dx);
  }

  // RMSNorm::forward in training: the output, keeping the input and the rstd in `s`.
  Buf norm_forward(const Buf& x, int64_t rows, int64_t dim, NormSaved& s);
  Buf norm_forward(const Buf& x, int64_t dim, NormSaved& s) {
    return norm_forward(x, d_.T, dim, s);
  }

  // SwiGLU (the dense MLP and the shared experts: L.gate, L.up, L.down).
  Buf swiglu_forward(const LayerShape& L, SwigluSaved& s);
  Buf swiglu_backward(const LayerShape& L, SwigluSaved& s);

  // The MoE layer (moe/moe_layer.cpp) with the input handed back in backward (SaveInput::No).
  Buf moe_forward(const LayerShape& L, MoeSaved& s);
  Buf moe_backward(const LayerShape& L, MoeSaved& s);

  // LMHeadLoss::forward of a training pass: the input gradient it forms (returned), next to
  // the chunked logits it computes it from.
  Buf lm_head_loss();

  const Dims& d_;
  Ledger& ledger_;
  Workspace& ws_;

 private:
  void grouped_forward_add(int64_t in, int64_t out, int64_t r);
  Buf grouped_grad_input(int64_t in, int64_t out, int64_t r);
  void grouped_grad_weights(int64_t in, int64_t out, int64_t r);
  void experts_nt(int64_t in, int64_t out);
  void experts_nn(int64_t in, int64_t out);
  void experts_weight_grad(int64_t in, int64_t out);
};

}  // namespace moe::memory_replay
