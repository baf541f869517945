#pragma once
// Order in which training samples are visited: a fresh permutation per epoch, a pure function
// of (seed, epoch), so a position (epoch, index) is all a checkpoint needs to resume the exact
// stream of batches.
#include <cstdint>
#include <vector>

#include "data/packing.h"

namespace moe {

struct DataPosition {
  int64_t epoch = 0;
  int64_t index = 0;  // next sample within the epoch's order
  bool operator==(const DataPosition&) const = default;
};

class TrainSampler {
 public:
  TrainSampler(const PackedSequences& data, uint64_t seed, bool shuffle);

  // The next `batch` samples, continuing into the next epoch when this one runs out.
  Batch next(int64_t batch);
  std::vector<int64_t> next_indices(int64_t batch);
  DataPosition position() const { return pos_; }
  void set_position(DataPosition pos);
  // Sample order of one epoch (identity when shuffling is off).
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  // State of the generator that draws the permutation of `epoch`; checkpoints record it so a
  // resume with a different seed is caught.
  uint64_t epoch_rng_state(int64_t epoch) const;

 private:
  const PackedSequences& data_;
  uint64_t seed_;
  bool shuffle_;
  DataPosition pos_;
  std::vector<int64_t> order_;  // of pos_.epoch
};

}  // namespace moe
