#include "kernels/fma_peak.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/simd.h"
#include "core/threads_together.h"
#include "io/atomic_file.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fma_peak.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// `iters` rounds of kChains independent vector FMAs (the chains converge to a fixed point, so
// no value overflows or turns subnormal). Returns the flops done; `sink` defeats elimination.
double FmaLoop(int64_t iters, float* sink) {
#if HWY_NATIVE_FMA && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128
  using D = hn::ScalableTag<float>;
  const D d;
  // Two FMA ports × 4-cycle latency need 8 chains in flight; 16 (12 with 16 registers) leave
  // room for any core's latency and port count.
  constexpr int kChains = hn::MaxLanes(D()) >= 16 ? 16 : 12;
  hn::Vec<D> acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, 0.25f + 0.01f * static_cast<float>(c));
  const auto m = hn::Set(d, 0.999f), a = hn::Set(d, 0.001f);
  for (int64_t i = 0; i < iters; ++i) {
    // Unrolled so the chains live in registers.
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], m, a);
  }
  auto sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = hn::Add(sum, acc[c]);
  *sink = hn::GetLane(sum);
  return 2.0 * static_cast<double>(iters) * kChains * static_cast<double>(hn::Lanes(d));
#else
  // The exact scalar path's rate: std::fma over 8 chains.
  float acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = 0.25f + 0.01f * static_cast<float>(c);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = std::fma(acc[c], 0.999f, 0.001f);
  }
  *sink = acc[0] + acc[7];
  return 2.0 * static_cast<double>(iters) * 8;
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe {

HWY_EXPORT(FmaLoop);

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// One timed run: `threads` threads start the loop together (own threads, not the pool, so the
// count is exact); total flops over the slowest thread's time.
double run_once(int threads, int64_t iters) {
  std::vector<double> flops(static_cast<size_t>(threads));
  std::vector<float> sink(flops.size());
  const double slowest = slowest_seconds_together(threads, [&](int t) {
    flops[static_cast<size_t>(t)] = MOE_DISPATCH(FmaLoop)(iters, &sink[static_cast<size_t>(t)]);
  });
  double total = 0;
  for (const double f : flops) total += f;
  return slowest > 0 ? total / slowest / 1e9 : 0.0;
}

fs::path cache_file() {
  if (const char* d = std::getenv("MOE_CACHE_DIR"); d && *d) return fs::path(d) / "fma_peak.json";
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return fs::path(x) / "moe" / "fma_peak.json";
  if (const char* h = std::getenv("HOME"); h && *h) return fs::path(h) / ".cache" / "moe" / "fma_peak.json";
  return {};
}

std::string cache_key(const FmaPeak& p) { return fmt::format("{} | {} | {} threads", p.cpu, p.target, p.threads); }

json read_cache(const fs::path& file) {
  std::ifstream in(file);
  if (!in) return json::object();
  try {
    json j = json::parse(in);
    return j.is_object() ? j : json::object();
  } catch (const std::exception&) {
    return json::object();  // a damaged cache is re-measured, never an error
  }
}

// What a peak is of: this CPU, the target in use, `threads` threads (at least one).
FmaPeak unmeasured(int threads) {
  FmaPeak p;
  p.threads = std::max(1, threads);
  p.target = simd::name(simd::current());
  p.cpu = simd::cpu_model();
  return p;
}

}  // namespace

FmaPeak measure_fma_peak(int threads) {
  FmaPeak p = unmeasured(threads);
  threads = p.threads;
  const bool scalar = simd::current() == simd::Target::Scalar;
  // ~15 ms per run on a 2-core AVX-512 machine; the first run also wakes the clocks up.
  const int64_t iters = scalar ? 2'000'000 : 4'000'000;
  run_once(1, iters / 4);
  double single = 0;
  for (int rep = 0; rep < 3; ++rep) single = std::max(single, run_once(1, iters));
  if (threads == 1) {
    p.gflops = single;
    return p;
  }
  // Cores do not share FMA units, so all threads together should reach about threads × one
  // thread's rate. A virtual machine whose host briefly runs two of its CPUs on one core, or
  // other load, gives far less for a while: keep measuring (up to ~1.5 s) until the rate is
  // plausible.
  for (int rep = 0; rep < 30; ++rep) {
    p.gflops = std::max(p.gflops, run_once(threads, iters));
    if (rep >= 6 && p.gflops >= 0.9 * single * threads) break;
    if (rep >= 6) std::this_thread::sleep_for(std::chrono::milliseconds(40));
  }
  p.plausible = p.gflops >= 0.9 * single * threads;
  return p;
}

FmaPeak fma_peak(int threads) {
  static std::mutex mu;
  const std::lock_guard<std::mutex> lock(mu);
  FmaPeak p = unmeasured(threads);
  if (const char* v = std::getenv("MOE_FMA_PEAK"); v && *v) {
    char* end = nullptr;
    p.gflops = std::strtod(v, &end);
    MOE_CHECK(end && *end == '\0' && std::isfinite(p.gflops) && p.gflops > 0,
              "environment variable MOE_FMA_PEAK: expected a positive number of GFLOP/s, got '{}'", v);
    p.cached = true;
    return p;
  }
  const fs::path file = cache_file();
  json cache = file.empty() ? json::object() : read_cache(file);
  const std::string key = cache_key(p);
  if (cache.contains(key) && cache[key].is_number() && cache[key].get<double>() > 0) {
    p.gflops = cache[key].get<double>();
    p.cached = true;
    return p;
  }
  p = measure_fma_peak(p.threads);
  // A figure taken while the cores were shared would inflate every later MFU: measured again
  // next time instead of cached.
  if (!file.empty() && p.plausible) {
    try {
      fs::create_directories(file.parent_path());
      cache[key] = p.gflops;
      write_file_atomic(file, cache.dump(2) + "\n");
    } catch (const std::exception&) {
      // Read-only home, full disk: the next run measures again.
    }
  }
  return p;
}

std::string describe(const FmaPeak& p) {
  return fmt::format("{:.0f} GFLOP/s fp32 FMA peak ({}, {} thread{}, {}{})", p.gflops,
                     simd::description(simd::parse(p.target, "target")), p.threads,
                     p.threads == 1 ? "" : "s", p.cpu, p.cached ? ", cached" : "");
}

}  // namespace moe
#endif  // HWY_ONCE
