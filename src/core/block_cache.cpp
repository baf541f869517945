#include "core/block_cache.h"

#include <sys/mman.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "core/error.h"
#include "core/memory.h"

namespace moe {

namespace {

// Large blocks are 2 MiB multiples, 2 MiB aligned: huge-page friendly, and similar requests
// (row counts vary a little from step to step with the routing) map to the same sizes.
constexpr size_t kGranule = size_t{2} << 20;

size_t round_large(size_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

struct Cache {
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;  // by size
  size_t cached = 0;
  int64_t hits = 0, misses = 0;
};

#ifdef __GLIBC__
// glibc gives a freed chunk above its mmap threshold (128 KiB at first, raised to the size of
// each mmapped chunk freed) back to the kernel, and trims the top of a heap once 128 KiB or
// twice that threshold is free there. A training step frees its activations in reverse order of
// allocation, so the next step page-faulted most of them in again: 14,500 faults per step of
// the `small` model (perf stat, 20 steps), 3-7% of its tokens/s on a Zen 5. Blocks under
// kMinCachedBlock now stay in the heap, and up to kMaxCachedBytes of free heap top stays
// mapped: the same bound the block cache keeps. With small_block below, about 90 faults per step
// are left, and the peak RSS fell 12%.
// Settings the user gave glibc (GLIBC_TUNABLES, MALLOC_*_) are left as they are.
bool user_tuned_malloc() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) ||
         std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
         std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr;
}
[[maybe_unused]] const bool malloc_keeps_freed_memory = [] {
  if (user_tuned_malloc()) return false;
  static_assert(kMinCachedBlock <= (size_t{32} << 20), "glibc's largest mmap threshold is 32 MiB");
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMinCachedBlock)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMaxCachedBytes)) == 1;
}();
#endif

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: tensors may be freed during static teardown
  return *c;
}

void release_all(Cache& c);

// `alloc()`, tried again after handing back the cached blocks (worth less than this
// allocation) when it fails; never null.
template <typename Alloc>
void* allocate_or_fail(size_t bytes, Alloc&& alloc) {
  void* p = alloc();
  if (p == nullptr) {
    release_all(cache());
    p = alloc();
  }
  MOE_CHECK(p != nullptr, "out of memory allocating {}", format_bytes(static_cast<int64_t>(bytes)));
  return p;
}

// A small block: malloc'd with 64 bytes to spare and aligned by hand, the malloc'd address kept
// just before the block. aligned_alloc would split off a small chunk in front of each block,
// which glibc keeps in its per-thread cache between the large free chunks, so they could not
// merge, and the heap grew by what a step freed for ten steps or more (a step of 1-16 MiB
// blocks: 200 MiB of heap for 31 MiB of blocks).
void* small_block(size_t bytes) {
  void* base = allocate_or_fail(bytes, [&] { return std::malloc(bytes + 64); });
  const auto at = (reinterpret_cast<uintptr_t>(base) + 64) & ~uintptr_t{63};
  void* data = reinterpret_cast<void*>(at);  // malloc aligns to 8 at least
  static_cast<void**>(data)[-1] = base;
  return data;
}
void free_small_block(void* data) { std::free(static_cast<void**>(data)[-1]); }

// A large block: 2 MiB aligned, offered to transparent huge pages.
void* large_block(size_t bytes) {
  void* p = allocate_or_fail(bytes, [&] { return std::aligned_alloc(kGranule, bytes); });
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
  return p;
}

void release_all(Cache& c) {
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto& [size, p] : c.free_blocks) std::free(p);
  c.free_blocks.clear();
  c.cached = 0;
}

}  // namespace

HostBlock allocate_block(size_t bytes) {
  if (bytes < kMinCachedBlock) {
    const size_t size = (bytes + 63) & ~size_t{63};
    return {small_block(size), size};
  }
  const size_t size = round_large(bytes);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    // The smallest cached block that fits, unless more than a fifth of it would go unused.
    const auto it = c.free_blocks.lower_bound(size);
    if (it != c.free_blocks.end() && 4 * it->first <= 5 * size) {
      const HostBlock b{it->second, it->first};
      c.cached -= it->first;
      c.free_blocks.erase(it);
      ++c.hits;
      return b;
    }
    ++c.misses;
  }
  return {large_block(size), size};
}

void free_block(const HostBlock& block) {
  if (block.data == nullptr) return;
  if (block.reserved < kMinCachedBlock) {
    free_small_block(block.data);
    return;
  }
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.free_blocks.emplace(block.reserved, block.data);
  c.cached += block.reserved;
  while (c.cached > kMaxCachedBytes) {  // the largest go first: they free the most per call
    auto largest = std::prev(c.free_blocks.end());
    c.cached -= largest->first;
    std::free(largest->second);
    c.free_blocks.erase(largest);
  }
}

BlockCacheStats block_cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return {static_cast<int64_t>(c.cached), c.hits, c.misses};
}

void release_cached_blocks() { release_all(cache()); }

}  // namespace moe
