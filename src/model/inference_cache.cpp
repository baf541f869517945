#include "model/inference_cache.h"

#include "core/error.h"

namespace moe {

InferenceCache::InferenceCache(int64_t slots, int64_t max_len) : slots_(slots), max_len_(max_len) {
  MOE_CHECK(slots >= 1 && max_len >= 1,
            "KV cache: need at least one sequence slot and one position, got {} x {}", slots,
            max_len);
  taken_.assign(static_cast<size_t>(slots), false);
}

int64_t InferenceCache::acquire() {
  for (size_t s = 0; s < taken_.size(); ++s)
    if (!taken_[s]) {
      taken_[s] = true;
      return static_cast<int64_t>(s);
    }
  return -1;
}

void InferenceCache::release(int64_t slot) {
  MOE_CHECK(slot >= 0 && slot < slots_ && taken_[static_cast<size_t>(slot)],
            "KV cache: releasing slot {} which is not in use", slot);
  taken_[static_cast<size_t>(slot)] = false;
}

int64_t InferenceCache::free_slots() const {
  int64_t n = 0;
  for (bool t : taken_) n += !t;
  return n;
}

}  // namespace moe
