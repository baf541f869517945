#pragma once
// Parallel loops with a static partition. Determinism rule for the whole engine: a value is
// always computed by one iteration in a fixed order; reductions split work into chunks whose
// size does not depend on the thread count and add the chunk results in index order.
#include <cstdint>

namespace moe {

void set_num_threads(int n);
int num_threads();

// Fixed chunk length for cross-row reductions (independent of thread count by design).
constexpr int64_t kReduceChunk = 64;

template <typename F>
void parallel_for(int64_t begin, int64_t end, F&& body) {
#pragma omp parallel for schedule(static)
  for (int64_t i = begin; i < end; ++i) body(i);
}

// Dynamic schedule for uneven work (e.g. experts with very different token counts). Still
// deterministic: each index is processed entirely by one thread.
template <typename F>
void parallel_for_dynamic(int64_t begin, int64_t end, F&& body) {
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = begin; i < end; ++i) body(i);
}

}  // namespace moe
