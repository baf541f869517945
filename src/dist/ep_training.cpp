#include "dist/ep_training.h"

#include <cstring>
#include <vector>

namespace moe {

bool is_routed_expert_param(const std::string& name) {
  return name.find("mlp.experts.") != std::string::npos;
}

void sum_router_counts(DeepSeekModel& model, Communicator& world) {
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

void reduce_gradients(DeepSeekModel& model, Communicator& world, Communicator& expert_replicas) {
  std::vector<Param*> shared, experts;
  for (Param* p : model.params()) {
    if (!p->grad.defined()) continue;
    (is_routed_expert_param(p->name) ? experts : shared).push_back(p);
  }
  reduce_group(shared, world);
  reduce_group(experts, expert_replicas);
}

}  // namespace moe
