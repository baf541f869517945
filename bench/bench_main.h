#pragma once
// The main() of the Google Benchmark programs: the engine's thread count from
// MOE_BENCH_THREADS (default 2, the CI machine's cores; a program may fix it instead) and the
// SIMD target from MOE_SIMD, the fp32 FMA peak of those measured once at the start (the
// denominator of every "of_fma_peak" counter), then the benchmarks, then the peak once more: a
// guest whose clock moves during the run (measured on a Zen 3 VM: 2.45 or 3.12 GHz from one
// run to the next) makes every ratio to the first peak wrong, and the second says so.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
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
  const double end = measure_fma_peak(num_threads()).gflops;
  const double moved = end / peak.gflops - 1.0;
  std::printf("fma_peak at the end: %.0f GFLOP/s (%+.1f%% from the start)%s\n", end, 100.0 * moved,
              std::fabs(moved) > 0.05 ? ": the clock moved during the run; the of_fma_peak "
                                        "ratios are to the start's peak"
                                      : "");
  return 0;
}

}  // namespace moe::bench
