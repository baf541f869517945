#pragma once
// Per-thread working memory of the matmul kernels (packed panels, decoded tiles): 64-byte
// aligned, grown on demand, kept for later calls and charged to MemCategory::Workspace while it
// lives, so the memory reports see it. Its size is bounded by the kernels' block sizes, never by
// the operands.
#include <cstdint>

namespace moe {

// `slot` tells apart buffers used at the same time by one kernel (0..3).
float* kernel_scratch(int slot, int64_t floats);

// What one kernel call asks of slots 0 and 1, in floats (0: nothing). The kernels report it for
// a shape (gemm.h, mxfp4_gemm.h) from the same block sizes they run with, so the memory plan
// (train/memory_replay.cpp) never restates them.
struct ScratchFloats {
  int64_t slot0 = 0, slot1 = 0;
};

}  // namespace moe
