#pragma once
// Learning rate per optimizer step: linear warmup to the peak, then cosine decay to min_lr at
// the last step (or constant at the peak).
#include <cstdint>

namespace moe {

struct LrSchedule {
  double peak = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  bool cosine = true;

  // `step` counts from 0. Warmup starts at peak/warmup_steps rather than 0, so the first
  // update already moves the weights.
  double at(int64_t step) const;
};

}  // namespace moe
