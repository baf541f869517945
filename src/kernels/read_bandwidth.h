#pragma once
// The machine's DRAM read bandwidth: the physical limit of anything that streams weights (decode,
// the MXFP4 expert matmuls at one token). Measured as the best a reader can do, not what a naive
// loop gets: the widest vector loads the CPU has (whatever SIMD target is forced), eight
// interleaved streams per thread (one stream per core leaves a server core's memory-level
// parallelism idle), from a buffer in the engine's allocator (huge pages where offered, so the
// hardware prefetchers are not stopped at every 4 KiB page).

#include <cstdint>

namespace moe {

// The last-level cache's size (64 MiB where the system does not say): what a working set must
// exceed many times over to be measured from DRAM.
int64_t last_level_cache_bytes();

// One core's L2 size (1 MiB where the system does not say): what a working set meant to stay
// next to the core must fit.
int64_t l2_cache_bytes();

// GB/s read by `threads` threads together, best of 5 passes over max(1 GiB, 4 × the last-level
// cache).
double measure_dram_read_gbs(int threads);

}  // namespace moe
