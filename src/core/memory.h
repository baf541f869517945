#pragma once
// Every tensor allocation is charged to one category, so reports can prove memory is flat
// across steps and that (for example) routing state is released when its backward ran.
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace moe {

// Workspace: the kernels' per-thread packing buffers (bounded by block sizes, kept for reuse).
// Adapter*: LoRA adapters (their matrices, gradients and AdamW moments), apart from the base
// model's so a fine-tune's report shows what the adapters cost.
// KvCache: inference caches (model/inference_cache.h), preallocated per sequence slot.
enum class MemCategory : int {
  Weights = 0, Grads, Optimizer, Activations, Routing, Scratch, Workspace,
  AdapterWeights, AdapterGrads, AdapterOptimizer, KvCache, Count
};

// The category of a parameter's gradient (or optimizer state) given its value's category.
MemCategory grad_category_of(MemCategory value);
MemCategory optimizer_category_of(MemCategory value);

const char* mem_category_name(MemCategory c);

struct MemSnapshot {
  std::array<int64_t, static_cast<int>(MemCategory::Count)> current{};
  std::array<int64_t, static_cast<int>(MemCategory::Count)> peak{};
  std::array<int64_t, static_cast<int>(MemCategory::Count)> largest_allocation{};
  int64_t total_current() const;
  int64_t total_peak() const;
  int64_t operator[](MemCategory c) const { return current[static_cast<int>(c)]; }
};

class MemoryTracker {
 public:
  static MemoryTracker& instance();
  void on_alloc(MemCategory c, int64_t bytes);
  void on_free(MemCategory c, int64_t bytes);
  int64_t current(MemCategory c) const;
  MemSnapshot snapshot() const;
  // Peaks and largest-allocation marks restart from the current level (e.g. per phase).
  void reset_peaks();
  std::string report() const;

 private:
  static constexpr int kN = static_cast<int>(MemCategory::Count);
  std::array<std::atomic<int64_t>, kN> current_{};
  std::array<std::atomic<int64_t>, kN> peak_{};
  std::array<std::atomic<int64_t>, kN> largest_{};
};

std::string format_bytes(int64_t bytes);

}  // namespace moe
