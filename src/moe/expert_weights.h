#pragma once
// The routed experts' matmuls over expert-major rows, behind an interface a packed (MXFP4)
// store can implement: it needs forward Y = X·Wᵀ and input gradient dX = dY·W per expert
// segment; only trainable fp32 storage also provides the weight gradients.
//
// Every grouped GEMM is cut into (expert, row block, column block) work items whose bounds
// depend on the row counts and shapes only, scheduled across threads with
// parallel_for_dynamic; each item is one single-threaded sgemm, so the result has the same
// bits for any thread count. Items are visited largest first so a skewed expert does not end
// up as the straggler.
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/ffn_keys.h"
#include "model/param.h"
#include "moe/dispatcher.h"
#include "moe/expert_activations.h"

namespace moe {

// Rows [offsets[e], offsets[e+1]) of the expert-major buffers belong to local expert e.
struct ExpertSegments {
  std::vector<int64_t> offsets;
  int64_t experts() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t begin(int64_t e) const { return offsets[static_cast<size_t>(e)]; }
  int64_t rows(int64_t e) const { return offsets[static_cast<size_t>(e) + 1] - begin(e); }
  int64_t total_rows() const { return offsets.back(); }
  static ExpertSegments from(const Handle& handle);
};

class ExpertWeights {
 public:
  virtual ~ExpertWeights() = default;
  virtual int64_t dim() const = 0;
  virtual int64_t hidden() const = 0;
  virtual ExpertRange experts() const = 0;

  // The input-side products, cut into work items here once for every store; a store supplies
  // the two single-threaded per-item matmuls below.
  // g, u [R, hidden] = x [R, dim] · W_gateᵀ, W_upᵀ.
  // `activations`: Int8 only for an inference forward over MXFP4 experts (expert_activations.h);
  // the backward products below have no such choice.
  void gate_up_forward(const ExpertSegments& seg, const float* x, float* g, float* u,
                       ExpertActivations activations = ExpertActivations::Fp32) const;
  // y [R, dim] = h [R, hidden] · W_downᵀ.
  void down_forward(const ExpertSegments& seg, const float* h, float* y,
                    ExpertActivations activations = ExpertActivations::Fp32) const;
  // dh [R, hidden] = dy [R, dim] · W_down.
  void down_backward_input(const ExpertSegments& seg, const float* dy, float* dh) const;
  // dx [R, dim] = dg · W_gate + du · W_up.
  void gate_up_backward_input(const ExpertSegments& seg, const float* dg, const float* du,
                              float* dx) const;

  // Trainable storage keeps gradients; frozen storage needs no saved expert inputs at all.
  virtual bool trainable() const = 0;
  // dW_gate += dgᵀ·x, dW_up += duᵀ·x per expert (into allocated grads only).
  virtual void gate_up_backward_weight(const ExpertSegments& seg, const float* dg, const float* du,
                                       const float* x) = 0;
  // dW_down += dyᵀ·h per expert.
  virtual void down_backward_weight(const ExpertSegments& seg, const float* dy, const float* h) = 0;

  virtual void collect(ParamList& out) = 0;
  virtual void allocate_grads() = 0;

 protected:
  // Matrix `part` (0 gate, 1 up, 2 down) of local expert e is W [out, in]: gate and up
  // [hidden, dim], down [dim, hidden].
  // y[m, cn] = x[m, in] · W[c0 : c0 + cn, :]ᵀ
  virtual void times_weight_t(int64_t e, int part, int64_t m, const float* x, int64_t ldx,
                              int64_t c0, int64_t cn, float* y, int64_t ldy,
                              ExpertActivations activations) const = 0;
  // dx[m, cn] (+)= dy[m, out] · W[:, c0 : c0 + cn]   (c0 a multiple of 32)
  virtual void times_weight(int64_t e, int part, int64_t m, const float* dy, int64_t lddy,
                            int64_t c0, int64_t cn, float* dx, int64_t lddx,
                            bool accumulate) const = 0;
};

// fp32 master weights. Gate‖up of all local experts is one block [count, 2·hidden, dim] and
// down one block [count, dim, hidden], both in one Weights allocation; every HF key
// (experts.M.{gate,up,down}_proj.weight) is a Param whose value is a view into it, and
// allocate_grads() lays the grads out the same way in one Grads allocation.
class DenseExpertWeights : public ExpertWeights {
 public:
  // prefix like "model.layers.3.mlp." (keys "experts.M.{gate,up,down}_proj.weight" follow, M
  // global; "experts.M.w{1,3,2}.weight" with FfnKeys::V4).
  void init(const std::string& prefix, ExpertRange experts, int64_t dim, int64_t hidden,
            FfnKeys keys = FfnKeys::Hf);

  int64_t dim() const override { return dim_; }
  int64_t hidden() const override { return hidden_; }
  ExpertRange experts() const override { return range_; }

  bool trainable() const override { return !frozen_; }
  // Frozen fp32 experts (the baseline packed experts are measured against): no gradients, no
  // saved inputs. Call before allocate_grads.
  void freeze();
  void gate_up_backward_weight(const ExpertSegments& seg, const float* dg, const float* du,
                               const float* x) override;
  void down_backward_weight(const ExpertSegments& seg, const float* dy, const float* h) override;
  void collect(ParamList& out) override;
  void allocate_grads() override;

  // [count, 2·hidden, dim] and [count, dim, hidden] views of the weight (grad) storage.
  Tensor gate_up_block() const { return gate_up_; }
  Tensor down_block() const { return down_; }
  Tensor gate_up_grad_block() const { return gate_up_grad_; }
  Tensor down_grad_block() const { return down_grad_; }

  // Per local expert e: gate(e), up(e), down(e).
  Param& gate(int64_t e) { return params_[static_cast<size_t>(3 * e)]; }
  Param& up(int64_t e) { return params_[static_cast<size_t>(3 * e + 1)]; }
  Param& down(int64_t e) { return params_[static_cast<size_t>(3 * e + 2)]; }
  const Param& gate(int64_t e) const { return params_[static_cast<size_t>(3 * e)]; }
  const Param& up(int64_t e) const { return params_[static_cast<size_t>(3 * e + 1)]; }
  const Param& down(int64_t e) const { return params_[static_cast<size_t>(3 * e + 2)]; }

 protected:
  // Fp32 only: fp32 experts have no int8-activation kernel.
  void times_weight_t(int64_t e, int part, int64_t m, const float* x, int64_t ldx, int64_t c0,
                      int64_t cn, float* y, int64_t ldy,
                      ExpertActivations activations) const override;
  void times_weight(int64_t e, int part, int64_t m, const float* dy, int64_t lddy, int64_t c0,
                    int64_t cn, float* dx, int64_t lddx, bool accumulate) const override;

 private:
  const Param& matrix(int64_t e, int part) const {
    return params_[static_cast<size_t>(3 * e + part)];
  }

  int64_t dim_ = 0, hidden_ = 0;
  ExpertRange range_;
  bool frozen_ = false;
  Tensor gate_up_, down_, gate_up_grad_, down_grad_;
  std::vector<Param> params_;  // sized once in init: ParamList holds pointers into it
};

}  // namespace moe
