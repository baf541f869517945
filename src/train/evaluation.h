#pragma once
// Validation loss and the per-step measurements written to the metrics log.
#include <cstdint>
#include <nlohmann/json.hpp>

#include "data/packing.h"

namespace moe {

class DeepSeekModel;

// Mean cross-entropy over `data` (all of it, or the first `max_batches` batches), weighted by
// counted tokens, in Pass::Eval. NaN for empty data.
double evaluate(DeepSeekModel& model, const PackedSequences& data, int64_t batch, int64_t max_batches);

// Tracked memory by category: {"current": {...}, "peak": {...}} in bytes.
nlohmann::json memory_json();

// Per MoE layer: tokens routed to each expert (the report's heat map), to the busiest one and
// the mean per expert, over the Train forwards since the last bias update (so: read it before
// update_router_biases).
nlohmann::json expert_load_json(const DeepSeekModel& model);

}  // namespace moe
