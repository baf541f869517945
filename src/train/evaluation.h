#pragma once
// Validation loss and the per-step measurements written to the metrics log.
#include <cstdint>
#include <nlohmann/json.hpp>

#include "data/packing.h"

namespace moe {

class Communicator;
class DeepSeekModel;

// Mean cross-entropy over `data` (all of it, or the first `max_batches` batches), weighted by
// counted tokens, in Pass::Eval. NaN for empty data.
double evaluate(DeepSeekModel& model, const PackedSequences& data, int64_t batch, int64_t max_batches);

// The same over the ranks of `world` (every rank calls it with the same data): global batch g
// holds sequences [g·batch, (g+1)·batch), and rank r evaluates the r-th of W parts of batch / W
// sequences (batch must be divisible by W). At the tail some parts are short or empty, and an
// expert-parallel forward is a collective, so a rank that ran out cannot simply leave: before
// each batch the ranks agree with one all_reduce_min whether every rank still has sequences, and
// the loop ends for all of them at the first batch where one has none (those tail sequences are
// not evaluated). The result is the token-weighted mean over every evaluated token of every
// rank, identical on all ranks.
double evaluate(DeepSeekModel& model, const PackedSequences& data, int64_t batch,
                int64_t max_batches, Communicator& world);

// Tracked memory by category: {"current": {...}, "peak": {...}} in bytes.
nlohmann::json memory_json();

// Per MoE layer: tokens routed to each expert (the report's heat map), to the busiest one and
// the mean per expert, over the Train forwards since the last bias update (so: read it before
// update_router_biases).
nlohmann::json expert_load_json(const DeepSeekModel& model);

}  // namespace moe
