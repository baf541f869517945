#pragma once
// How the grouped expert GEMMs are cut into work items (shared by every ExpertWeights store):
// bounds depend on row counts and shapes only, so a store's results do not depend on the
// thread count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/parallel.h"
#include "moe/expert_weights.h"

namespace moe::expert_items {

// Work-item extents, constants so the decomposition depends on shapes and row counts only.
// An item is one expert's row block against a whole projection (gate, up or down): packing
// costs (rows + cols)·K per item, so wide items keep it small next to the 2·rows·cols·K FLOPs,
// and 512-row blocks still cut the heaviest expert of a skewed batch into several items.
// Measured at dim 1024 / width 704 / 64 experts (bench_moe, 2 threads): 256x256 items reached
// 0.71 of the dense rate, 512 x whole width 0.81-0.85.
constexpr int64_t kRowBlock = 512;
constexpr int64_t kColBlock = 4096;

struct Item {
  int64_t expert, part, r0, rn, c0, cn, cost;
};

// Items in a fixed order (largest first, ties by construction order) so the schedule, while
// free to map items to any thread, never changes what an item computes.
template <typename F>
void run_items(std::vector<Item>& items, F&& body) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  parallel_for_dynamic(0, static_cast<int64_t>(items.size()),
                       [&](int64_t i) { body(items[static_cast<size_t>(i)]); });
}

// Items over the output [rows of expert e, N] for `parts` outputs; K is the contraction length.
inline std::vector<Item> row_items(const ExpertSegments& seg, int64_t parts, int64_t N, int64_t K) {
  std::vector<Item> items;
  for (int64_t e = 0; e < seg.experts(); ++e)
    for (int64_t r0 = 0; r0 < seg.rows(e); r0 += kRowBlock)
      for (int64_t p = 0; p < parts; ++p)
        for (int64_t c0 = 0; c0 < N; c0 += kColBlock) {
          const int64_t rn = std::min(kRowBlock, seg.rows(e) - r0),
                        cn = std::min(kColBlock, N - c0);
          items.push_back({e, p, r0, rn, c0, cn, rn * cn * K});
        }
  return items;
}

// Items over a weight gradient [M, N] per expert and part; the contraction runs over the
// expert's rows (possibly none: the gradient is then left untouched, exactly zero if unused).
inline std::vector<Item> weight_items(const ExpertSegments& seg, int64_t parts, int64_t M, int64_t N) {
  std::vector<Item> items;
  for (int64_t e = 0; e < seg.experts(); ++e)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t r0 = 0; r0 < M; r0 += kColBlock)
        for (int64_t c0 = 0; c0 < N; c0 += kColBlock) {
          const int64_t rn = std::min(kColBlock, M - r0), cn = std::min(kColBlock, N - c0);
          items.push_back({e, p, r0, rn, c0, cn, rn * cn * seg.rows(e)});
        }
  return items;
}


}  // namespace moe::expert_items
