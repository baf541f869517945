#pragma once
// Host memory for tensor storage. Blocks below 32 MiB come from malloc, whose heap recycles
// them once glibc is told to keep what is freed (see block_cache.cpp); larger ones are kept in
// a cache when freed and handed out again for the next request of a similar size, the way
// PyTorch's caching allocator works. Why: glibc serves blocks of 32 MiB and more with a fresh
// mmap every time, so a 100 MB buffer allocated each step is page-faulted and zeroed by the
// kernel each step (measured: 55% of the expert-parallel dispatch time at dim 1024, 4096
// tokens). Fresh large blocks are also offered to transparent huge pages (madvise), 512x fewer
// faults. Caching from 1 MiB up cost the small training run 12% more peak RSS (rounding and
// fragmentation) for no speed, hence the 32 MiB floor.
//
// The MemoryTracker keeps counting the bytes tensors use; cached blocks are "reserved", not
// "allocated", and are bounded: at most kMaxCachedBytes stay cached (the largest go first).
#include <cstddef>
#include <cstdint>

namespace moe {

inline constexpr size_t kMinCachedBlock = size_t{32} << 20;
inline constexpr size_t kMaxCachedBytes = size_t{1} << 30;

struct HostBlock {
  void* data = nullptr;
  size_t reserved = 0;  // what free_block needs back (>= the request)
};

// 64-byte aligned, never null (an out-of-memory is a moe::Error naming the size).
HostBlock allocate_block(size_t bytes);
void free_block(const HostBlock& block);

struct BlockCacheStats {
  int64_t cached_bytes = 0;  // free blocks held for reuse
  int64_t hits = 0, misses = 0;
};
BlockCacheStats block_cache_stats();
// Returns every cached block to the system.
void release_cached_blocks();

}  // namespace moe
