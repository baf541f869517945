#include "parallel/ep_training.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "parallel/all_to_all_dispatcher.h"
#include "train/adamw.h"

namespace moe {

ExpertParallelGroups make_expert_parallel_groups(std::shared_ptr<Communicator> world,
                                                 int64_t ep_size, int64_t num_experts,
                                                 const std::string& field) {
  const int w = world->size(), rank = world->rank();
  MOE_CHECK(ep_size >= 1 && w % ep_size == 0,
            "{} = {}: the expert-parallel size must divide the number of ranks ({})", field,
            ep_size, w);
  MOE_CHECK(ep_size == 1 || (num_experts > 0 && num_experts % ep_size == 0),
            "{} = {}: the expert-parallel size must divide the number of routed experts ({})",
            field, ep_size, num_experts);
  const int e = static_cast<int>(ep_size);
  ExpertParallelGroups g;
  g.ep_size = e;
  g.ep_rank = rank % e;
  g.replica_rank = rank / e;
  // Two collective splits, in the same order on every rank.
  g.ep_group = world->split(rank / e, rank);
  g.replicas = world->split(rank % e, rank / e);
  g.world = std::move(world);
  return g;
}

std::shared_ptr<Dispatcher> make_dispatcher(const ExpertParallelGroups& groups) {
  if (groups.ep_size == 1) return std::make_shared<LocalDispatcher>();
  return std::make_shared<AllToAllDispatcher>(groups.ep_group);
}

double global_grad_norm(const ParamList& params, const ExpertParallelGroups& groups) {
  ParamList shared, experts;
  for (Param* p : params) (is_routed_expert_param(p->name) ? experts : shared).push_back(p);
  double expert_sq = grad_sum_squares(experts);
  groups.ep_group->all_reduce_sum(&expert_sq, 1);
  return std::sqrt(grad_sum_squares(shared) + expert_sq);
}

bool is_routed_expert_param(const std::string& name) {
  // V2/V3 keys and every family's PEFT adapter keys say mlp.experts., V4's released keys
  // ffn.experts. (its shared experts are ffn.shared_experts.).
  return name.find("mlp.experts.") != std::string::npos ||
         name.find("ffn.experts.") != std::string::npos;
}

void sum_router_counts(CausalLM& model, Communicator& world) {
  if (world.size() == 1) return;
  for (MoELayer* m : model.moe_layers()) {
    std::vector<int64_t>& c = m->expert_counts_mutable();
    world.all_reduce_sum(c.data(), static_cast<int64_t>(c.size()));
  }
}

namespace {

// Packs the gradients into one buffer (params() order, identical on every rank of `comm` by
// construction), reduces once, unpacks. Per-element results equal per-tensor reductions.
void reduce_group(const std::vector<Param*>& ps, Communicator& comm) {
  if (comm.size() == 1 || ps.empty()) return;
  int64_t total = 0;
  for (Param* p : ps) total += p->grad.numel();
  std::vector<float> buf(static_cast<size_t>(total));
  int64_t off = 0;
  for (Param* p : ps) {
    const int64_t n = p->grad.numel();
    std::memcpy(buf.data() + off, p->g(), sizeof(float) * static_cast<size_t>(n));
    off += n;
  }
  comm.all_reduce_sum(buf.data(), total);
  off = 0;
  for (Param* p : ps) {
    const int64_t n = p->grad.numel();
    std::memcpy(p->g(), buf.data() + off, sizeof(float) * static_cast<size_t>(n));
    off += n;
  }
}

}  // namespace

void reduce_gradients(CausalLM& model, Communicator& world, Communicator& expert_replicas) {
  std::vector<Param*> shared, experts;
  for (Param* p : model.trainable_params()) {  // LoRA adapters included
    if (!p->grad.defined()) continue;
    (is_routed_expert_param(p->name) ? experts : shared).push_back(p);
  }
  reduce_group(shared, world);
  reduce_group(experts, expert_replicas);
}

}  // namespace moe
