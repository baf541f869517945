#pragma once
// The machine's fp32 FMA peak: the physical limit MFU is stated against. Measured, not taken
// from a spec sheet (clocks under all-core load, the vector width and FMA ports of this CPU):
// every thread runs independent chains of vector FMAs — enough chains to cover the FMA latency
// on every port — for the SIMD target the kernels run on.
#include <string>

namespace moe {

struct FmaPeak {
  double gflops = 0;   // all threads together
  int threads = 0;
  std::string target;  // simd::name of the target measured
  std::string cpu;     // simd::cpu_model()
  bool cached = false; // read from the per-machine cache instead of measured now
  // All threads together reached at least 0.9 × threads × one thread's rate (only such a
  // measurement is cached).
  bool plausible = true;
};

// Measures now (about 0.3 s): best of several short runs on `threads` threads.
FmaPeak measure_fma_peak(int threads);

// The peak for the current SIMD target and `threads`, from the per-machine cache
// ($MOE_CACHE_DIR, else $XDG_CACHE_HOME/moe, else ~/.cache/moe: fma_peak.json, keyed by CPU
// model, target and threads), measured and stored on a miss. MOE_FMA_PEAK=<GFLOP/s> overrides
// it (e.g. a vendor figure); a cache that cannot be written only costs a re-measurement.
FmaPeak fma_peak(int threads);

// "451 GFLOP/s fp32 FMA peak (AVX-512, 2 threads, AMD EPYC ...)"
std::string describe(const FmaPeak& p);

}  // namespace moe
