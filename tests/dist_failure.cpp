// Failure injection for expert parallelism (issue 4): rank 1 throws in the middle of a run of
// MoE-layer forwards while the other ranks go on into the next all-to-all. Every rank must end
// with a non-zero exit and the cause printed, within seconds, never a hang. Run by ctest under
// mpirun with a timeout (tests/CMakeLists.txt checks the exit status and the message).
//
//   dist_failure run-or-abort   the exception reaches run_or_abort (prints, MPI_Abort)
//   dist_failure unwind         the exception unwinds through MpiRuntime (its destructor aborts)
//   dist_failure ok             no failure: exits 0 after MPI_Finalize (the control)
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "parallel/all_to_all_dispatcher.h"
#include "parallel/communicator.h"
#include "moe/moe_layer.h"

using namespace moe;

namespace {

int forwards(Communicator& world, bool inject) {
  auto comm = std::shared_ptr<Communicator>(world.split(0, world.rank()));
  AllToAllDispatcher disp(comm);
  ModelConfig c;
  c.hidden_size = 16;
  c.moe_intermediate_size = 8;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 1;
  MoELayer layer;
  layer.init("model.layers.1.mlp.", c, disp);
  ParamList ps;
  layer.collect(ps);
  Rng rng(3);
  for (Param* p : ps)
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] = 0.2f * rng.normal();
  Tensor x = Tensor::empty({8, 16}, DType::F32, MemCategory::Scratch);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = rng.normal();
  for (int step = 0; step < 5; ++step) {
    if (inject && step == 2 && comm->rank() == 1)
      fail("injected failure on rank 1 at step {}", step);
    Tensor y = layer.forward(x, {1, 8}, Pass::Eval);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "run-or-abort";
  if (mode == "unwind") {
    try {
      MpiRuntime mpi(&argc, &argv);
      auto world = make_world_communicator();
      forwards(*world, true);
    } catch (const std::exception& e) {
      // Not reached on a multi-rank run: MpiRuntime's destructor aborted the job while unwinding.
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  MpiRuntime mpi(&argc, &argv);
  return run_or_abort([&] {
    auto world = make_world_communicator();
    return forwards(*world, mode != "ok");
  });
}
