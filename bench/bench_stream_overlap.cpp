// How much of the DRAM read bandwidth a core keeps while it computes: the access pattern of the
// MXFP4 decode kernels (4 interleaved W rows of 512 bytes, matrices of 1408 rows taken in random
// order, as one token's experts are) with F independent vector FMAs per 64-byte line and no
// decode at all. F = 0 is the pattern's own ceiling; the decode kernels issue about as many
// vector instructions per line as F = 8 (exact path) or F = 4 (int8). Threads: --threads; SIMD
// target: MOE_SIMD.
//
//   build/bench/bench_stream_overlap [--fmas 0,4,8,16] [--threads 2]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <vector>

#include "core/block_cache.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "core/simd.h"
#include "core/threads_together.h"
#include "kernels/read_bandwidth.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench_stream_overlap.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int64_t kRowBytes = 512, kLine = 64, kTileRows = 4;

template <int F>
float stream_matrices(const uint8_t* base, const int64_t* order, int64_t count, int64_t rows, int64_t spread) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t per_line = std::max<int64_t>(1, kLine / (lanes * 4));  // vectors per line
  auto sum = hn::Zero(d);
  hn::Vec<decltype(d)> chain[8];
  for (int c = 0; c < 8; ++c) chain[c] = hn::Set(d, 0.5f + 0.01f * static_cast<float>(c));
  const auto m = hn::Set(d, 0.999f);
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* matrix = base + order[i] * rows * kRowBytes;
    const int64_t quarter = rows / kTileRows;
    for (int64_t t = 0; t < quarter; ++t)
      for (int64_t s = 0; s < kRowBytes; s += kLine)
        for (int64_t b = 0; b < kTileRows; ++b) {
          const int64_t r = spread ? b * quarter + t : t * kTileRows + b;
          const auto* line = reinterpret_cast<const float*>(matrix + r * kRowBytes + s);
          for (int64_t v = 0; v < per_line; ++v) {
            const auto x = hn::LoadU(d, line + v * lanes);
            sum = hn::Add(sum, x);
#pragma GCC unroll 16
            for (int f = 0; f < F; ++f) chain[f % 8] = hn::MulAdd(chain[f % 8], m, x);
          }
        }
  }
  for (int c = 0; c < 8; ++c) sum = hn::Add(sum, chain[c]);
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

float StreamMatrices(const uint8_t* base, const int64_t* order, int64_t count, int64_t rows, int64_t spread, int fmas) {
  switch (fmas) {
    case 0: return stream_matrices<0>(base, order, count, rows, spread);
    case 4: return stream_matrices<4>(base, order, count, rows, spread);
    case 8: return stream_matrices<8>(base, order, count, rows, spread);
    case 12: return stream_matrices<12>(base, order, count, rows, spread);
    default: return stream_matrices<16>(base, order, count, rows, spread);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe {
HWY_EXPORT(StreamMatrices);
}  // namespace moe

using namespace moe;

int main(int argc, char** argv) {
  CLI::App app{"DRAM streaming of the MXFP4 decode pattern with F FMAs per 64-byte line"};
  int threads = available_cpus();
  int64_t rows = 1408;
  std::vector<int> fmas{0, 4, 8, 16};
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  app.add_option("--rows", rows, "W rows per matrix (512 bytes each)")->check(CLI::Range(int64_t{4}, int64_t{1} << 20));
  app.add_option("--fmas", fmas, "FMAs per line to measure (each of 0, 4, 8, 12, 16)")
      ->delimiter(',')
      ->check(CLI::IsMember({0, 4, 8, 12, 16}));
  bool spread = false;
  app.add_flag("--spread", spread, "a tile's 4 rows a quarter of the matrix apart (4 streams) instead of adjacent");
  CLI11_PARSE(app, argc, argv);
  rows = rows / 4 * 4;

  const double dram = measure_dram_read_gbs(threads);
  const int64_t matrix_bytes = rows * 512;
  const int64_t matrices =
      std::max<int64_t>(2 * threads, 4 * std::max<int64_t>(last_level_cache_bytes(), 1 << 28) / matrix_bytes);
  const HostBlock block = allocate_block(static_cast<size_t>(matrices * matrix_bytes));
  std::memset(block.data, 1, static_cast<size_t>(matrices * matrix_bytes));
  const auto* base = static_cast<const uint8_t*>(block.data);
  // Each thread its own matrices, in a random order.
  std::vector<std::vector<int64_t>> order(static_cast<size_t>(threads));
  Rng rng(7);
  for (int64_t i = 0; i < matrices; ++i) order[static_cast<size_t>(i % threads)].push_back(i);
  for (auto& o : order)
    for (size_t i = o.size(); i > 1; --i) std::swap(o[i - 1], o[rng.next_u64() % i]);

  fmt::print("{}, {} threads, {}, {} matrices of {} rows x 512 bytes ({:.0f} MB); DRAM read {:.1f} GB/s\n\n",
             simd::cpu_model(), threads, simd::description(simd::current()), matrices, rows,
             static_cast<double>(matrices * matrix_bytes) / 1e6, dram);
  fmt::print("| FMAs per 64-byte line | GB/s (best of 3) | of DRAM read |\n|---|---|---|\n");
  for (const int f : fmas) {
    double best = 0;
    for (int pass = 0; pass < 3; ++pass) {
      std::vector<float> sink(static_cast<size_t>(threads));
      const double slowest = slowest_seconds_together(threads, [&](int t) {
        const auto& o = order[static_cast<size_t>(t)];
        sink[static_cast<size_t>(t)] =
            MOE_DISPATCH(StreamMatrices)(base, o.data(), static_cast<int64_t>(o.size()), rows, spread ? 1 : 0, f);
      });
      best = std::max(best, static_cast<double>(matrices * matrix_bytes) / slowest / 1e9);
    }
    fmt::print("| {} | {:.1f} | {:.2f} |\n", f, best, best / dram);
  }
  free_block(block);
  return 0;
}
#endif  // HWY_ONCE
