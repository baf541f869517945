#pragma once
// The machine's fp32 GEMM rate through the engine's own GEMM path: the denominator of MFU.
// Measured rather than taken from a spec sheet, because what matters is what this build, this
// OpenBLAS kernel and this thread count can actually reach.
#include <cstdint>

namespace moe {

// Best of a few n x n x n gemm_nt products after one warm-up, in GFLOP/s, at the current thread
// count. A process measures once per thread count (about half a second on two cores) and reuses
// the figure afterwards.
double gemm_peak_gflops(int64_t n = 1536, int reps = 3);

}  // namespace moe
