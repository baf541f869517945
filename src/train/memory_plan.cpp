#include "train/memory_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>

#include "core/error.h"
#include "core/parallel.h"
#include "core/simd.h"
#include "data/tokenizer.h"
#include "io/model_spec.h"
#include "kernels/mxfp4.h"
#include "lora/lora_config.h"
#include "model/lm_head_loss.h"
#include "model/v4/v4_lora.h"
#include "train/memory_replay.h"

namespace moe {

namespace {

namespace fs = std::filesystem;

using memory_replay::at;
using memory_replay::Dims;
using memory_replay::LayerShape;
using memory_replay::Ledger;
using memory_replay::Lin;
using memory_replay::V4Dims;
using memory_replay::V4LayerShape;
using memory_replay::Workspace;

// ---------------------------------------------------------------- static parts

struct Statics {
  int64_t fp32_weights = 0;        // every fp32 base tensor (params)
  int64_t expert_fp32 = 0;         // of which routed experts
  int64_t expert_packed_bytes = 0; // MXFP4 routed experts (data + scales)
  int64_t embed_head = 0;          // embedding + LM head (fp32 floats)
  int64_t frozen_fp32 = 0;         // fp32 tensors that never train (V4: indexers, hash tables)
  int64_t trainable = 0;           // floats with gradient and AdamW moments (pretraining)
  int64_t adapters_dense = 0, adapters_experts = 0;  // adapter floats

  // A layer's local routed experts (`weights` of them in all): packed bytes when frozen in
  // MXFP4, trained fp32 floats otherwise.
  void add_routed_experts(int64_t weights, bool mxfp4) {
    if (mxfp4) {
      expert_packed_bytes += weights / 2 + weights / mxfp4::kBlock;
    } else {
      fp32_weights += weights;
      expert_fp32 += weights;
      trainable += weights;
    }
  }
};

std::string describe_bytes_per_token(int64_t bytes, int64_t tokens) {
  return tokens > 0 ? fmt::format("{}/token", format_bytes(bytes / tokens)) : std::string();
}

std::string format_count_short(double n) {
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{}", static_cast<int64_t>(n));
}

}  // namespace

int64_t MemoryPlan::total_peak() const {
  int64_t s = 0;
  for (int64_t v : peak) s += v;
  return s;
}

namespace {

// The adapters a configuration asks for: which modules carry them (match) and their ranks.
struct Adapters {
  std::optional<LoraTargetMatcher> match;
  int64_t r_dense = 0, r_expert = 0;
};

// DeepSeekModel's layers (model/model.cpp) and its static parts; adapters as its add_lora
// decides.
std::vector<LayerShape> v3_layers(const ModelConfig& mc, const Dims& d, Adapters& ad,
                                  Statics& st) {
  auto rank_of = [&](const std::string& module) -> int64_t {
    return ad.match && ad.match->matches(module) ? ad.r_dense : 0;
  };
  const int64_t qk = d.dn + d.dr, E = d.E;
  std::vector<LayerShape> layers;
  st.embed_head = 2 * d.V * d.D;
  st.fp32_weights = st.embed_head + d.D;  // + final norm
  st.trainable = st.fp32_weights;
  for (int64_t l = 0; l < d.L; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerShape L;
    L.moe = mc.is_moe_layer(l);
    L.q_lora = d.qr > 0;
    int64_t attn = 0;
    if (L.q_lora) {
      L.q_a = {d.D, d.qr, rank_of(p + "self_attn.q_a_proj")};
      L.q_b = {d.qr, d.H * qk, rank_of(p + "self_attn.q_b_proj")};
      attn += d.D * d.qr + d.qr + d.qr * d.H * qk;
    } else {
      L.q = {d.D, d.H * qk, rank_of(p + "self_attn.q_proj")};
      attn += d.D * d.H * qk;
    }
    L.kv_a = {d.D, d.kvr + d.dr, rank_of(p + "self_attn.kv_a_proj_with_mqa")};
    L.kv_b = {d.kvr, d.H * (d.dn + d.dv), rank_of(p + "self_attn.kv_b_proj")};
    L.o = {d.H * d.dv, d.D, rank_of(p + "self_attn.o_proj")};
    attn += (d.kvr + d.dr) * d.D + d.kvr + d.kvr * d.H * (d.dn + d.dv) + d.H * d.dv * d.D;
    const int64_t norms = 2 * d.D;
    int64_t mlp = 0;
    if (!L.moe) {
      const int64_t I = mc.intermediate_size;
      L.gate = {d.D, I, rank_of(p + "mlp.gate_proj")};
      L.up = {d.D, I, rank_of(p + "mlp.up_proj")};
      L.down = {I, d.D, rank_of(p + "mlp.down_proj")};
      mlp = 3 * d.D * I;
      st.fp32_weights += attn + norms + mlp;
      st.trainable += attn + norms + mlp;
    } else {
      const int64_t Is = d.Im * mc.n_shared_experts;
      if (Is > 0) {
        L.gate = {d.D, Is, rank_of(p + "mlp.shared_experts.gate_proj")};
        L.up = {d.D, Is, rank_of(p + "mlp.shared_experts.up_proj")};
        L.down = {Is, d.D, rank_of(p + "mlp.shared_experts.down_proj")};
      }
      const int64_t router = E * d.D, bias = E, shared = 3 * d.D * Is;
      st.fp32_weights += attn + norms + router + bias + shared;
      st.trainable += attn + norms + router + shared;
      st.add_routed_experts(d.E_loc * 3 * d.D * d.Im, d.mxfp4);
      if (ad.match) {
        for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
          int64_t hits = 0;
          for (int64_t e = 0; e < E; ++e)
            hits += ad.match->matches(p + "mlp.experts." + std::to_string(e) + "." + proj);
          MOE_CHECK(hits == 0 || hits == E,
                    "lora: the targets select {} of the {} routed experts' {} in {}mlp.experts.*; "
                    "routed experts are adapted all together (one grouped adapter per layer): "
                    "select all or none", hits, E, proj, p);
          if (hits == 0) continue;
          const std::string_view pr(proj);
          (pr == "gate_proj" ? L.er_gate : pr == "up_proj" ? L.er_up : L.er_down) = ad.r_expert;
          st.adapters_experts += d.E_loc * ad.r_expert * (d.D + d.Im);
        }
      }
    }
    for (const Lin* lin : {&L.q, &L.q_a, &L.q_b, &L.kv_a, &L.kv_b, &L.o, &L.gate, &L.up, &L.down})
      st.adapters_dense += lin->adapter_params();
    layers.push_back(L);
  }
  if (ad.match) ad.match->check_all_used("lora");
  return layers;
}

// DeepSeekV4Model's blocks (model/v4/v4_model.cpp), the MTP block last, and its static parts:
// every tensor its constructor allocates (frozen ones too: the CSA indexers, the hash tables,
// the router biases, the attention's per-head norm weight of ones); adapters as its add_lora
// decides (select_v4_lora); the MTP block is never adapted.
std::vector<V4LayerShape> v4_layers(const ModelConfig& mc, const Dims& d, const V4Dims& v,
                                    Adapters& ad, Statics& st) {
  const int64_t D = d.D, n = v.n, M = v.mixes(), H = v.H, hd = v.hd, ql = v.q_lora;
  const int64_t go = v.o_groups * v.o_lora, E = d.E, Is = d.Im * mc.n_shared_experts;
  const int64_t hc_head = n * n * D + n + 1;
  st.embed_head = 2 * d.V * D;
  st.fp32_weights = st.embed_head + D + hc_head;  // + final norm, hc_head
  st.trainable = st.fp32_weights;
  if (v.mtp) {
    const int64_t mtp = 3 * D + 2 * D * D + hc_head;  // enorm, hnorm, norm, e_proj, h_proj
    st.fp32_weights += mtp;
    st.trainable += mtp;
  }
  std::vector<V4LayerShape> layers;
  const int64_t blocks = d.L + (v.mtp ? 1 : 0);
  for (int64_t l = 0; l < blocks; ++l) {
    V4LayerShape L;
    L.ratio = mc.compress_ratio(l);
    const bool hash = l < mc.num_hash_layers;
    // Trained: the two mHC sites, norms, attention, compressor, router and shared experts.
    int64_t trained = 2 * (M * n * D + M + 3) + 2 * D;
    trained += ql * D + ql + H * hd * ql + hd * D + hd + go * (H * hd / v.o_groups) + D * go + H;
    if (L.ratio > 0) {
      const int64_t coff = L.ratio == 4 ? 2 : 1;
      trained += 2 * coff * hd * D + L.ratio * coff * hd + hd;
    }
    trained += E * D + 3 * D * Is;
    // Frozen: the per-head norm's weight of ones, the indexer, the router bias (allocated in
    // hash layers too) and the hash table (ids held as floats).
    int64_t frozen = hd + E + (hash ? d.V * d.k : 0);
    if (L.ratio == 4) {
      const int64_t di = v.index_dim, hi = v.index_heads;
      frozen += hi * di * ql + hi * D + 2 * 2 * di * D + 4 * 2 * di + di;
    }
    st.fp32_weights += trained + frozen;
    st.frozen_fp32 += frozen;
    st.trainable += trained;
    st.add_routed_experts(d.E_loc * 3 * D * d.Im, d.mxfp4);

    V4LayerLora sel;
    const bool adapted = ad.match && l < d.L;
    if (adapted) sel = select_v4_lora(mc, l, *ad.match, "lora");
    auto rank = [&](bool on) { return on ? ad.r_dense : 0; };
    L.wq_a = {D, ql, rank(sel.wq_a)};
    L.wq_b = {ql, H * hd, rank(sel.wq_b)};
    L.wkv = {D, hd, rank(sel.wkv)};
    L.wo_b = {go, D, rank(sel.wo_b)};
    LayerShape& F = L.ffn;
    F.moe = true;
    if (Is > 0) {
      F.gate = {D, Is, rank(sel.shared[0])};
      F.up = {D, Is, rank(sel.shared[1])};
      F.down = {Is, D, rank(sel.shared[2])};
    }
    int64_t* expert_ranks[3] = {&F.er_gate, &F.er_up, &F.er_down};
    for (size_t part = 0; part < 3; ++part) {
      if (!sel.experts[part]) continue;
      *expert_ranks[part] = ad.r_expert;
      st.adapters_experts += d.E_loc * ad.r_expert * (D + d.Im);
    }
    for (const Lin* lin : {&L.wq_a, &L.wq_b, &L.wkv, &L.wo_b, &F.gate, &F.up, &F.down})
      st.adapters_dense += lin->adapter_params();
    layers.push_back(L);
  }
  if (ad.match) check_v4_lora_targets_used(mc, *ad.match, "lora");
  return layers;
}

// "1.2 MiB per CSA layer, ..." from each kind's first layer.
std::string describe_v4_layers(const std::vector<V4LayerShape>& layers, bool mtp,
                               const std::vector<int64_t>& saved) {
  std::vector<std::string> parts;
  std::vector<std::string> seen;
  const size_t main = layers.size() - (mtp ? 1 : 0);
  for (size_t l = 0; l < main && l < saved.size(); ++l) {
    const int64_t r = layers[l].ratio;
    const std::string kind = r == 0 ? "sliding-window" : r == 4 ? "CSA" : "HCA";
    if (std::find(seen.begin(), seen.end(), kind) != seen.end()) continue;
    seen.push_back(kind);
    parts.push_back(fmt::format("{} per {} layer", format_bytes(saved[l]), kind));
  }
  if (mtp && saved.size() == layers.size())
    parts.push_back(fmt::format("{} the MTP block", format_bytes(saved.back())));
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

MemoryPlan plan_training_memory(const TrainConfig& cfg, const ModelConfig& mc, int world_size,
                                int threads, double expert_load) {
  mc.validate("model config");
  const bool v4 = mc.is_v4();
  MOE_CHECK(world_size >= 1, "--ranks: expected at least 1 rank, got {}", world_size);
  const int64_t W = world_size, ep = cfg.parallel.ep;
  MOE_CHECK(cfg.data.batch_size % W == 0,
            "data.batch_size = {}: must be divisible by the number of ranks ({}), each rank "
            "taking an equal part of every batch", cfg.data.batch_size, W);
  MOE_CHECK(ep >= 1 && W % ep == 0, "parallel.ep = {}: must divide the number of ranks ({})", ep,
            W);
  const int64_t E = mc.n_routed_experts;
  MOE_CHECK(ep == 1 || (E >= ep && E % ep == 0),
            "parallel.ep = {}: {} routed experts cannot be split evenly over {} ranks", ep, E, ep);
  MOE_CHECK(cfg.data.seq_len <= mc.max_position_embeddings,
            "data.seq_len: expected an integer <= model.max_position_embeddings ({}), got {}",
            mc.max_position_embeddings, cfg.data.seq_len);

  Dims d;
  d.B = cfg.data.batch_size / W;
  d.S = cfg.data.seq_len;
  d.T = d.B * d.S;
  d.D = mc.hidden_size;
  d.V = mc.vocab_size;
  d.L = mc.num_hidden_layers;
  d.H = mc.num_attention_heads;
  d.dn = mc.qk_nope_head_dim;
  d.dr = mc.qk_rope_head_dim;
  d.dv = mc.v_head_dim;
  d.qr = mc.q_lora_rank;
  d.kvr = mc.kv_lora_rank;
  d.E = E;
  d.E_loc = E / ep;
  d.k = mc.num_experts_per_tok;
  d.Im = mc.moe_intermediate_size;
  d.slots = d.T * d.k;
  // Balanced routing: each rank's experts receive as many rows as its tokens send. Under expert
  // parallelism a rank may receive more (expert_load: its busiest layer's share, 1 = balanced).
  MOE_CHECK(expert_load >= 1.0 && (ep == 1 || expert_load <= static_cast<double>(ep)),
            "--expert-load {}: expected a factor between 1 (balanced) and the EP size {}",
            expert_load, ep);
  d.R = ep > 1 ? static_cast<int64_t>(std::ceil(expert_load * static_cast<double>(d.slots)))
               : d.slots;
  d.ep = ep;
  d.threads = threads > 0 ? threads : num_threads();
  d.finetune = cfg.finetune;
  d.mxfp4 = mc.mxfp4_experts();
  d.base_grads = !cfg.finetune;
  d.experts_trainable = !cfg.finetune && !d.mxfp4;
  d.dropout = cfg.finetune && cfg.lora.dropout > 0;
  d.aux = mc.aux_loss_alpha > 0;

  V4Dims v;
  if (v4) {
    v.n = mc.hc_mult;
    v.sinkhorn_iters = mc.hc_sinkhorn_iters;
    v.H = mc.num_attention_heads;
    v.hd = mc.head_dim;
    v.rope = mc.qk_rope_head_dim;
    v.q_lora = mc.q_lora_rank;
    v.o_groups = mc.o_groups;
    v.o_lora = mc.o_lora_rank;
    v.window = mc.sliding_window;
    v.index_heads = mc.index_n_heads;
    v.index_dim = mc.index_head_dim;
    v.index_topk = mc.index_topk;
    v.mtp = mc.num_nextn_predict_layers > 0;
  }

  // Which modules carry adapters, as the model's add_lora decides.
  std::optional<LoraSettings> lora;
  Adapters ad;
  if (cfg.finetune) {
    lora = lora_settings(cfg);
    lora->validate("lora");
    ad.match.emplace(*lora);
    ad.r_dense = lora->shape_for(false).rank;
    ad.r_expert = lora->shape_for(true).rank;
  }
  Statics st;
  std::vector<LayerShape> layers;
  std::vector<V4LayerShape> blocks;
  if (v4)
    blocks = v4_layers(mc, d, v, ad, st);
  else
    layers = v3_layers(mc, d, ad, st);
  if (cfg.finetune) st.trainable = 0;

  MemoryPlan plan;
  plan.finetune = cfg.finetune;
  plan.world_size = world_size;
  plan.ep = ep;
  plan.batch_per_rank = d.B;
  plan.seq_len = d.S;
  plan.tokens_per_rank = d.T;
  plan.routed_experts = E;
  plan.local_experts = d.E_loc;
  plan.expert_rows_per_rank = d.R;
  plan.expert_load = ep > 1 ? expert_load : 1.0;
  plan.threads = d.threads;
  plan.expert_format = mc.expert_format;
  plan.simd = simd::name(simd::current());
  plan.lora_r = ad.r_dense;
  plan.lora_expert_r = ad.r_expert;
  plan.adapter_params = st.adapters_dense + st.adapters_experts;
  plan.trainable_params = st.trainable;

  // The static categories, then one replayed micro-batch on top of them. V3's RoPE table is
  // sized by the sequence; V4's two tables grow inside the replay, as the first step grows them.
  Ledger ledger;
  Workspace ws;
  const int64_t rope_bytes = v4 ? 0 : d.S * d.dr * 4;  // cos and sin [seq, rope/2]
  const int64_t weight_bytes = 4 * st.fp32_weights + st.expert_packed_bytes + rope_bytes;
  const int64_t adapter_bytes = 4 * plan.adapter_params;
  ledger.alloc(MemCategory::Weights, weight_bytes);
  ledger.alloc(MemCategory::Grads, 4 * st.trainable);
  ledger.alloc(MemCategory::Optimizer, 8 * st.trainable);
  ledger.alloc(MemCategory::AdapterWeights, adapter_bytes);
  ledger.alloc(MemCategory::AdapterGrads, adapter_bytes);
  ledger.alloc(MemCategory::AdapterOptimizer, 2 * adapter_bytes);
  const memory_replay::ReplayResult replay =
      v4 ? memory_replay::replay_v4_training_step(d, v, blocks, ledger, ws)
         : memory_replay::replay_training_step(d, layers, ledger, ws);
  for (int c = 0; c < kMemCategoryCount; ++c)
    plan.peak[static_cast<size_t>(c)] = ledger.peak(static_cast<MemCategory>(c));
  plan.peak[at(MemCategory::Workspace)] = ws.bytes(d.threads);

  // Explanations and the composition of the static parts.
  auto why = [&](MemCategory c, std::string s) { plan.why[at(c)] = std::move(s); };
  auto line = [&](MemCategory c, std::string what, int64_t bytes) {
    if (bytes > 0) plan.lines.push_back({c, std::move(what), bytes});
  };
  const std::string experts_where =
      ep > 1 ? fmt::format("{} of {} routed experts per rank", d.E_loc, E)
             : fmt::format("{} routed experts", E);
  if (d.mxfp4) {
    why(MemCategory::Weights,
        fmt::format("fp32 base + MXFP4 routed experts (4.25 bits/weight; {})", experts_where));
  } else {
    why(MemCategory::Weights, fmt::format("fp32 base incl. routed experts ({})", experts_where));
  }
  line(MemCategory::Weights, "embedding + LM head (fp32)", 4 * st.embed_head);
  line(MemCategory::Weights,
       v4 ? fmt::format("attention + compressors, mHC, norms, routers, shared experts{} (fp32)",
                        v.mtp ? ", MTP module" : "")
          : std::string("attention, norms, router, dense and shared MLPs (fp32)"),
       4 * (st.fp32_weights - st.embed_head - st.expert_fp32 - st.frozen_fp32));
  line(MemCategory::Weights,
       "never trained: CSA indexers, hash-routing tables, router biases (fp32)",
       4 * st.frozen_fp32);
  line(MemCategory::Weights, fmt::format("routed experts, fp32 ({})", experts_where),
       4 * st.expert_fp32);
  line(MemCategory::Weights,
       fmt::format("routed experts, MXFP4 packed: data out·in/2 + scales out·in/32 bytes ({})",
                   experts_where),
       st.expert_packed_bytes);
  if (v4) {
    line(MemCategory::Weights,
         "RoPE cos/sin tables (sliding-window and compressed), grown by the first step: old and "
         "new together for a moment",
         plan[MemCategory::Weights] - weight_bytes);
  } else {
    line(MemCategory::Weights, fmt::format("RoPE cos/sin table [{}, {}] x 2", d.S, d.dr / 2),
         rope_bytes);
  }
  if (cfg.finetune) {
    why(MemCategory::Grads, "none: the base is frozen");
    why(MemCategory::Optimizer, "none: the base is frozen");
    why(MemCategory::AdapterWeights,
        fmt::format("LoRA A [r, in] + B [out, r], r {}{}: {} parameters", ad.r_dense,
                    ad.r_expert != ad.r_dense ? fmt::format(" (routed experts {})", ad.r_expert)
                                              : "",
                    format_count_short(static_cast<double>(plan.adapter_params))));
    why(MemCategory::AdapterGrads, "one fp32 gradient per adapter weight");
    why(MemCategory::AdapterOptimizer, "AdamW first and second moments (2 x adapter weights)");
    line(MemCategory::AdapterWeights,
         v4 ? "attention and shared-expert adapters" : "attention, dense and shared-MLP adapters",
         4 * st.adapters_dense);
    line(MemCategory::AdapterWeights,
         fmt::format("routed-expert adapters (grouped, {} experts per layer)", d.E_loc),
         4 * st.adapters_experts);
  } else {
    why(MemCategory::Grads,
        fmt::format("fp32 gradient of every trainable weight ({} params{}{})",
                    format_count_short(static_cast<double>(st.trainable)),
                    d.mxfp4 ? "; MXFP4 experts frozen" : "",
                    v4 ? "; indexers, hash tables and router biases never train" : ""));
    why(MemCategory::Optimizer, "AdamW first and second moments (2 x trainable weights)");
    why(MemCategory::AdapterWeights, "no adapters (pretraining)");
    why(MemCategory::AdapterGrads, "no adapters (pretraining)");
    why(MemCategory::AdapterOptimizer, "no adapters (pretraining)");
  }
  const int64_t saved = replay.saved_after_forward;
  std::string per_layer;
  if (v4) {
    per_layer = describe_v4_layers(blocks, v.mtp, replay.saved_per_layer);
  } else {
    int64_t dense_layer = 0, moe_layer = 0;
    for (size_t l = 0; l < layers.size(); ++l)
      (layers[l].moe ? moe_layer : dense_layer) = replay.saved_per_layer[l];
    per_layer = fmt::format("{} per MoE layer{}", format_bytes(moe_layer),
                            dense_layer > 0
                                ? fmt::format(", {} per dense layer", format_bytes(dense_layer))
                                : "");
  }
  why(MemCategory::Activations,
      fmt::format("{} saved for backward ({}; {}) + {} live at the peak, in {}",
                  format_bytes(saved), per_layer, describe_bytes_per_token(saved, d.T),
                  format_bytes(plan[MemCategory::Activations] - saved),
                  ledger.peak_phase(MemCategory::Activations)));
  const int64_t moe_layers =
      v4 ? static_cast<int64_t>(blocks.size())
         : std::count_if(layers.begin(), layers.end(), [](const LayerShape& L) { return L.moe; });
  const int64_t csa_layers = std::count_if(blocks.begin(), blocks.end(),
                                           [](const V4LayerShape& L) { return L.ratio == 4; });
  why(MemCategory::Routing,
      fmt::format("dispatch handles of {} MoE layers ({} token slots{}{}){}, held until backward",
                  moe_layers, d.slots, ep > 1 ? fmt::format(", {} expert rows", d.R) : "",
                  d.dropout ? " + dropout row keys" : "",
                  csa_layers > 0 ? fmt::format(" + the CSA indexer's picks of {} layers ({} per "
                                               "token)", csa_layers, v.index_topk)
                                 : ""));
  why(MemCategory::Scratch,
      v4 ? fmt::format("{}: that moment's per-thread slabs (attention scores, mHC Sinkhorn "
                       "traces, compressor pooling) and transients (logits chunk {} x {}, "
                       "positions)",
                       ledger.peak_phase(MemCategory::Scratch),
                       std::min(LMHeadLoss::chunk_rows(d.V, d.D), d.T), d.V)
         : fmt::format("{}: attention positions of every layer + the transient buffer of that "
                       "moment (logits chunk {} x {} or attention slabs)",
                       ledger.peak_phase(MemCategory::Scratch),
                       std::min(LMHeadLoss::chunk_rows(d.V, d.D), d.T), d.V));
  why(MemCategory::Workspace,
      fmt::format("matmul packing buffers: {} threads, {} kernels (main thread {})", d.threads,
                  plan.simd, format_bytes(ws.main_bytes())));
  return plan;
}

ModelConfig resolve_plan_model(const TrainConfig& cfg, std::string* note) {
  if (cfg.finetune) {
    // The base's vocabulary stays; resolve_train_model only checks the tokenizer fits in it.
    const std::string& spec = cfg.model.preset.empty() ? cfg.model.weights : cfg.model.preset;
    MOE_CHECK(!spec.empty(), "model.weights: expected the base model's directory, or "
              "--model.preset NAME to plan for a preset");
    MOE_CHECK(!cfg.model.preset.empty() || fs::exists(spec),
              "model.weights: {}: no such model directory; give --model PRESET (or "
              "--model.preset) to plan for a preset or a config.json instead", spec);
    const ModelConfig base = resolve_model_config(spec);
    return resolve_train_model(cfg, base.vocab_size, base.eos_token_id);
  }
  int64_t vocab = 0, eot = 0;
  const std::string& t = cfg.data.tokenizer;
  if (t == ByteTokenizer::kKind) {
    vocab = padded_vocab_size(ByteTokenizer::kVocab);
    eot = ByteTokenizer::kEndOfText;
  } else if (!t.empty() && fs::is_regular_file(t)) {
    const auto tok = load_tokenizer(t);
    vocab = padded_vocab_size(tok->vocab_size());
    eot = tok->end_of_text();
  } else {
    const ModelConfig preset = resolve_model_config(cfg.model.preset);
    vocab = preset.vocab_size;
    eot = preset.eos_token_id;
    if (note)
      *note = fmt::format("data.tokenizer \"{}\" not found: the preset's vocabulary ({}) is assumed",
                          t, vocab);
  }
  return resolve_train_model(cfg, vocab, eot);
}

std::string format_memory_plan(const MemoryPlan& p, const std::string& title) {
  std::string out = title.empty() ? std::string() : title + "\n";
  const bool ranks = p.world_size > 1;
  out += fmt::format(
      "{}: {} sequence{} x {} tokens = {} tokens per micro-batch{}; {} routed experts{}; {} "
      "kernel threads\n",
      p.finetune ? fmt::format("LoRA fine-tune (r {}{})", p.lora_r,
                               p.lora_expert_r != p.lora_r
                                   ? fmt::format(", experts r {}", p.lora_expert_r)
                                   : "")
                 : std::string("pretraining"),
      p.batch_per_rank, p.batch_per_rank == 1 ? "" : "s", p.seq_len, p.tokens_per_rank,
      ranks ? fmt::format(" on each of {} ranks (EP {})", p.world_size, p.ep) : "",
      p.expert_format,
      p.ep > 1 ? fmt::format(", {} of {} per rank", p.local_experts, p.routed_experts) : "",
      p.threads);
  const int64_t total = p.total_peak();
  out += fmt::format("{:<18} {:>11} {:>6}  {}\n", ranks ? "category (rank)" : "category",
                     "peak", "share", "what");
  for (int c = 0; c < kMemCategoryCount; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    const bool adapter = cat == MemCategory::AdapterWeights || cat == MemCategory::AdapterGrads ||
                         cat == MemCategory::AdapterOptimizer;
    if (adapter && !p.finetune) continue;
    if (cat == MemCategory::KvCache) continue;  // training has no KV cache
    const int64_t b = p.peak[static_cast<size_t>(c)];
    out += fmt::format("{:<18} {:>11} {:>5.1f}%  {}\n", mem_category_name(cat), format_bytes(b),
                       total > 0 ? 100.0 * static_cast<double>(b) / static_cast<double>(total) : 0.0,
                       p.why[static_cast<size_t>(c)]);
  }
  out += fmt::format("{:<18} {:>11} {:>6}  sum of the category peaks{}\n", "total",
                     format_bytes(total), "", ranks ? ", per rank" : "");
  if (!p.lines.empty()) {
    out += "of which\n";
    for (const MemoryPlanLine& l : p.lines)
      out += fmt::format("  {:<16} {:>11}  {}\n", mem_category_name(l.category),
                         format_bytes(l.bytes), l.what);
  }
  return out;
}

}  // namespace moe
