// MoE throughput at a V2-Lite-like expert shape (dim 1024, expert width 704, 64 experts, top-6,
// 2048 tokens).
//  * ExpertGemm/{Forward,Backward}: the grouped expert GEMMs alone under skewed routing with
//    empty experts; each iteration also times one dense engine GEMM of the same FLOPs (outside
//    the measured time), so ratio_vs_dense compares rates taken side by side in one run.
//  * ExpertGemm/ForwardEven/R: the forward with R rows for every expert (fine-grained experts,
//    where few tokens meet each expert's weights).
//  * MoELayer/TrainStep: the whole layer (router, dispatch, experts, combine, 2 shared experts)
//    forward + backward.
// Every rate is also given as of_fma_peak, against the fp32 FMA peak measured at the start.
// Threads: MOE_BENCH_THREADS (default 2); SIMD target: MOE_SIMD.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "bench_main.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "kernels/activations.h"
#include "kernels/gemm.h"
#include "moe/dispatcher.h"
#include "moe/moe_layer.h"

using namespace moe;

namespace {

constexpr int64_t kDim = 1024, kHidden = 704, kExperts = 64, kTopK = 6, kTokens = 2048;
constexpr int64_t kEmptyExperts = 6;

void fill(float* p, int64_t n, Rng& rng, float scale) {
  for (int64_t i = 0; i < n; ++i) p[i] = scale * rng.normal();
}

// Zipf-like routing (p ∝ 1/(rank+1)) over the non-empty experts, k distinct per token, with
// expert identities shuffled so heavy and empty experts are spread through the id range.
ExpertSegments skewed_segments(uint64_t seed) {
  Rng rng(seed);
  std::vector<int64_t> perm(kExperts);
  for (int64_t i = 0; i < kExperts; ++i) perm[i] = i;
  for (int64_t i = kExperts - 1; i > 0; --i)
    std::swap(perm[i], perm[static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(i + 1))]);
  std::vector<double> p(kExperts, 0.0);
  for (int64_t r = 0; r < kExperts - kEmptyExperts; ++r) p[perm[r]] = 1.0 / (r + 1);
  std::vector<int64_t> counts(kExperts, 0);
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<double> q = p;
    for (int64_t j = 0; j < kTopK; ++j) {
      double total = 0;
      for (double v : q) total += v;
      double u = rng.uniform_double() * total;
      int64_t e = 0;
      while (e < kExperts - 1 && (q[e] == 0 || u >= q[e])) u -= q[e], ++e;
      ++counts[e];
      q[e] = 0;
    }
  }
  ExpertSegments seg;
  seg.offsets.assign(1, 0);
  for (int64_t e = 0; e < kExperts; ++e) seg.offsets.push_back(seg.offsets.back() + counts[e]);
  return seg;
}

struct GemmFixture {
  ExpertSegments seg = skewed_segments(5);
  int64_t R = seg.total_rows();
  DenseExpertWeights w;
  std::vector<float> x, g, u, h, y, dy, dh, dx, dense_a, dense_b, dense_c;

  GemmFixture() {
    w.init("bench.", {0, kExperts}, kDim, kHidden);
    w.allocate_grads();
    Rng rng(1);
    fill(w.gate_up_block().f32(), w.gate_up_block().numel(), rng, 0.03f);
    fill(w.down_block().f32(), w.down_block().numel(), rng, 0.03f);
    auto buf = [&](std::vector<float>& v, int64_t n) {
      v.resize(static_cast<size_t>(n));
      fill(v.data(), n, rng, 1.0f);
    };
    buf(x, R * kDim), buf(g, R * kHidden), buf(u, R * kHidden), buf(h, R * kHidden);
    buf(y, R * kDim), buf(dy, R * kDim), buf(dh, R * kHidden), buf(dx, R * kDim);
  }

  // One dense sgemm of `flops` FLOPs: [R, D] x [D, N]ᵀ with N = flops / (2·R·D).
  double dense_seconds(double flops) {
    const int64_t N = static_cast<int64_t>(std::llround(flops / (2.0 * R * kDim)));
    dense_a.resize(static_cast<size_t>(R * kDim), 0.5f);
    dense_b.resize(static_cast<size_t>(N * kDim), 0.25f);
    dense_c.resize(static_cast<size_t>(R * N));
    const auto t0 = std::chrono::steady_clock::now();
    gemm_nt(R, N, kDim, dense_a.data(), kDim, dense_b.data(), kDim, dense_c.data(), N, false);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

GemmFixture& fixture() {
  static GemmFixture f;
  return f;
}

// The same rows for every expert.
ExpertSegments even_segments(int64_t rows) {
  ExpertSegments seg;
  seg.offsets.assign(1, 0);
  for (int64_t e = 0; e < kExperts; ++e) seg.offsets.push_back(seg.offsets.back() + rows);
  return seg;
}

template <typename F>
void run_gemm_bench(benchmark::State& state, double flops, F&& body,
                    const ExpertSegments& seg = fixture().seg) {
  GemmFixture& f = fixture();
  double grouped = 0, dense = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    body(f);
    grouped += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.PauseTiming();
    dense += f.dense_seconds(flops);
    state.ResumeTiming();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["dense_GFLOPs"] = flops * n * 1e-9 / dense;
  state.counters["ratio_vs_dense"] = dense / grouped;
  state.counters["of_fma_peak"] = flops * n * 1e-9 / grouped / bench::fma_peak_gflops();
  int64_t empty = 0, largest = 0;
  for (int64_t e = 0; e < seg.experts(); ++e)
    empty += seg.rows(e) == 0, largest = std::max(largest, seg.rows(e));
  state.counters["rows"] = static_cast<double>(seg.total_rows());
  state.counters["empty_experts"] = static_cast<double>(empty);
  state.counters["largest_expert"] = static_cast<double>(largest);
}

void BM_ExpertGemmForward(benchmark::State& state) {
  GemmFixture& f = fixture();
  const double flops = 6.0 * f.R * kDim * kHidden;  // gate‖up: 4·R·D·H, down: 2·R·D·H
  run_gemm_bench(state, flops, [](GemmFixture& f) {
    f.w.gate_up_forward(f.seg, f.x.data(), f.g.data(), f.u.data());
    f.w.down_forward(f.seg, f.h.data(), f.y.data());
  });
}

void BM_ExpertGemmForwardEven(benchmark::State& state) {
  const ExpertSegments seg = even_segments(state.range(0));
  const double flops = 6.0 * static_cast<double>(seg.total_rows()) * kDim * kHidden;
  run_gemm_bench(
      state, flops,
      [&](GemmFixture& f) {
        f.w.gate_up_forward(seg, f.x.data(), f.g.data(), f.u.data());
        f.w.down_forward(seg, f.h.data(), f.y.data());
      },
      seg);
}

void BM_ExpertGemmBackward(benchmark::State& state) {
  GemmFixture& f = fixture();
  const double flops = 12.0 * f.R * kDim * kHidden;  // input + weight gradients of both
  run_gemm_bench(state, flops, [](GemmFixture& f) {
    f.w.down_backward_input(f.seg, f.dy.data(), f.dh.data());
    f.w.down_backward_weight(f.seg, f.dy.data(), f.h.data());
    f.w.gate_up_backward_input(f.seg, f.g.data(), f.u.data(), f.dx.data());
    f.w.gate_up_backward_weight(f.seg, f.g.data(), f.u.data(), f.x.data());
  });
}

void BM_MoELayerTrainStep(benchmark::State& state) {
  ModelConfig cfg;
  cfg.hidden_size = kDim;
  cfg.moe_intermediate_size = kHidden;
  cfg.n_routed_experts = kExperts;
  cfg.num_experts_per_tok = kTopK;
  cfg.n_shared_experts = 2;
  cfg.scoring_func = "softmax";  // V2-Lite
  cfg.norm_topk_prob = false;
  cfg.topk_method = "greedy";
  LocalDispatcher dispatcher;
  MoELayer layer;
  layer.init("model.layers.1.mlp.", cfg, dispatcher);
  ParamList ps;
  layer.collect(ps);
  Rng rng(2);
  for (Param* p : ps)
    if (p->trainable) fill(p->w(), p->value.numel(), rng, 0.03f);
  layer.allocate_grads();
  const BatchShape shape{4, kTokens / 4};
  Tensor x = Tensor::empty({kTokens, kDim}, DType::F32, MemCategory::Scratch);
  Tensor dy = Tensor::empty({kTokens, kDim}, DType::F32, MemCategory::Scratch);
  fill(x.f32(), x.numel(), rng, 1.0f);
  fill(dy.f32(), dy.numel(), rng, 1.0f);
  // One untimed step first, as the other benchmarks warm up: it fills the allocator's pools,
  // faulting in the pages of the activations and kernel scratch (22,000 page faults, none in
  // the steps after it), which a training run pays once. Timed, it took 1.4x a later step and
  // pulled the 3-step mean down by 0.03-0.08 of the FMA peak.
  {
    Tensor y = layer.forward(x, shape, Pass::Train);
    benchmark::DoNotOptimize(layer.backward(dy).raw());
  }
  std::fill(layer.expert_counts_mutable().begin(), layer.expert_counts_mutable().end(), 0);
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor y = layer.forward(x, shape, Pass::Train);
    Tensor dx = layer.backward(dy);
    benchmark::DoNotOptimize(dx.raw());
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double T = kTokens, R = T * kTopK;
  const double flops = 3.0 * (2.0 * T * kExperts * kDim           // router (fwd + 2x bwd)
                              + 6.0 * R * kDim * kHidden          // routed experts
                              + 6.0 * T * kDim * (2 * kHidden));  // shared experts
  state.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] =
      benchmark::Counter(T, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["of_fma_peak"] =
      flops * static_cast<double>(state.iterations()) * 1e-9 / seconds / bench::fma_peak_gflops();
  int64_t empty = 0, largest = 0;
  for (int64_t c : layer.expert_counts()) empty += c == 0, largest = std::max(largest, c);
  state.counters["largest_expert"] =
      static_cast<double>(largest) / static_cast<double>(state.iterations());
}

BENCHMARK(BM_ExpertGemmForward)
    ->Name("ExpertGemm/Forward")
    ->Unit(benchmark::kMillisecond)
    ->Iterations(6)
    ->UseRealTime();
BENCHMARK(BM_ExpertGemmForwardEven)
    ->Name("ExpertGemm/ForwardEven")
    ->Arg(64)
    ->Arg(192)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(6)
    ->UseRealTime();
BENCHMARK(BM_ExpertGemmBackward)
    ->Name("ExpertGemm/Backward")
    ->Unit(benchmark::kMillisecond)
    ->Iterations(4)
    ->UseRealTime();
BENCHMARK(BM_MoELayerTrainStep)
    ->Name("MoELayer/TrainStep")
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return moe::bench::run_benchmarks(argc, argv); }
