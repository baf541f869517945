#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace moe {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps)
    return peak * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (!cosine) return peak;
  const int64_t decay_steps = total_steps - warmup_steps;
  if (decay_steps <= 1) return peak;
  const double t = std::clamp(static_cast<double>(step - warmup_steps) /
                                  static_cast<double>(decay_steps - 1), 0.0, 1.0);
  return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(3.14159265358979323846 * t));
}

}  // namespace moe
