#pragma once
// The main() of the Google Benchmark programs: the engine's thread count from
// MOE_BENCH_THREADS (default 2, the CI machine's cores; a program may fix it instead) and the
// SIMD target from MOE_SIMD, the fp32 FMA peak of those measured once at the start (the
// denominator of every "of_fma_peak" counter), then the benchmarks.
#include <benchmark/benchmark.h>

#include <cstdlib>

#include "core/parallel.h"
#include "core/simd.h"
#include "kernels/fma_peak.h"

namespace moe::bench {

inline double& fma_peak_gflops() {
  static double peak = 0;
  return peak;
}

// threads > 0: that many, whatever MOE_BENCH_THREADS says (a single-thread benchmark).
inline int run_benchmarks(int argc, char** argv, int threads = 0) {
  const char* env = std::getenv("MOE_BENCH_THREADS");
  set_num_threads(threads > 0 ? threads : env ? std::atoi(env) : 2);
  const FmaPeak peak = measure_fma_peak(num_threads());
  fma_peak_gflops() = peak.gflops;
  benchmark::AddCustomContext("fma_peak", describe(peak));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace moe::bench
