#pragma once
// AdamW with fp32 moments and decoupled weight decay, step for step as torch.optim.AdamW, plus
// global gradient-norm clipping as torch.nn.utils.clip_grad_norm_.
#include <cstdint>
#include <vector>

#include "model/param.h"

namespace moe {

struct AdamWConfig {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // applied only to params with weight_decay == true
};

enum class GradsAfterStep { Kept, Zeroed };

class AdamW {
 public:
  AdamW(ParamList params, const AdamWConfig& cfg);
  // One update at learning rate `lr`; params without a gradient are skipped. Gradients are read
  // as g * grad_scale, which applies global-norm clipping without a pass of its own. Zeroed:
  // each gradient is set to zero as it is read, so the next step needs no zeroing pass.
  void step(double lr, float grad_scale = 1.0f, GradsAfterStep after = GradsAfterStep::Kept);
  int64_t steps() const { return step_; }
  void set_steps(int64_t s) { step_ = s; }
  const AdamWConfig& config() const { return cfg_; }
  // Moments in parameter order, for checkpoints.
  const std::vector<Tensor>& first_moments() const { return m_; }
  const std::vector<Tensor>& second_moments() const { return v_; }
  const ParamList& params() const { return params_; }

 private:
  ParamList params_;
  AdamWConfig cfg_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

// Global L2 norm of all gradients (fixed-order, in double), and its square.
double grad_norm(const ParamList& params);
double grad_sum_squares(const ParamList& params);
// The factor torch.nn.utils.clip_grad_norm_ applies for a global norm: max_norm / (norm + 1e-6)
// when that is below 1, else 1.
float clip_coefficient(double norm, double max_norm);
// Scales gradients so their global norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm(const ParamList& params, double max_norm);

}  // namespace moe
