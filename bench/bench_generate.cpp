// Inference over the latent KV cache (issue 12), against the machine's limits measured in the
// same run:
//  * decode: one sequence, MXFP4 routed experts, greedy, through GenerationEngine; the weight
//    bytes one token reads (every non-expert matrix in fp32, the embedding row, the top-k
//    experts' packed bytes + scales, the shared expert, the LM head) times tokens/s, as a
//    fraction of DRAM read bandwidth (the memory-bound limit);
//  * prefill: one 512-token prompt in one chunk, model FLOPs (2 x the multiply-adds of every
//    matmul a token runs, top-k experts only, plus causal attention) per second as a fraction of
//    the fp32 FMA peak;
//  * cached decode vs a full recompute of the context per token (what `moe sample` did before
//    the cache), at 256 and 1024 tokens of context.
// Decode and prefill run with the exact expert matmuls and with int8 expert activations
// (--expert-activations, moe/expert_activations.h), alternated, so their ratio is from one run.
// The model: hidden 1024, 4 layers, MLA (kv_lora_rank 256, 8 heads of 64 + 32 rope, v 64),
// 64 routed experts of width 704 (top-6, MXFP4: 73.5 MB per layer, far beyond the LLC) + 1
// shared, vocabulary 8192, random weights.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "core/simd.h"
#include "infer/generation.h"
#include "model/model.h"
#include "io/model_spec.h"
#include "kernels/fma_peak.h"
#include "kernels/read_bandwidth.h"

using namespace moe;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

ModelConfig bench_config(int64_t layers) {
  ModelConfig c = resolve_model_config("debug");
  c.vocab_size = 8192;
  c.hidden_size = 1024;
  c.intermediate_size = 2816;
  c.moe_intermediate_size = 704;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 8;
  c.first_k_dense_replace = 0;
  c.n_routed_experts = 64;
  c.num_experts_per_tok = 6;
  c.n_shared_experts = 1;
  c.n_group = 1;
  c.topk_group = 1;
  c.q_lora_rank = 0;
  c.kv_lora_rank = 256;
  c.qk_nope_head_dim = 64;
  c.qk_rope_head_dim = 32;
  c.v_head_dim = 64;
  c.max_position_embeddings = 2048;
  c.expert_format = "mxfp4";
  return c;
}

// Weight bytes one decoded token reads, and the multiply-adds of its matmuls (without
// attention's score and value sums, which depend on the position).
struct TokenCost {
  double bytes = 0, macs = 0;
};

TokenCost token_cost(const DeepSeekModel& model) {
  const ModelConfig& c = model.config();
  TokenCost t;
  int64_t expert_bytes = 0, expert_macs = 0;
  for (const Param* p : model.params()) {
    const bool routed = p->name.find("mlp.experts.") != std::string::npos;
    const int64_t bytes = p->value.nbytes();
    if (routed) {
      expert_bytes += bytes;
      if (p->format == ParamFormat::Mxfp4Data) expert_macs += 2 * p->value.numel();
      continue;
    }
    if (p->name == "model.embed_tokens.weight") {
      t.bytes += static_cast<double>(c.hidden_size) * 4;  // one row
      continue;
    }
    t.bytes += static_cast<double>(bytes);
    if (p->value.ndim() == 2) t.macs += static_cast<double>(p->value.numel());
  }
  // Each MoE layer's token runs num_experts_per_tok of n_routed_experts experts.
  const double active = static_cast<double>(c.num_experts_per_tok) /
                        static_cast<double>(c.n_routed_experts);
  t.bytes += static_cast<double>(expert_bytes) * active;
  t.macs += static_cast<double>(expert_macs) * active;
  return t;
}

// Multiply-adds of causal attention for `count` tokens after `past` cached ones, all layers, in
// the expanded form's terms (scores over nope + rope, values over v).
double attention_macs(const ModelConfig& c, int64_t past, int64_t count) {
  double keys = 0;
  for (int64_t i = 0; i < count; ++i) keys += static_cast<double>(past + i + 1);
  return keys * static_cast<double>(c.num_attention_heads *
                                    (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)) *
         static_cast<double>(c.num_hidden_layers);
}

Tensor random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  Tensor t = Tensor::empty({n}, DType::I32, MemCategory::Activations);
  Rng rng(seed);
  for (int64_t i = 0; i < n; ++i) t.i32()[i] = static_cast<int32_t>(rng.next_u64() % vocab);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cached decoding and prefill against DRAM bandwidth and the FMA peak"};
  int threads = available_cpus();
  int64_t layers = 4, decode_tokens = 64, rounds = 3;
  std::string activations = "both";
  bool quick = false;
  app.add_option("--threads", threads);
  app.add_option("--layers", layers, "model layers (each 73.5 MB of packed experts)");
  app.add_option("--tokens", decode_tokens, "tokens decoded per measurement");
  app.add_option("--expert-activations", activations,
                 "routed experts' forward for decode and prefill: fp32 (exact), int8, or both "
                 "(alternated round by round, so their ratio comes from the same run)")
      ->check(CLI::IsMember({"fp32", "int8", "both"}))->capture_default_str();
  app.add_option("--rounds", rounds, "decode and prefill measurements per mode (best kept)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_flag("--quick", quick, "small sizes, to check that it runs");
  CLI11_PARSE(app, argc, argv);
  set_num_threads(threads);
  if (quick) layers = 1, decode_tokens = 4, rounds = 1;
  std::vector<ExpertActivations> modes;
  if (activations != "int8") modes.push_back(ExpertActivations::Fp32);
  if (activations != "fp32") modes.push_back(ExpertActivations::Int8);

  const ModelConfig cfg = bench_config(layers);
  DeepSeekModel model(cfg);
  model.init_weights(1);
  const FmaPeak peak = measure_fma_peak(threads);
  // The DRAM read is measured again in every round and the best kept: a disturbed moment can
  // only make a read slower, and one slow read at the start once put a decode at "1.97 of DRAM".
  double dram = measure_dram_read_gbs(threads);
  const TokenCost cost = token_cost(model);
  fmt::print("{}, {} threads, {} ({}); FMA peak {:.0f} GFLOP/s\n", simd::cpu_model(), threads,
             simd::name(simd::current()), simd::description(simd::current()), peak.gflops);
  fmt::print("model: {} layers, {:.1f} MB of weights read per decoded token, {:.1f} M "
             "multiply-adds per token in matmuls\n\n",
             layers, cost.bytes / 1e6, cost.macs / 1e6);

  // Decode: one sequence after a 64-token prompt; the first generated token comes with the
  // prompt's forward, so the timed steps are the decode steps alone.
  const auto decode_tokens_per_second = [&] {
    const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
    EngineOptions o;
    o.max_sequences = 1;
    o.context = 64 + decode_tokens + 8;
    GenerationEngine engine(model, *tok, o);
    GenerationRequest r;
    const Tensor prompt = random_ids(64, 256, 3);
    r.prompt.assign(prompt.i32(), prompt.i32() + 64);
    r.max_tokens = decode_tokens + 1;
    r.sampling.temperature = 0;
    engine.submit(r, nullptr);
    engine.step();  // the prompt
    const auto t0 = std::chrono::steady_clock::now();
    int64_t steps = 0;
    while (engine.step()) ++steps;
    return static_cast<double>(steps) / seconds_since(t0);
  };
  // Prefill: 512 tokens in one chunk.
  const int64_t prefill_n = quick ? 64 : 512;
  const auto prefill_seconds = [&] {
    LatentKvCache cache(cfg, 1, prefill_n);
    const Tensor ids = random_ids(prefill_n, cfg.vocab_size, 5);
    const CachedChunk chunk{0, 0, prefill_n};
    (void)model.forward_cached(ids, {&chunk, 1}, cache.layers());  // warm-up
    const auto t0 = std::chrono::steady_clock::now();
    (void)model.forward_cached(ids, {&chunk, 1}, cache.layers());
    return seconds_since(t0);
  };
  // Modes alternate within each round, so a slow phase of a loaded machine hits both.
  std::vector<double> decode_best(modes.size(), 0.0), prefill_best(modes.size(), 1e30);
  for (int64_t round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < modes.size(); ++i) {
      model.set_expert_activations(modes[i]);
      decode_best[i] = std::max(decode_best[i], decode_tokens_per_second());
      prefill_best[i] = std::min(prefill_best[i], prefill_seconds());
    }
    dram = std::max(dram, measure_dram_read_gbs(threads));
  }
  model.set_expert_activations(ExpertActivations::Fp32);
  fmt::print(
      "DRAM read {:.1f} GB/s (the best of {} reads, one before and one after each round)\n\n",
      dram, rounds + 1);
  const double prefill_flops =
      2.0 * (cost.macs * static_cast<double>(prefill_n) + attention_macs(cfg, 0, prefill_n));
  for (size_t i = 0; i < modes.size(); ++i) {
    const double tps = decode_best[i], gbs = cost.bytes * tps / 1e9;
    const double gflops = prefill_flops / prefill_best[i] / 1e9;
    fmt::print("{} expert activations, best of {}:\n", expert_activations_name(modes[i]), rounds);
    fmt::print("  decode, 1 sequence:   {:7.1f} tokens/s, {:6.1f} GB/s of weights = {:.2f} of DRAM "
               "read bandwidth\n",
               tps, gbs, gbs / dram);
    fmt::print("  prefill, {} tokens: {:7.1f} tokens/s, {:6.1f} GFLOP/s = {:.2f} of the FMA peak\n",
               prefill_n, static_cast<double>(prefill_n) / prefill_best[i], gflops,
               gflops / peak.gflops);
  }
  if (modes.size() == 2)
    fmt::print("int8 / fp32 expert activations: decode {:.2f}x, prefill {:.2f}x\n",
               decode_best[1] / decode_best[0], prefill_best[0] / prefill_best[1]);

  // Cached decode vs recomputing the whole context for each token.
  fmt::print("\ncontext  cached tokens/s  recompute tokens/s  speed-up\n");
  for (const int64_t ctx : {int64_t{256}, int64_t{1024}}) {
    if (quick && ctx > 256) break;
    LatentKvCache cache(cfg, 1, ctx + decode_tokens);
    const Tensor ids = random_ids(ctx, cfg.vocab_size, 7);
    for (int64_t past = 0; past < ctx; past += 256) {
      const CachedChunk chunk{0, past, std::min<int64_t>(256, ctx - past)};
      const Tensor part = random_ids(chunk.count, cfg.vocab_size, 8 + past);
      (void)model.forward_cached(part, {&chunk, 1}, cache.layers());
    }
    const int64_t n = quick ? 2 : 16;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) {
      const CachedChunk chunk{0, ctx + i, 1};
      (void)model.forward_cached(random_ids(1, cfg.vocab_size, i), {&chunk, 1}, cache.layers());
    }
    const double cached = static_cast<double>(n) / seconds_since(t0);
    const int64_t m = quick ? 1 : 3;
    t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < m; ++i) (void)model.logits(ids, {1, ctx});
    const double recompute = static_cast<double>(m) / seconds_since(t0);
    fmt::print("{:7}  {:15.1f}  {:18.2f}  {:7.0f}x\n", ctx, cached, recompute, cached / recompute);
  }
  return 0;
}
