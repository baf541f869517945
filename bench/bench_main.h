#pragma once
// The main() of the Google Benchmark programs: the engine's thread count from
// MOE_BENCH_THREADS (default 2, the CI machine's cores), then the benchmarks.
#include <benchmark/benchmark.h>

#include <cstdlib>

#include "core/parallel.h"

namespace moe::bench {

inline int run_benchmarks(int argc, char** argv) {
  const char* env = std::getenv("MOE_BENCH_THREADS");
  set_num_threads(env ? std::atoi(env) : 2);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace moe::bench
