#include "data/sampler.h"

#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace moe {

TrainSampler::TrainSampler(const PackedSequences& data, uint64_t seed, bool shuffle)
    : data_(data), seed_(seed), shuffle_(shuffle) {
  MOE_CHECK(data.size() > 0, "the training data holds no complete sample");
  order_ = epoch_order(0);
}

uint64_t TrainSampler::epoch_rng_state(int64_t epoch) const {
  return Rng(splitmix64(seed_) ^ splitmix64(static_cast<uint64_t>(epoch) + 1)).state();
}

std::vector<int64_t> TrainSampler::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(data_.size()));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!shuffle_) return order;
  Rng rng;
  rng.set_state(epoch_rng_state(epoch));
  // Fisher-Yates; the modulo bias (n / 2^64) is far below anything measurable.
  for (size_t i = order.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng.next_u64() % i);
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

void TrainSampler::set_position(DataPosition pos) {
  MOE_CHECK(pos.epoch >= 0 && pos.index >= 0 && pos.index <= data_.size(),
            "data position (epoch {}, index {}) is outside the data ({} samples per epoch)",
            pos.epoch, pos.index, data_.size());
  if (pos.epoch != pos_.epoch) order_ = epoch_order(pos.epoch);
  pos_ = pos;
}

std::vector<int64_t> TrainSampler::next_indices(int64_t batch) {
  std::vector<int64_t> indices;
  indices.reserve(static_cast<size_t>(batch));
  while (static_cast<int64_t>(indices.size()) < batch) {
    if (pos_.index == data_.size()) {
      pos_ = {pos_.epoch + 1, 0};
      order_ = epoch_order(pos_.epoch);
    }
    indices.push_back(order_[static_cast<size_t>(pos_.index++)]);
  }
  return indices;
}

Batch TrainSampler::next(int64_t batch) { return make_batch(data_, next_indices(batch)); }

}  // namespace moe
