#pragma once
// Frozen routed experts kept packed in MXFP4 (SPEC §5, issue 5): 4.25 bits per weight, decoded
// block by block inside the matmuls (kernels/mxfp4_gemm.h), never expanded to fp32.
//
// Storage: one Weights allocation of bytes, laid out like DenseExpertWeights but packed —
// gate‖up data [count, 2·hidden, dim/2], down data [count, dim, hidden/2], then gate‖up scales
// [count, 2·hidden, dim/32] and down scales [count, dim, hidden/32]. Each matrix is exactly its
// checkpoint pair (`experts.M.gate_proj.weight` I8 [out, in/2] + `.scale` F8_E8M0 [out, in/32]),
// so loading is a byte copy and saving writes the same bytes back: no internal repacking.
// Every pair is two Params (ParamFormat::Mxfp4Data / Mxfp4Scales, not trainable) viewing it.
//
// Frozen means: no weight gradients, no optimizer state, and the MoE layer keeps no expert
// inputs for backward (trainable() is false); the input gradients dX = dY·W still flow.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/mxfp4_gemm.h"
#include "moe/expert_weights.h"

namespace moe {

class Mxfp4ExpertWeights : public ExpertWeights {
 public:
  // prefix like "model.layers.3.mlp."; dim and hidden must be multiples of 32. Keys
  // experts.M.{gate,up,down}_proj.{weight,scale}, or w{1,3,2} with FfnKeys::V4.
  void init(const std::string& prefix, ExpertRange experts, int64_t dim, int64_t hidden,
            FfnKeys keys = FfnKeys::Hf);

  int64_t dim() const override { return dim_; }
  int64_t hidden() const override { return hidden_; }
  ExpertRange experts() const override { return range_; }

  bool trainable() const override { return false; }
  void gate_up_backward_weight(const ExpertSegments&, const float*, const float*,
                               const float*) override;
  void down_backward_weight(const ExpertSegments&, const float*, const float*) override;
  void collect(ParamList& out) override;
  void allocate_grads() override {}

  // Bytes of the packed store (data + scales).
  int64_t bytes() const { return storage_.nbytes(); }
  // Local expert e's matrices.
  Mxfp4Matrix gate(int64_t e) const { return matrix(e, 0); }
  Mxfp4Matrix up(int64_t e) const { return matrix(e, 1); }
  Mxfp4Matrix down(int64_t e) const { return matrix(e, 2); }

 protected:
  // Int8: mxfp4_gemm_nt_q8 instead of the exact mxfp4_gemm_nt.
  void times_weight_t(int64_t e, int part, int64_t m, const float* x, int64_t ldx, int64_t c0,
                      int64_t cn, float* y, int64_t ldy,
                      ExpertActivations activations) const override;
  void times_weight(int64_t e, int part, int64_t m, const float* dy, int64_t lddy, int64_t c0,
                    int64_t cn, float* dx, int64_t lddx, bool accumulate) const override;

 private:
  // part 0 gate, 1 up, 2 down.
  Mxfp4Matrix matrix(int64_t e, int part) const;

  int64_t dim_ = 0, hidden_ = 0;
  ExpertRange range_;
  Tensor storage_;
  Tensor gate_up_data_, down_data_, gate_up_scales_, down_scales_;
  std::vector<Param> params_;  // per expert: gate, up, down × (weight, scale)
};

}  // namespace moe
