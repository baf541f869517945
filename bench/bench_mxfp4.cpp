// The fused MXFP4 kernels against the engine's fp32 path on the same shapes, one thread.
//  * Mxfp4/NT/<shape>/<m>: y[m, rows] = x[m, cols] · Wᵀ with mxfp4_gemm_nt, vs gemm_nt_serial.
//  * Mxfp4/NN/<shape>/<m>: dx[m, cols] = dy[m, rows] · W with mxfp4_gemm_nn, vs gemm_nn_serial.
// Shapes: the `MoE layer` of issue 9 (dim 1024, expert width 704): 0 = gate or up W [704, 1024],
// 1 = down W [1024, 704]; 2 = gate‖up W [1408, 1024] (DeepSeek-V2-Lite-like). Every iteration
// times one MXFP4 call and one fp32 call back to back, so background load hits both alike;
// ratio = fp32 time / MXFP4 time (MXFP4 throughput over fp32's), of_core_peak = MXFP4 GFLOP/s
// over one thread's FMA peak (measured at the start, same target). Each call uses the next of
// many distinct experts, for each format enough to fill twice the last-level cache, so the
// weights come from DRAM as in a real MoE layer. MOE_SIMD=avx2 (etc.) forces a target.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <iterator>
#include <memory>
#include <vector>

#include "bench_main.h"
#include "core/rng.h"
#include "kernels/gemm.h"
#include "kernels/mxfp4.h"
#include "kernels/mxfp4_gemm.h"
#include "kernels/read_bandwidth.h"

using namespace moe;

namespace {

struct Shape {
  int64_t rows, cols;
};
constexpr Shape kShapes[] = {{704, 1024}, {1024, 704}, {1408, 1024}};
constexpr int64_t kMaxM = 512;

// Enough experts of `bytes_each` to cover twice the last-level cache (at least 4).
int64_t experts_for(int64_t bytes_each) {
  return std::max<int64_t>(4, (2 * last_level_cache_bytes() + bytes_each - 1) / bytes_each);
}

struct ShapeData {
  Shape s;
  int64_t n_mx, n_fp;
  std::vector<uint8_t> packed, scales;  // n_mx experts, contiguous rows
  std::vector<float> dense;             // n_fp experts
  std::vector<float> a, c;              // activations in, outputs
  int64_t next_mx = 0, next_fp = 0;

  explicit ShapeData(Shape shape) : s(shape) {
    const int64_t n = s.rows * s.cols;
    n_mx = experts_for(n / 2 + n / 32);
    n_fp = experts_for(n * 4);
    packed.resize(static_cast<size_t>(n_mx * n / 2));
    scales.resize(static_cast<size_t>(n_mx * n / 32));
    dense.resize(static_cast<size_t>(n_fp * n));
    // Cheap fills (hundreds of MB): a counter hash for the codes, weights of a realistic scale.
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = static_cast<uint8_t>(splitmix64(i));
    for (size_t i = 0; i < scales.size(); ++i)
      scales[i] = static_cast<uint8_t>(118 + splitmix64(i ^ 0x5555) % 4);
    for (size_t i = 0; i < dense.size(); ++i)
      dense[i] = static_cast<float>(static_cast<int64_t>(splitmix64(i) % 2001) - 1000) * 3e-5f;
    Rng rng(7);
    a.resize(static_cast<size_t>(kMaxM * std::max(s.rows, s.cols)));
    c.resize(a.size());
    for (float& v : a) v = rng.normal();
  }

  Mxfp4Matrix mx() {
    const int64_t e = next_mx;
    next_mx = (next_mx + 1) % n_mx;
    const int64_t n = s.rows * s.cols;
    return {packed.data() + e * (n / 2),
            scales.data() + e * (n / 32),
            s.rows,
            s.cols,
            s.cols / 2,
            s.cols / 32};
  }
  const float* fp() {
    const int64_t e = next_fp;
    next_fp = (next_fp + 1) % n_fp;
    return dense.data() + e * s.rows * s.cols;
  }
};

ShapeData& data(int64_t shape) {
  static std::unique_ptr<ShapeData> d[std::size(kShapes)];
  if (!d[shape]) d[shape] = std::make_unique<ShapeData>(kShapes[shape]);
  return *d[shape];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run(benchmark::State& state, bool nt) {
  ShapeData& d = data(state.range(0));
  const int64_t m = state.range(1), R = d.s.rows, C = d.s.cols;
  double t_mx = 0, t_fp = 0;
  for (auto _ : state) {
    const Mxfp4Matrix w = d.mx();
    auto t0 = std::chrono::steady_clock::now();
    if (nt)
      mxfp4_gemm_nt(m, d.a.data(), C, w, d.c.data(), R, false);
    else
      mxfp4_gemm_nn(m, d.a.data(), R, w, d.c.data(), C, false);
    const double mx = seconds_since(t0);
    benchmark::DoNotOptimize(d.c.data());
    const float* wf = d.fp();
    t0 = std::chrono::steady_clock::now();
    if (nt)
      gemm_nt_serial(m, R, C, d.a.data(), C, wf, C, d.c.data(), R, false);
    else
      gemm_nn_serial(m, C, R, d.a.data(), R, wf, C, d.c.data(), C, false);
    const double fp = seconds_since(t0);
    benchmark::DoNotOptimize(d.c.data());
    state.SetIterationTime(mx);
    t_mx += mx;
    t_fp += fp;
  }
  const double flops =
      2.0 * static_cast<double>(m * R * C) * static_cast<double>(state.iterations());
  state.counters["GFLOPs"] = flops / t_mx * 1e-9;
  state.counters["fp32_GFLOPs"] = flops / t_fp * 1e-9;
  state.counters["ratio"] = t_fp / t_mx;
  state.counters["of_core_peak"] = flops / t_mx * 1e-9 / bench::fma_peak_gflops();
  state.counters["experts_mx"] = static_cast<double>(d.n_mx);
  state.counters["experts_fp32"] = static_cast<double>(d.n_fp);
}

void BM_NT(benchmark::State& state) { run(state, true); }
void BM_NN(benchmark::State& state) { run(state, false); }

void shapes_and_ms(benchmark::internal::Benchmark* b) {
  for (int64_t shape = 0; shape < static_cast<int64_t>(std::size(kShapes)); ++shape)
    for (int64_t m : {1, 2, 4, 8, 16, 32, 64, 128, 256, 512}) b->Args({shape, m});
  b->ArgNames({"shape", "m"})->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.5);
}

BENCHMARK(BM_NT)->Name("Mxfp4/NT")->Apply(shapes_and_ms);
BENCHMARK(BM_NN)->Name("Mxfp4/NN")->Apply(shapes_and_ms);

}  // namespace

// One thread for both sides: the kernels run on the calling thread.
int main(int argc, char** argv) { return moe::bench::run_benchmarks(argc, argv, 1); }
