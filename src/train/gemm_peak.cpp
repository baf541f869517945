#include "train/gemm_peak.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <utility>

#include "core/parallel.h"
#include "core/tensor.h"
#include "kernels/gemm.h"

namespace moe {

namespace {

double measure(int64_t n, int reps) {
  Tensor a = Tensor::zeros({n, n}, DType::F32, MemCategory::Scratch);
  Tensor b = a.clone(MemCategory::Scratch), c = a.clone(MemCategory::Scratch);
  for (int64_t i = 0; i < n * n; ++i) a.f32()[i] = b.f32()[i] = 1e-3f * static_cast<float>(i % 17);
  // The first call pays for page faults and OpenBLAS buffer setup.
  gemm_nt(n, n, n, a.f32(), n, b.f32(), n, c.f32(), n, false);
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm_nt(n, n, n, a.f32(), n, b.f32(), n, c.f32(), n, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(n) * static_cast<double>(n) *
                              static_cast<double>(n) / s / 1e9);
  }
  return best;
}

}  // namespace

double gemm_peak_gflops(int64_t n, int reps) {
  static std::mutex mu;
  static std::map<std::pair<int, int64_t>, double> cache;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(num_threads(), n);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  return cache[key] = measure(n, std::max(1, reps));
}

}  // namespace moe
