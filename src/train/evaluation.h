#pragma once
// Validation loss and the per-step measurements written to the metrics log.
#include <cstdint>
#include <nlohmann/json.hpp>

#include "data/packing.h"

namespace moe {

class Communicator;
class CausalLM;

// Mean cross-entropy over `data` (all of it, or the first `max_batches` batches), weighted by
// counted tokens, in Pass::Eval. NaN for empty data.
double evaluate(CausalLM& model, const PackedSequences& data, int64_t batch, int64_t max_batches);

// The same over the ranks of `world`: global batch g holds sequences [g·batch, (g+1)·batch),
// and rank r evaluates the r-th of W parts of batch / W sequences (batch must be divisible by
// W); a rank whose part of the tail batch is empty joins the forward with one fully ignored
// sequence, so every sequence is evaluated, as by one process. An expert-parallel forward is a
// collective, so the ranks must run the same number of batches: before each one they agree
// with one all_reduce_min whether every rank's data still holds it (ranks given data of
// different lengths stop together at the shortest). The result is the token-weighted mean over
// every evaluated token of every rank, identical on all ranks.
double evaluate(CausalLM& model, const PackedSequences& data, int64_t batch,
                int64_t max_batches, Communicator& world);

// Tracked memory by category: {"current": {...}, "peak": {...}} in bytes.
nlohmann::json memory_json();

// Per MoE layer: tokens routed to each expert (the report's heat map), to the busiest one and
// the mean per expert, over the Train forwards since the last bias update (so: read it before
// update_router_biases).
nlohmann::json expert_load_json(const CausalLM& model);

}  // namespace moe
