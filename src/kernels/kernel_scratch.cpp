#include "kernels/kernel_scratch.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "core/error.h"
#include "core/memory.h"

namespace moe {

namespace {

constexpr int kSlots = 4;

struct ThreadScratch {
  float* data[kSlots] = {};
  int64_t floats[kSlots] = {};
  ~ThreadScratch() {
    for (int s = 0; s < kSlots; ++s)
      if (data[s]) {
        std::free(data[s]);
        MemoryTracker::instance().on_free(MemCategory::Workspace, floats[s] * 4);
      }
  }
};

}  // namespace

float* kernel_scratch(int slot, int64_t floats) {
  MOE_CHECK(slot >= 0 && slot < kSlots, "kernel_scratch: slot {} out of range", slot);
  thread_local ThreadScratch t;
  if (t.floats[slot] < floats) {
    const int64_t grown = (floats + 15) / 16 * 16;
    void* p = std::aligned_alloc(64, static_cast<size_t>(grown) * 4);
    if (!p) throw std::bad_alloc();
    // Touched now, so the process holds what the tracker counts: a call that packs only a few
    // rows would otherwise fault in the rest of the buffer at some later step, and the RSS
    // would rise where the tracked memory is flat (or hide an untracked rise in its place).
    std::memset(p, 0, static_cast<size_t>(grown) * 4);
    if (t.data[slot]) {
      std::free(t.data[slot]);
      MemoryTracker::instance().on_free(MemCategory::Workspace, t.floats[slot] * 4);
    }
    t.data[slot] = static_cast<float*>(p);
    t.floats[slot] = grown;
    MemoryTracker::instance().on_alloc(MemCategory::Workspace, grown * 4);
  }
  return t.data[slot];
}

}  // namespace moe
