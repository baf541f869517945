// End-to-end training throughput of the engine: full steps (forward, backward, clipping, bias
// update, AdamW) of a preset model on random tokens. Prints one JSON line; bench/e2e_vs_pytorch.sh
// runs it next to bench/pytorch_train.py on the same configuration and prints the ratios.
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <fmt/format.h>

#include "core/parallel.h"
#include "core/rng.h"
#include "core/simd.h"
#include "io/model_spec.h"
#include "kernels/fma_peak.h"
#include "model/causal_lm.h"
#include "train/adamw.h"
#include "machine_peak.h"

using namespace moe;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"engine end-to-end training throughput"};
  std::string config = "small";
  int64_t vocab = 0, batch = 8, seq = 256, steps = 10, warmup = 2;
  int threads = available_cpus();
  app.add_option("--config", config);
  app.add_option("--vocab", vocab, "override vocab_size (0 = preset)");
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--threads", threads);
  std::string simd_name;
  app.add_option("--simd", simd_name, "SIMD target: auto, avx512, avx2, scalar (default: MOE_SIMD or auto)");
  CLI11_PARSE(app, argc, argv);
  set_num_threads(threads);
  simd::apply_option(simd_name, "--simd");

  ModelConfig cfg = resolve_model_config(config);
  if (vocab > 0) cfg.vocab_size = vocab;
  const FmaPeak fma = measure_fma_peak(threads);
  const double gemm_peak = bench::gemm_rate_gflops(1536, 5);
  const std::unique_ptr<CausalLM> built = make_causal_lm(cfg);
  CausalLM& model = *built;
  model.init_weights(1);
  model.allocate_grads();
  AdamW opt(model.trainable_params(), AdamWConfig{});
  const BatchShape shape{batch, seq};
  Tensor tokens = Tensor::empty({shape.tokens()}, DType::I32, MemCategory::Activations);
  Tensor targets = tokens.clone(MemCategory::Activations);
  Rng rng(3);
  auto step = [&] {
    for (int64_t i = 0; i < shape.tokens(); ++i) {
      tokens.i32()[i] = static_cast<int32_t>(rng.next_u64() % cfg.vocab_size);
      targets.i32()[i] = static_cast<int32_t>(rng.next_u64() % cfg.vocab_size);
    }
    LossResult r = model.forward(tokens, targets, shape, Pass::Train);
    model.backward();
    const float clip = clip_coefficient(grad_norm(model.trainable_params()), 1.0);
    model.update_router_biases(1e-3);
    opt.step(1e-3, clip, GradsAfterStep::Zeroed);  // as the trainer: no zeroing pass of its own
    return r.total();
  };
  for (int64_t i = 0; i < warmup; ++i) step();
  const auto t0 = std::chrono::steady_clock::now();
  double loss = 0;
  for (int64_t i = 0; i < steps; ++i) loss = step();
  const double secs = seconds_since(t0);
  const double tps = static_cast<double>(steps * shape.tokens()) / secs;
  const double gflops = tps * train_flops_per_token(cfg, seq) / 1e9;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const MemSnapshot mem = MemoryTracker::instance().snapshot();
  fmt::print(
      "{{\"impl\": \"moe\", \"config\": \"{}\", \"threads\": {}, \"batch\": {}, \"seq\": {}, "
      "\"params\": {}, \"tokens_per_s\": {:.1f}, \"model_gflops\": {:.1f}, \"fma_peak_gflops\": "
      "{:.1f}, \"mfu\": {:.3f}, \"gemm_peak_gflops\": {:.1f}, \"of_gemm_peak\": {:.3f}, "
      "\"peak_rss_bytes\": {}, \"tracked_peak_bytes\": {}, \"loss\": {:.4f}, \"simd\": \"{}\", "
      "\"cpu\": \"{}\"}}\n",
      config, threads, batch, seq, count_params(cfg).total, tps, gflops, fma.gflops,
      gflops / fma.gflops, gemm_peak, gflops / gemm_peak, static_cast<int64_t>(ru.ru_maxrss) * 1024,
      mem.total_peak(), loss, fma.target, fma.cpu);
  fmt::print(stderr, "tracked memory by category (current / peak):\n{}", MemoryTracker::instance().report());
  return 0;
}
