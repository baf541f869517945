#include "kernels/read_bandwidth.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/block_cache.h"
#include "core/simd.h"
#include "core/threads_together.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/read_bandwidth.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sums kStreams equal, consecutive parts of p[0, n) walked in step, one 256-byte span of each at a
// time; `sink` defeats elimination. n is a multiple of kStreams × 64 floats.
constexpr int64_t kStreams = 8;
void ReadStreams(const float* HWY_RESTRICT p, int64_t n, float* sink) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d)), per = n / kStreams;
  auto a = hn::Zero(d), b = a, c = a, e = a;
  for (int64_t i = 0; i < per; i += 64) {
    for (int64_t s = 0; s < kStreams; ++s) {
      const float* q = p + s * per + i;
      for (int64_t j = 0; j < 64; j += 4 * lanes) {
        a = hn::Add(a, hn::LoadU(d, q + j));
        b = hn::Add(b, hn::LoadU(d, q + j + lanes));
        c = hn::Add(c, hn::LoadU(d, q + j + 2 * lanes));
        e = hn::Add(e, hn::LoadU(d, q + j + 3 * lanes));
      }
    }
  }
  *sink = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a, b), hn::Add(c, e))));
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe {

HWY_EXPORT(ReadStreams);

namespace {

// The bandwidth is the machine's, not the kernels' target's: read with the widest vectors the CPU
// has, even while a narrower target is forced (AVX2 loads read about 6% less here).
using ReadFn = void (*)(const float*, int64_t, float*);
ReadFn widest_reader() {
#if HWY_ARCH_X86 && (HWY_TARGETS & HWY_AVX3)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return &N_AVX3::ReadStreams;
#endif
#if HWY_ARCH_X86 && (HWY_TARGETS & HWY_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &N_AVX2::ReadStreams;
#endif
  return nullptr;
}

}  // namespace

int64_t last_level_cache_bytes() {
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? l3 : int64_t{64} << 20;
}

int64_t l2_cache_bytes() {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2 > 0 ? l2 : int64_t{1} << 20;
}

double measure_dram_read_gbs(int threads) {
  threads = std::max(threads, 1);
  const auto llc = static_cast<size_t>(last_level_cache_bytes());
  // Each thread's part a multiple of 64 KiB, which ReadStreams' streams and spans divide.
  const size_t part = std::max(size_t{1} << 30, 4 * llc) / static_cast<size_t>(threads) / 65536 * 65536;
  const HostBlock block = allocate_block(part * static_cast<size_t>(threads));
  std::memset(block.data, 0, part * static_cast<size_t>(threads));
  const auto* floats = static_cast<const float*>(block.data);
  const auto n = static_cast<int64_t>(part / sizeof(float));
  const ReadFn read = widest_reader();
  std::vector<float> sink(static_cast<size_t>(threads));
  double best = 0;
  for (int pass = 0; pass < 5; ++pass) {
    const double slowest = slowest_seconds_together(threads, [&](int t) {
      if (read) {
        read(floats + t * n, n, &sink[static_cast<size_t>(t)]);
      } else {
        MOE_DISPATCH(ReadStreams)(floats + t * n, n, &sink[static_cast<size_t>(t)]);
      }
    });
    if (slowest > 0) best = std::max(best, static_cast<double>(part) * threads / slowest / 1e9);
  }
  free_block(block);
  return best;
}

}  // namespace moe
#endif
