#include "model/inference_cache.h"

#include <algorithm>

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

Tensor last_rows_of_chunks(const Tensor& x, std::span<const CachedChunk> chunks) {
  std::vector<int64_t> last;
  int64_t row = 0;
  for (const CachedChunk& c : chunks) {
    row += c.count;
    if (c.count > 0) last.push_back(row - 1);
  }
  Shape shape = x.shape();
  const int64_t per_row = x.numel() / std::max<int64_t>(1, shape[0]);
  shape[0] = static_cast<int64_t>(last.size());
  Tensor picked = Tensor::empty(shape, DType::F32, MemCategory::Activations);
  for (size_t i = 0; i < last.size(); ++i)
    std::copy_n(x.f32() + last[i] * per_row, per_row,
                picked.f32() + static_cast<int64_t>(i) * per_row);
  return picked;
}

int64_t InferenceCache::free_slots() const {
  int64_t n = 0;
  for (bool t : taken_) n += !t;
  return n;
}

}  // namespace moe
