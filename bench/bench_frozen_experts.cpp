// Frozen routed experts: MXFP4-packed (decoded inside the matmuls) against fp32, both frozen,
// measured side by side in every iteration so machine noise hits both alike.
//  * GroupedExperts/{Forward,BackwardInput}/T: the grouped expert matmuls of 64 experts at a
//    V2-Lite-like shape (dim 1024, width 704) with T tokens per expert (1, 8: memory-bound,
//    64, 512: compute-bound). speedup = fp32 time / MXFP4 time (targets: >= 3 at 1-8 tokens,
//    >= 0.9 from 64 on); mxfp4_of_fma_peak / fp32_of_fma_peak = GFLOP/s over the FMA peak
//    measured at the start (issue 17: >= 0.85 for MXFP4 from 64 tokens on).
//  * TrainStep: a whole training step (forward, backward, AdamW over everything but the
//    experts) of the `small` preset at batch 8 x 256 with frozen experts, MXFP4 vs fp32.
//    time_ratio = MXFP4 step time / fp32 step time (target <= 1.10).
// Threads: MOE_BENCH_THREADS (default 2).
#include <benchmark/benchmark.h>

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "bench_main.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "io/model_spec.h"
#include "model/model.h"
#include "moe/mxfp4_expert_weights.h"
#include "train/adamw.h"

using namespace moe;

namespace {

constexpr int64_t kDim = 1024, kHidden = 704, kExperts = 64;

double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Both stores hold the same (decoded) values, so the two sides compute the same product.
struct Stores {
  DenseExpertWeights fp32;
  Mxfp4ExpertWeights packed;
  Stores() {
    packed.init("bench.", {0, kExperts}, kDim, kHidden);
    fp32.init("bench.", {0, kExperts}, kDim, kHidden);
    fp32.freeze();
    ParamList pp, fp;
    packed.collect(pp);
    fp32.collect(fp);
    Rng rng(1);
    for (size_t i = 0, j = 0; i < pp.size(); i += 2, ++j) {
      Param& dense = *fp[j];
      quantize_rows_into(*pp[i], *pp[i + 1], [&](int64_t r, float* row) {
        const int64_t cols = dense.value.dim(1);
        for (int64_t c = 0; c < cols; ++c) row[c] = 0.03f * rng.normal();
        std::copy(row, row + cols, dense.w() + r * cols);
      });
    }
  }
};

Stores& stores() {
  static Stores s;
  return s;
}

void grouped(benchmark::State& state, bool backward) {
  Stores& s = stores();
  const int64_t per_expert = state.range(0);
  ExpertSegments seg;
  seg.offsets.assign(1, 0);
  for (int64_t e = 0; e < kExperts; ++e) seg.offsets.push_back(seg.offsets.back() + per_expert);
  const int64_t R = seg.total_rows();
  std::vector<float> x(static_cast<size_t>(R * kDim), 0.5f), a(static_cast<size_t>(R * kHidden)),
      b(static_cast<size_t>(R * kHidden)), y(static_cast<size_t>(R * kDim));
  auto run = [&](ExpertWeights& w) {
    if (!backward) {
      w.gate_up_forward(seg, x.data(), a.data(), b.data());
      w.down_forward(seg, a.data(), y.data());
    } else {
      w.down_backward_input(seg, x.data(), a.data());
      w.gate_up_backward_input(seg, a.data(), b.data(), y.data());
    }
  };
  double t_fp32 = 0, t_packed = 0;
  for (auto _ : state) {
    t_packed += seconds([&] { run(s.packed); });
    state.PauseTiming();
    t_fp32 += seconds([&] { run(s.fp32); });
    state.ResumeTiming();
  }
  const double flops = 2.0 * static_cast<double>(R) * 3 * kDim * kHidden;
  const double n = static_cast<double>(state.iterations());
  state.counters["mxfp4_GFLOPs"] = flops * n * 1e-9 / t_packed;
  state.counters["fp32_GFLOPs"] = flops * n * 1e-9 / t_fp32;
  state.counters["speedup"] = t_fp32 / t_packed;
  state.counters["mxfp4_of_fma_peak"] = flops * n * 1e-9 / t_packed / bench::fma_peak_gflops();
  state.counters["fp32_of_fma_peak"] = flops * n * 1e-9 / t_fp32 / bench::fma_peak_gflops();
  state.counters["tokens_per_expert"] = static_cast<double>(per_expert);
}

void BM_GroupedForward(benchmark::State& state) { grouped(state, false); }
void BM_GroupedBackwardInput(benchmark::State& state) { grouped(state, true); }

ModelConfig with_experts(ModelConfig cfg, bool packed) {
  cfg.expert_format = packed ? "mxfp4" : "fp32";
  return cfg;
}

struct TrainSide {
  DeepSeekModel model;
  std::unique_ptr<AdamW> opt;
  TrainSide(const ModelConfig& cfg, bool packed) : model(with_experts(cfg, packed)) {
    model.init_weights(3);
    if (!packed)
      for (MoELayer* m : model.moe_layers()) m->dense_experts()->freeze();
    model.allocate_grads();
    opt = std::make_unique<AdamW>(model.trainable_params(), AdamWConfig{});
  }
  void step(const Tensor& tokens, const Tensor& targets, const BatchShape& shape) {
    model.zero_grads();
    model.forward(tokens, targets, shape, Pass::Train);
    model.backward();
    opt->step(1e-4);
  }
};

void BM_TrainStep(benchmark::State& state) {
  ModelConfig cfg = resolve_model_config("small");
  cfg.vocab_size = 264;
  TrainSide fp32(cfg, false), packed(cfg, true);
  const BatchShape shape{8, 256};
  Rng rng(4);
  Tensor tokens = Tensor::empty({shape.tokens()}, DType::I32, MemCategory::Activations);
  for (int64_t i = 0; i < shape.tokens(); ++i)
    tokens.i32()[i] = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size));
  packed.step(tokens, tokens, shape);  // warm-up: allocator pools, optimizer moments
  fp32.step(tokens, tokens, shape);
  double t_fp32 = 0, t_packed = 0;
  for (auto _ : state) {
    t_packed += seconds([&] { packed.step(tokens, tokens, shape); });
    state.PauseTiming();
    t_fp32 += seconds([&] { fp32.step(tokens, tokens, shape); });
    state.ResumeTiming();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["mxfp4_step_ms"] = 1e3 * t_packed / n;
  state.counters["fp32_step_ms"] = 1e3 * t_fp32 / n;
  state.counters["time_ratio"] = t_packed / t_fp32;
}

BENCHMARK(BM_GroupedForward)
    ->Name("GroupedExperts/Forward")
    ->Arg(1)->Arg(8)->Arg(64)->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(BM_GroupedBackwardInput)
    ->Name("GroupedExperts/BackwardInput")
    ->Arg(1)->Arg(8)->Arg(64)->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(BM_TrainStep)
    ->Name("TrainStep/small")
    ->Unit(benchmark::kMillisecond)
    ->Iterations(4)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return moe::bench::run_benchmarks(argc, argv); }
