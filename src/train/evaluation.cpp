#include "train/evaluation.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "parallel/communicator.h"
#include "model/model.h"

namespace moe {

double evaluate(CausalLM& model, const PackedSequences& data, int64_t batch, int64_t max_batches) {
  double sum = 0;
  int64_t tokens = 0;
  int64_t batches = 0;
  for (int64_t i = 0; i < data.size() && (max_batches == 0 || batches < max_batches); i += batch) {
    std::vector<int64_t> idx;
    for (int64_t j = i; j < std::min(data.size(), i + batch); ++j) idx.push_back(j);
    const Batch b = make_batch(data, idx);
    const LossResult r = model.forward(b.tokens, b.targets, b.shape, Pass::Eval);
    sum += r.ce * static_cast<double>(r.tokens);
    tokens += r.tokens;
    ++batches;
  }
  // An Eval forward must keep nothing; a leak here would grow with every validation.
  MOE_CHECK(!model.has_saved(), "internal: a validation forward left saved state behind");
  return tokens > 0 ? sum / static_cast<double>(tokens) : std::numeric_limits<double>::quiet_NaN();
}

double evaluate(CausalLM& model, const PackedSequences& data, int64_t batch,
                int64_t max_batches, Communicator& world) {
  const int64_t w = world.size(), rank = world.rank();
  if (w == 1) return evaluate(model, data, batch, max_batches);
  MOE_CHECK(batch % w == 0, "evaluate: batch {} is not divisible by the {} ranks", batch, w);
  const int64_t part = batch / w;
  double sums[2] = {0, 0};  // Σ ce·tokens, Σ tokens
  for (int64_t g = 0; max_batches == 0 || g < max_batches; ++g) {
    // Does this rank's data hold global batch g at all? The minimum over ranks decides for
    // everyone, so ranks whose data differ in length still stop at the same batch.
    int64_t have = g * batch < data.size() ? 1 : 0;
    world.all_reduce_min(&have, 1);
    if (have == 0) break;
    const int64_t first = g * batch + rank * part;
    const int64_t last = std::min(data.size(), first + part);
    std::vector<int64_t> idx;
    for (int64_t j = first; j < last; ++j) idx.push_back(j);
    // A rank whose part of the tail batch is empty still takes part in the forward (it is a
    // collective under expert parallelism) with one sequence whose targets are all ignored.
    Batch b = make_batch(data, idx.empty() ? std::vector<int64_t>{0} : idx);
    if (idx.empty()) std::fill(b.targets.i32(), b.targets.i32() + b.targets.numel(), kIgnoreIndex);
    const LossResult r = model.forward(b.tokens, b.targets, b.shape, Pass::Eval);
    if (r.tokens == 0) continue;
    sums[0] += r.ce * static_cast<double>(r.tokens);
    sums[1] += static_cast<double>(r.tokens);
  }
  MOE_CHECK(!model.has_saved(), "internal: a validation forward left saved state behind");
  world.all_reduce_sum(sums, 2);
  return sums[1] > 0 ? sums[0] / sums[1] : std::numeric_limits<double>::quiet_NaN();
}

nlohmann::json memory_json() {
  const MemSnapshot s = MemoryTracker::instance().snapshot();
  nlohmann::json current = nlohmann::json::object(), peak = nlohmann::json::object();
  for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c) {
    const char* name = mem_category_name(static_cast<MemCategory>(c));
    current[name] = s.current[static_cast<size_t>(c)];
    peak[name] = s.peak[static_cast<size_t>(c)];
  }
  return {{"current", current}, {"peak", peak}};
}

nlohmann::json expert_load_json(const CausalLM& model) {
  std::vector<int64_t> layer_ids;
  const ModelConfig& c = model.config();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (c.is_moe_layer(l)) layer_ids.push_back(l);
  const auto layers = model.moe_layers();
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<int64_t>& counts = layers[i]->expert_counts();
    int64_t max = 0, sum = 0;
    for (int64_t n : counts) max = std::max(max, n), sum += n;
    const double mean =
        counts.empty() ? 0.0 : static_cast<double>(sum) / static_cast<double>(counts.size());
    out.push_back({{"layer", i < layer_ids.size() ? layer_ids[i] : static_cast<int64_t>(i)},
                   {"max", max},
                   {"mean", mean},
                   {"counts", counts}});
  }
  return out;
}

}  // namespace moe
