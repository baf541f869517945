// `moe info`: parameter counts and weight memory of a configuration, for planning.
#include <fmt/format.h>

#include "cli/commands.h"
#include "infer/generation.h"
#include "model/latent_kv_cache.h"
#include "model/v4/v4_cache.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/parallel.h"
#include "core/simd.h"
#include "kernels/fma_peak.h"
#include "io/model_spec.h"
#include "model/config.h"

namespace moe::cli {

namespace {

std::string human_count(int64_t n) {
  const double v = static_cast<double>(n);
  if (n >= 1000000000) return fmt::format("{:.2f}B", v / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f}M", v / 1e6);
  if (n >= 1000) return fmt::format("{:.2f}K", v / 1e3);
  return fmt::format("{}", n);
}

// DeepSeek-V4's own parts (SPEC §6): attention layout, compressed layers, hash routing, mHC,
// MTP, and its inference cache (model/v4/v4_cache.h).
void print_v4_info(const ModelConfig& c, const ParamCounts& p) {
  int64_t sliding = 0, csa = 0, hca = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t r = c.compress_ratio(l);
    (r == 0 ? sliding : r == 4 ? csa : hca)++;
  }
  fmt::print("attention        1 shared KV head of {} (rope {}), q_lora {}, output {} groups x {}, "
             "window {}\n", c.head_dim, c.qk_rope_head_dim, c.q_lora_rank, c.o_groups,
             c.o_lora_rank, c.sliding_window);
  fmt::print("layer kinds      {} sliding only, {} CSA (ratio 4, indexer {} heads x {} keeps {}), "
             "{} HCA; {} hash-routed\n", sliding, csa, c.index_n_heads, c.index_head_dim,
             c.index_topk, hca, c.num_hash_layers);
  fmt::print("hyper-conn.      {} streams, {} Sinkhorn iterations\n", c.hc_mult, c.hc_sinkhorn_iters);
  if (c.num_nextn_predict_layers > 0)
    fmt::print("MTP              {} layer(s), {} parameters ({}) besides the total\n",
               c.num_nextn_predict_layers, human_count(p.mtp), p.mtp);
  const int64_t slots = EngineOptions{}.max_sequences, context = default_context(c);
  fmt::print("V4 KV cache      {:.0f} B per token (compressed entries and indexer keys, fp32, all "
             "layers) + {} per sequence (window and compressor-state rings); {} for {} sequences "
             "x {} positions (moe serve's default --slots, --context)\n",
             V4KvCache::entry_bytes_per_token(c),
             format_bytes(V4KvCache::ring_bytes_per_sequence(c)),
             format_bytes(V4KvCache::bytes_for(c, slots, context)), slots, context);
}

// What a LoRA fine-tune of a V4 model holds per rank before activations, at EP `ep` with rank
// `r` on every target the V4 recipes use (attention wq_a, wq_b, wkv, wo_b; shared and routed
// experts): the frozen non-expert weights in fp32 on every rank (the engine decodes FP8/BF16 to
// fp32 at load), the MXFP4 routed experts (MTP's included) split over the EP group, and the
// adapters with their gradients and AdamW moments (4 fp32 values per adapter weight).
void print_v4_lora_per_rank(const ModelConfig& c, const ParamCounts& p, int64_t ep, int64_t r) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, d = c.head_dim;
  const int64_t ql = c.q_lora_rank, go = c.o_groups * c.o_lora_rank;
  const int64_t H = c.num_attention_heads;
  const int64_t blocks = c.num_hidden_layers + c.num_nextn_predict_layers;
  const int64_t expert_adapter = r * (3 * D + 3 * I);  // gate, up (D -> I), down (I -> D)
  const int64_t dense_adapter =
      r * ((D + ql) + (ql + H * d) + (D + d) + (go + D)) + c.n_shared_experts * expert_adapter;
  const int64_t routed_adapter = c.n_routed_experts / ep * expert_adapter;
  const int64_t adapters = blocks * (dense_adapter + routed_adapter);
  const int64_t mtp_routed = c.num_nextn_predict_layers * c.n_routed_experts * 3 * D * I;
  const int64_t frozen_fp32 = (p.total + p.mtp - p.routed_expert - mtp_routed) * 4;
  const int64_t experts = (p.routed_expert + mtp_routed) * 17 / 32 / ep;
  const int64_t adapter_bytes = adapters * 4 * 4;
  fmt::print("LoRA per rank    EP {}, r {} on attention + shared + routed experts: {} before "
             "activations\n", ep, r, format_bytes(frozen_fp32 + experts + adapter_bytes));
  fmt::print("                 = frozen fp32 non-expert weights {} + MXFP4 routed experts {} "
             "+ adapters {} ({} weights, with grads and AdamW moments)\n",
             format_bytes(frozen_fp32), format_bytes(experts), format_bytes(adapter_bytes),
             human_count(adapters));
}

void print_info(const std::string& spec) {
  const ModelConfig c = resolve_model_config(spec);
  const ParamCounts p = count_params(c);
  const int64_t dense_layers = std::min(c.first_k_dense_replace, c.num_hidden_layers);
  fmt::print("model            {} ({})\n", spec, c.model_type);
  fmt::print("layers           {} ({} dense, {} MoE)\n", c.num_hidden_layers,
             c.n_routed_experts ? dense_layers : c.num_hidden_layers,
             c.n_routed_experts ? c.num_hidden_layers - dense_layers : 0);
  fmt::print("hidden           {}, heads {}, vocab {}\n", c.hidden_size, c.num_attention_heads,
             c.vocab_size);
  if (c.n_routed_experts)
    fmt::print("experts          {} routed (width {}) + {} shared, top-{}, {} group(s) keep {}, {}\n",
               c.n_routed_experts, c.moe_intermediate_size, c.n_shared_experts,
               c.num_experts_per_tok, c.n_group, c.topk_group, c.scoring_func);
  fmt::print("parameters       {} total ({})\n", human_count(p.total), p.total);
  fmt::print("active per token {} ({})\n", human_count(p.active_per_token), p.active_per_token);
  fmt::print("routed experts   {} ({:.1f}% of total)\n", human_count(p.routed_expert),
             100.0 * static_cast<double>(p.routed_expert) / static_cast<double>(p.total));
  fmt::print("weight memory    fp32 {}, bf16 {}\n", format_bytes(p.total * 4),
             format_bytes(p.total * 2));
  // MXFP4 routed experts: 4 bits per weight plus one E8M0 byte per 32 weights.
  fmt::print("                 bf16 with MXFP4 routed experts {}\n",
             format_bytes((p.total - p.routed_expert) * 2 + p.routed_expert * 17 / 32));
  const int64_t train_bytes = p.total * 4 * 4;  // weights, grads, two AdamW moments
  fmt::print("training state   {} (fp32 weights + grads + AdamW moments, before activations)\n",
             format_bytes(train_bytes));
  // Frozen MXFP4 experts: packed weights only; everything else keeps weights, grads, moments.
  const int64_t frozen_bytes = (p.total - p.routed_expert) * 4 * 4 + p.routed_expert * 17 / 32;
  fmt::print("                 {} with frozen MXFP4 routed experts (--model.experts mxfp4){}\n",
             format_bytes(frozen_bytes), c.mxfp4_experts() ? ": this model's format" : "");
  if (c.is_v4()) {
    print_v4_info(c, p);
    print_v4_lora_per_rank(c, p, 8, 8);
    return;
  }
  const int64_t kv_per_token = LatentKvCache::bytes_per_token(c);
  const EngineOptions serving;  // what `moe generate` / `moe serve` allocate by default
  fmt::print("MLA KV cache     {} per token (fp32 latent, all layers); {} for {} sequences x {} "
             "positions (moe serve's default --slots, --context)\n",
             format_bytes(kv_per_token),
             format_bytes(kv_per_token * serving.max_sequences * default_context(c)),
             serving.max_sequences, default_context(c));
}

// The machine the kernels run on: what MFU is measured against.
void print_machine() {
  fmt::print("cpu              {}\n", simd::cpu_model());
  fmt::print("simd targets     {} (in use: {})\n", simd::supported_names(),
             simd::description(simd::current()));
  const FmaPeak peak = measure_fma_peak(num_threads());
  fmt::print("fp32 FMA peak    {:.1f} GFLOP/s on {} thread{} (measured now)\n", peak.gflops, peak.threads,
             peak.threads == 1 ? "" : "s");
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "print parameter counts and memory of a model config");
  auto spec = std::make_shared<std::string>();
  auto machine = std::make_shared<bool>(false);
  cmd->add_option("--config", *spec, "preset name (" + preset_names_joined() +
                                         "), config.json file or model directory");
  cmd->add_flag("--machine", *machine,
                "print the CPU, its SIMD targets and its measured fp32 FMA peak (the MFU denominator)");
  cmd->callback([spec, machine] {
    if (*machine) print_machine();
    if (!spec->empty()) print_info(*spec);
    if (spec->empty() && !*machine) fail("moe info: give --config SPEC and/or --machine");
  });
}

}  // namespace moe::cli
