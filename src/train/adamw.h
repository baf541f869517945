#pragma once
// AdamW with fp32 moments and decoupled weight decay, step for step as torch.optim.AdamW, plus
// global gradient-norm clipping as torch.nn.utils.clip_grad_norm_.
#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "kernels/vector_math.h"
#include "model/param.h"

namespace moe {

struct AdamWConfig {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // applied only to params with weight_decay == true
};

class AdamW : public PendingUpdate {
 public:
  AdamW(ParamList params, const AdamWConfig& cfg);
  ~AdamW() override;
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update at learning rate `lr`; params without a gradient are skipped. Gradients are read
  // as g * grad_scale, which applies global-norm clipping without a pass of its own.
  void step(double lr, float grad_scale = 1.0f);
  // The same update, started on the pool's workers in parameter order, and returned from at
  // once: the caller's next forward waits layer by layer (wait_for) while the update of the
  // later layers runs beside it. The update consumes the gradients: each chunk's gradient is
  // zeroed right after it is read, ready for the next step's accumulation, so that no pass of
  // its own zeroes them. Anything else that reads or writes the parameters, moments or
  // gradients calls finish() first.
  void start_step(double lr, float grad_scale = 1.0f);
  // Completes a started update (helping with what is left); nothing when none is running.
  void finish();
  bool running() const override { return running_; }
  void wait_for(const ParamList& params) override;
  void wait_all() override { finish(); }

  int64_t steps() const { return step_; }
  void set_steps(int64_t s) { step_ = s; }
  const AdamWConfig& config() const { return cfg_; }
  // Moments in parameter order, for checkpoints.
  const std::vector<Tensor>& first_moments() const { return m_; }
  const std::vector<Tensor>& second_moments() const { return v_; }
  const ParamList& params() const { return params_; }

 private:
  // A piece of one parameter: the unit of work, in parameter order.
  struct Chunk {
    int32_t param;
    int64_t offset, n;
  };
  void prepare(double lr, float grad_scale);
  void run_chunk(int64_t c);

  ParamList params_;
  AdamWConfig cfg_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<int64_t> first_chunk_;  // per param, chunks [first_chunk_[i], first_chunk_[i + 1])
  std::unordered_map<const Param*, size_t> index_of_;
  // The update that last wrote each chunk: a started update's progress, without a reset per
  // update. Counted apart from step_, which a checkpoint's restore may set back.
  int64_t generation_ = 0;
  std::unique_ptr<std::atomic<int64_t>[]> chunk_done_;
  std::vector<float> decay_;  // per param, for the running update
  AdamWRowParams row_;
  bool zero_grads_ = false;
  bool running_ = false;
  struct Runner {
    AdamW* self;
    void operator()(int64_t c) const { self->run_chunk(c); }
  } runner_{this};
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
