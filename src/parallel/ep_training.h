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
#include <memory>

#include "parallel/communicator.h"
#include "model/model.h"

namespace moe {

class Dispatcher;

// The communicators of one expert-parallel layout. With W world ranks and EP size e (e divides
// W), world rank w sits at position w % e of EP group w / e (the ranks that split the experts
// between them) and holds expert shard w % e; the W / e ranks holding the same shard form its
// replica group. e = 1 is plain data parallelism (every rank holds every expert), e = W one
// copy of each expert. One process: W = e = 1, every communicator local.
struct ExpertParallelGroups {
  std::shared_ptr<Communicator> world, ep_group, replicas;
  int ep_size = 1;
  int ep_rank = 0;       // position in the EP group = the expert shard held
  int replica_rank = 0;  // which copy of that shard
  bool is_main() const { return world->rank() == 0; }
  // One rank per expert shard writes it to a checkpoint (the first replica).
  bool writes_experts() const { return replica_rank == 0; }
};

// Splits `world` for EP size `ep_size` (collective). Errors name `field` when ep_size does not
// divide the world size or the expert count (`num_experts`, 0 for a dense model).
ExpertParallelGroups make_expert_parallel_groups(std::shared_ptr<Communicator> world,
                                                 int64_t ep_size, int64_t num_experts,
                                                 const std::string& field);

// The dispatcher for these groups: the local one at EP 1, the all-to-all one otherwise.
std::shared_ptr<Dispatcher> make_dispatcher(const ExpertParallelGroups& groups);

// The L2 norm of the gradient of the whole model, the same on every rank: non-expert squares
// (identical on every rank after reduce_gradients) plus the expert squares summed over the EP
// group (each shard counted once).
double global_grad_norm(const ParamList& params, const ExpertParallelGroups& groups);

// True for parameters that live on only some ranks (routed experts, their adapters included).
bool is_routed_expert_param(const std::string& name);

void sum_router_counts(CausalLM& model, Communicator& world);
void reduce_gradients(CausalLM& model, Communicator& world, Communicator& expert_replicas);

}  // namespace moe
