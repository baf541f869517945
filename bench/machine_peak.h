#pragma once
// The denominators the benchmarks state their rates against, measured in the same run: the fp32
// FMA peak of the cores (the physical limit, kernels/fma_peak.h), the engine's own GEMM on an n³
// product (what a perfectly GEMM-bound step could reach); the DRAM read bandwidth is
// kernels/read_bandwidth.h.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "kernels/gemm.h"

namespace moe::bench {

// Best of `reps` gemm_nt products n × n × n after one warm-up, in GFLOP/s.
inline double gemm_rate_gflops(int64_t n, int reps) {
  std::vector<float> a(static_cast<size_t>(n * n)), b(a.size()), c(a.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = b[i] = 1e-3f * static_cast<float>(i % 17);
  gemm_nt(n, n, n, a.data(), n, b.data(), n, c.data(), n, false);
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm_nt(n, n, n, a.data(), n, b.data(), n, c.data(), n, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / s / 1e9);
  }
  return best;
}

}  // namespace moe::bench
