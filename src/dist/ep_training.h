#pragma once
// Cross-rank reductions of one expert-parallel training step (SPEC §4, issue 4).
//
// With W world ranks and EP size e (e divides W), rank w holds the routed experts of its EP
// group position; the ranks holding the same experts form the `expert_replicas` communicator
// (size W / e; e.g. world.split(w % e, w / e)). After backward():
//   reduce_gradients  — every non-expert gradient (any parameter whose name does not contain
//                       "mlp.experts.") summed over the world; every routed-expert gradient
//                       summed over expert_replicas (a no-op when that group has one rank).
//   sum_router_counts — each MoE layer's per-expert token counts summed over the world, so
//                       update_router_biases moves every rank's biases identically.
// Both use Communicator::all_reduce_sum (deterministic: rank-order sums, bitwise identical on
// every rank). Every rank must call them at the same point (collectives).
// Gradient scaling is the caller's: with LossOptions::grad_scale = (rank's counted tokens) /
// (global counted tokens), the summed gradients are those of the global mean loss.
#include "dist/communicator.h"
#include "model/model.h"

namespace moe {

// True for parameters that live on only some ranks (routed experts).
bool is_routed_expert_param(const std::string& name);

void sum_router_counts(DeepSeekModel& model, Communicator& world);
void reduce_gradients(DeepSeekModel& model, Communicator& world, Communicator& expert_replicas);

}  // namespace moe
