#pragma once
// Per-thread working memory of the matmul kernels (packed panels, decoded tiles): 64-byte
// aligned, grown on demand, kept for later calls and charged to MemCategory::Workspace while it
// lives, so the memory reports see it. Its size is bounded by the kernels' block sizes, never by
// the operands.
#include <cstdint>

namespace moe {

// `slot` tells apart buffers used at the same time by one kernel (0..3).
float* kernel_scratch(int slot, int64_t floats);

}  // namespace moe
