#pragma once
// Shared harness of the MPI test programs: the world communicator, cross-rank agreement, and a
// main that works under mpirun or as one plain process.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <memory>
#include <optional>

#include "core/memory.h"
#include "parallel/communicator.h"

namespace moe::testing {

inline std::shared_ptr<Communicator> g_world;

// Every rank agrees whether all ranks passed (so a failure on one rank shows on all).
inline bool all_ranks(bool ok) {
  int64_t bad = ok ? 0 : 1;
  g_world->all_reduce_sum(&bad, 1);
  return bad == 0;
}

// Resident set size in bytes, from /proc/self/status; -1 where there is none (not Linux).
// glibc keeps freed heap pages resident until the top of the heap is trimmed, and with the
// all-to-all sizes changing every step that free-but-resident heap swings by up to ~150 kB
// (0.6% of RSS at np 2) from one reading to the next, so a single reading would measure where
// the allocator happened to be. Trimming first counts only pages that hold live allocations.
inline int64_t rss_bytes() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "... kB"
  return -1;
}

// How many steps a memory proof runs: 1,000 unless MOE_MEMORY_STEPS says otherwise (the
// sanitizer build runs fewer; each of its steps is slower, the check is the same).
inline int memory_proof_steps() {
  const char* env = std::getenv("MOE_MEMORY_STEPS");
  const int n = env != nullptr ? std::atoi(env) : 0;
  return n >= 20 ? n : 1000;
}

inline int64_t routing_bytes() { return MemoryTracker::instance().current(MemCategory::Routing); }

// The body of main(): starts MPI when launched by mpirun, runs the tests, and exits non-zero on
// every rank when any rank failed.
inline int run_mpi_tests(int argc, char** argv) {
  std::optional<MpiRuntime> mpi;
  if (MpiRuntime::launched_by_mpirun()) mpi.emplace(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  g_world = make_world_communicator();
  std::printf("rank %d of %d (%s)\n", g_world->rank(), g_world->size(), g_world->name().c_str());
  const int rc = RUN_ALL_TESTS();
  int64_t failed = rc != 0;
  g_world->all_reduce_sum(&failed, 1);
  g_world.reset();
  return failed ? 1 : 0;
}

}  // namespace moe::testing
