// The replay of one DeepSeekV4Model training micro-batch (model/v4/v4_model.cpp) for `moe plan`
// (train/memory_replay.h): the model's own parts (the mHC sites and heads, the attention with
// its compressors and CSA indexer, the MTP module, the RoPE tables) here, allocation by
// allocation in the engine's order; the parts it shares with DeepSeekModel (Linear with LoRA,
// RMSNorm, the MoE layer, the LM head) from memory_replay_parts.h.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "train/memory_replay.h"
#include "train/memory_replay_parts.h"

namespace moe::memory_replay {

namespace {

// HyperConnectionSite (hyper_connections.cpp): X, m and the RMS factor from pre() to
// backward_pre(); the coefficients from pre() to post(); the sublayer output from post() to
// backward_post(); dX's residual part and d coef from backward_post() to backward_pre().
struct HcSaved {
  Buf x, m, rstd, coef, out, d_x, d_coef;
};
// HyperHead: X, m and the RMS factor.
struct HeadSaved {
  Buf x, m, rstd;
};
// V4Attention besides its linears: q_norm keeps wq_a's output, kv_norm wkv's; wo_b its input z
// when its backward reads it; the compressed entries and CSA picks until the attention's backward.
struct AttnSaved {
  NormSaved q_norm, kv_norm;
  Buf q, q_rstd, stats, z, entries, picks;
};
struct BlockSaved {
  HcSaved hc_attn, hc_ffn;
  NormSaved attn_norm, ffn_norm;
  AttnSaved attn;
  MoeSaved moe;
};
// The MTP module's own state (besides its block): the norms' inputs, the shifted ids its
// embedding keeps, its head and final norm.
struct MtpSaved {
  NormSaved enorm, hnorm, norm;
  Buf ids;
  HeadSaved head;
};

// A RopeTable (model/rope.cpp): ensure() grows it to max(len, 1.5 x its length), building the
// new cos/sin tables before dropping the old ones.
struct RopeTableState {
  int64_t len = 0;
  Buf storage;
};

class V4StepReplay : public ReplayParts {
 public:
  V4StepReplay(const Dims& d, const V4Dims& v, const std::vector<V4LayerShape>& layers,
               Ledger& ledger, Workspace& ws)
      : ReplayParts(d, ledger, ws), v_(v), layers_(layers) {}

  // Activations held once the main blocks' forward is done, and what each block added (the MTP
  // block's last).
  int64_t saved_after_forward = 0;
  std::vector<int64_t> saved_per_layer;

  void run() {
    const int64_t T = d_.T, D = d_.D, n = v_.n;
    const size_t main_layers = layers_.size() - (v_.mtp ? 1 : 0);
    phase("embedding");
    Buf tokens = i32(MemCategory::Activations, T), targets = i32(MemCategory::Activations, T);
    std::vector<BlockSaved> saved(layers_.size());
    Buf X;
    {
      Buf e = act(T * D);  // the embedding's rows, copied into every stream
      X = act(T * n * D);
    }
    int64_t before = ledger_.current(MemCategory::Activations);
    for (size_t l = 0; l < main_layers; ++l) {
      X = block_forward(l, X, saved[l]);
      const int64_t now = ledger_.current(MemCategory::Activations);
      saved_per_layer.push_back(now - before);
      before = now;
    }
    saved_after_forward = ledger_.current(MemCategory::Activations);

    phase("hc_head + norm + LM head (chunked logits)");
    HeadSaved head;
    NormSaved final_norm;
    Buf d_head_in;
    {
      Buf h = head_forward(X, head);
      Buf y = norm_forward(h, D, final_norm);
      d_head_in = lm_head_loss();
    }
    MtpSaved mtp;
    Buf d_mtp_head_in;
    if (v_.mtp) {
      const size_t l = main_layers;
      phase("MTP input (embedding of the next tokens + h_proj of the streams)");
      mtp.ids = i32(MemCategory::Activations, T);
      Buf mtp_targets = i32(MemCategory::Activations, T);
      Buf Xm;
      {
        Buf e;
        {
          Buf embedded = act(T * D);
          Buf normed = norm_forward(embedded, D, mtp.enorm);
          e = linear_forward(e_proj());
        }
        Buf Xin;
        {
          Buf normed = norm_forward(X, T * n, D, mtp.hnorm);
          Xin = linear_forward(h_proj(), T * n);
        }
        e.reset();
        const int64_t start = ledger_.current(MemCategory::Activations);
        Xm = block_forward(l, Xin, saved[l]);
        saved_per_layer.push_back(ledger_.current(MemCategory::Activations) - start);
      }
      X.reset();
      phase("MTP hc_head + norm + LM head (chunked logits)");
      Buf h = head_forward(Xm, mtp.head);
      Buf y = norm_forward(h, D, mtp.norm);
      d_mtp_head_in = lm_head_loss();
    }
    X.reset();

    Buf dX_mtp;
    if (v_.mtp) {
      phase("MTP head backward");
      Buf d = act(T * D);
      mtp.norm = {};
      d_mtp_head_in.reset();
      Buf dXm = head_backward(mtp.head);
      Buf dXin = block_backward(main_layers, saved[main_layers]);
      phase("MTP input backward");
      Buf de = act(T * D);  // Σ of the streams: the embedding side's gradient
      {
        Buf dh;
        {
          Buf normed = act(T * n * D);
          dh = linear_backward(h_proj(), T * n);
        }
        dX_mtp = act(T * n * D);
        mtp.hnorm = {};
      }
      Buf d_en;
      {
        Buf normed = act(T * D);
        d_en = linear_backward(e_proj());
      }
      de.reset();
      {
        Buf d_embedded = act(T * D);
        mtp.enorm = {};
        mtp.ids.reset();
      }
    }
    phase("hc_head + norm backward");
    Buf dX;
    {
      Buf d = act(T * D);
      final_norm = {};
      dX = head_backward(head);
    }
    d_head_in.reset();
    dX_mtp.reset();
    // Each block's backward runs while the gradient of its output is still held (dX).
    for (size_t l = main_layers; l-- > 0;) {
      Buf next = block_backward(l, saved[l]);
      dX = std::move(next);
    }
    phase("embedding backward");
    Buf dx = act(T * D);
  }

 private:
  // The MTP's projections [D, D], never adapted.
  Lin e_proj() const { return {d_.D, d_.D, 0}; }
  Lin h_proj() const { return {d_.D, d_.D, 0}; }

  void phase_layer(size_t l, const char* what) {
    const V4LayerShape& L = layers_[l];
    const char* kind = L.ratio == 0 ? "sliding window" : L.ratio == 4 ? "CSA" : "HCA";
    const bool mtp = v_.mtp && l + 1 == layers_.size();
    ledger_.set_phase(mtp ? fmt::format("MTP block ({}) {}", kind, what)
                          : fmt::format("layer {} ({}) {}", l, kind, what));
  }

  void rope_ensure(RopeTableState& t, int64_t len) {
    if (len <= t.len) return;
    const int64_t grown = std::max(len, t.len + t.len / 2);
    t.storage = f32(MemCategory::Weights, 2 * grown * (v_.rope / 2));  // cos and sin
    t.len = grown;
  }
  RopeTableState& rope_of(int64_t ratio) { return ratio > 0 ? compressed_rope_ : window_rope_; }

  // ---------------------------------------------------------- mHC (hyper_connections.cpp)

  // project(): m = fn·vec(X) over T rows of n·D.
  void hc_project(int64_t mixes) { ws_.top_nt(d_.T, mixes, v_.n * d_.D); }
  // project_backward(): dX += G·fn, and fn's gradient when it trains.
  void hc_project_backward(int64_t mixes) {
    const int64_t N = v_.n * d_.D;
    ws_.top_nn(d_.T, N, mixes);
    if (d_.base_grads) ws_.top_tn(mixes, N, d_.T);
  }

  Buf hc_pre(const Buf& X, HcSaved& s) {
    const int64_t T = d_.T, M = v_.mixes();
    Buf m = act(T * M), r = act(T);
    hc_project(M);
    s.coef = act(T * M);
    Buf u = act(T * d_.D);
    ws_.serial_nn(1, d_.D, v_.n);
    s.x = X;
    s.m = m;
    s.rstd = r;
    return u;
  }

  Buf hc_post(const Buf& out, HcSaved& s) {
    const int64_t n = v_.n, D = d_.D;
    Buf next = act(d_.T * n * D);
    ws_.serial_tn(n, D, n);
    ws_.serial_tn(n, D, 1);
    s.coef.reset();
    s.out = out;
    return next;
  }

  Buf hc_backward_post(HcSaved& s) {
    const int64_t T = d_.T, n = v_.n, D = d_.D, M = v_.mixes();
    Buf d_out = act(T * D);
    s.d_x = act(T * n * D);
    s.d_coef = act(T * M);
    Buf coefs = thread_slabs(4 * M);
    ws_.serial_nn(1, D, n);
    ws_.serial_nt(n, 1, D);
    ws_.serial_nt(n, n, D);
    ws_.serial_nn(n, D, n);
    s.out.reset();
    return d_out;
  }

  Buf hc_backward_pre(HcSaved& s) {
    const int64_t T = d_.T, n = v_.n, D = d_.D, M = v_.mixes();
    // The Sinkhorn trace of one token (doubles): P, then each of the 2·iters − 1 steps' output
    // and denominators; then dz.
    const int64_t steps = 2 * v_.sinkhorn_iters - 1;
    const int64_t trace = n * n + steps * (n * n + n);
    Buf scratch = thread_slabs(8 * (trace + M));
    Buf coefs = thread_slabs(4 * M);
    Buf G = act(T * M), c = act(T), dz = act(T * M);
    ws_.serial_nt(1, n, D);
    ws_.serial_tn(n, D, 1);
    Buf dX = std::move(s.d_x);
    hc_project_backward(M);
    s = {};
    return dX;
  }

  Buf head_forward(const Buf& X, HeadSaved& s) {
    const int64_t T = d_.T, n = v_.n;
    Buf r = act(T), m = act(T * n);
    hc_project(n);
    Buf h = act(T * d_.D);
    Buf pres = thread_slabs(4 * n);
    ws_.serial_nn(1, d_.D, n);
    s.x = X;
    s.m = m;
    s.rstd = r;
    return h;
  }

  Buf head_backward(HeadSaved& s) {
    const int64_t T = d_.T, n = v_.n, D = d_.D;
    Buf dX = act(T * n * D), G = act(T * n), c = act(T), dz = act(T * n);
    Buf pres = thread_slabs(4 * 2 * n);
    ws_.serial_nt(1, n, D);
    ws_.serial_tn(n, D, 1);
    hc_project_backward(n);
    s = {};
    return dX;
  }

  // ---------------------------------------------------------- compressor (compressor.cpp)

  // c and z [windowed rows, coff·dc]: one product per sequence unless S is whole windows.
  void compressor_project(int64_t ratio, int64_t features, bool backward) {
    const int64_t S = d_.S, rows = (S / ratio) * ratio;
    if (rows == 0) return;
    const int64_t m = rows == S ? d_.B * S : rows;
    ws_.top_nt(m, features, d_.D);
    if (!backward) return;
    ws_.top_nn(m, d_.D, features);
    if (d_.base_grads) ws_.top_tn(features, d_.D, m);
  }

  // V4Compressor::forward: the entries [B, W, dc]; c, z and the pooled rows are temporaries.
  Buf compressor_forward(int64_t ratio, int64_t dc) {
    const int64_t B = d_.B, W = d_.S / ratio, coff = ratio == 4 ? 2 : 1, F = coff * dc;
    if (v_.rope > 0 && W > 0) rope_ensure(compressed_rope_, (W - 1) * ratio + 1);
    Buf entries = act(B * W * dc);
    Buf c = act(B * W * ratio * F), z = act(B * W * ratio * F);
    Buf pooled = act(B * W * dc);
    compressor_project(ratio, F, false);
    { Buf slabs = thread_slabs(4 * (coff * ratio + 2) * dc); }
    { Buf positions = i32(MemCategory::Scratch, B * W); }
    return entries;
  }

  // V4Compressor::backward: c and z again (then their gradients in place), the pooled rows and
  // their norm statistics, and the entries' gradient through RoPE and the norm.
  void compressor_backward(int64_t ratio, int64_t dc) {
    const int64_t B = d_.B, W = d_.S / ratio, coff = ratio == 4 ? 2 : 1, F = coff * dc;
    if (W == 0) return;
    Buf c = act(B * W * ratio * F), zp = act(B * W * ratio * F);
    Buf pooled = act(B * W * dc), rstd = act(B * W);
    compressor_project(ratio, F, false);
    { Buf slabs = thread_slabs(4 * (coff * ratio + 2) * dc); }
    Buf dpooled = act(B * W * dc);
    {
      Buf g = act(B * W * dc);
      if (v_.rope > 0) Buf positions = i32(MemCategory::Scratch, B * W);
      Buf normed = act(B * W * dc);
    }
    compressor_project(ratio, F, true);
  }

  // ---------------------------------------------------------- CSA indexer (indexer.cpp)

  // The picks [T, topk] (MemCategory::Routing); tokens that see more than topk entries are
  // scored against the indexer's own compressor's entries.
  Buf indexer_forward() {
    const int64_t B = d_.B, S = d_.S, ratio = 4, topk = v_.index_topk;
    Buf picks = i32(MemCategory::Routing, d_.T * topk);
    const int64_t t0 = std::min(S, (topk + 1) * ratio - 1);
    if (t0 >= S) return picks;
    const int64_t W = S / ratio, nq = S - t0, Hi = v_.index_heads, di = v_.index_dim;
    Buf keys = compressor_forward(ratio, di);
    Buf q = f32(MemCategory::Scratch, B * nq * Hi * di);
    Buf hw = f32(MemCategory::Scratch, B * nq * Hi);
    ws_.top_nt(nq, Hi * di, v_.q_lora);
    ws_.top_nt(nq, Hi, d_.D);
    if (v_.rope > 0) {
      rope_ensure(compressed_rope_, S);
      Buf positions = i32(MemCategory::Scratch, B * nq);
    }
    Buf fscratch = f32(MemCategory::Scratch, d_.threads * (ratio * Hi + 1) * W);
    Buf iscratch = i32(MemCategory::Scratch, d_.threads * W);
    // A group of up to 4 tokens against the entries visible to it (at most W).
    for (int64_t rows = 1; rows <= ratio; ++rows) ws_.serial_nt(rows * Hi, W, di);
    return picks;
  }

  // ---------------------------------------------------------- attention (v4_attention.cpp)

  int64_t block_rows() const { return std::max<int64_t>(1, 128 / v_.H); }
  // Compressed columns a query block holds at most (Core::max_compressed).
  int64_t max_compressed(int64_t ratio) const {
    if (ratio == 0) return 0;
    const int64_t W = d_.S / ratio;
    return ratio == 4 ? std::min(W, block_rows() * v_.index_topk) : W;
  }
  int64_t max_window() const { return std::min(d_.S, block_rows() + v_.window - 1); }

  // The core's serial products over every query block of a sequence (block_scores and
  // block_pv forward; again with dO·keysᵀ in the backward's query-side pass), and the
  // backward's key-side pass over key blocks of 32. A CSA block's compressed columns are the
  // union of its rows' picks: at most rows·topk and the entries visible to its last row.
  void attention_core_workspace(int64_t ratio, bool backward) {
    const int64_t S = d_.S, H = v_.H, hd = v_.hd, M = block_rows();
    const int64_t W = ratio > 0 ? S / ratio : 0;
    for (int64_t r0 = 0; r0 < S; r0 += M) {
      const int64_t rows = std::min(S, r0 + M) - r0;
      const int64_t nw = r0 + rows - std::max<int64_t>(0, r0 - v_.window + 1);
      int64_t nc = ratio > 0 ? std::min(W, (r0 + rows) / ratio) : 0;
      if (ratio == 4) nc = std::min(nc, rows * v_.index_topk);
      ws_.serial_nt(rows * H, nw, hd);
      ws_.serial_nt(rows * H, nc, hd);
      ws_.serial_nn(rows * H, hd, nw);
      ws_.serial_nn(rows * H, hd, nc);
    }
    if (!backward) return;
    for (const int64_t keys : {std::min<int64_t>(32, S), std::min<int64_t>(32, W)})
      for (int64_t rows = 1; rows <= M; ++rows) {
        ws_.serial_nt(rows * H, keys, hd);
        ws_.serial_tn(keys, hd, rows * H);
      }
  }

  // query_residual(x, Train, SaveInput::No): qr = q_norm(wq_a·x), q_norm keeping wq_a's output.
  Buf attention_query_residual(const V4LayerShape& L, AttnSaved& s) {
    Buf a = linear_forward(L.wq_a);
    return norm_forward(a, v_.q_lora, s.q_norm);
  }

  Buf attention_forward(const V4LayerShape& L, const Buf& entries, const Buf& picks,
                        AttnSaved& s) {
    const int64_t T = d_.T, H = v_.H, hd = v_.hd, HD = H * hd;
    rope_ensure(rope_of(L.ratio), d_.S);
    Buf positions = i32(MemCategory::Scratch, T);
    Buf q = linear_forward(L.wq_b);
    Buf q_rstd = act(T * H);
    Buf kv;
    {
      Buf projected = linear_forward(L.wkv);
      kv = norm_forward(projected, hd, s.kv_norm);
    }
    Buf o = act(T * HD), stats = act(T * H * 2);
    {
      // BlockScratch: scores [M·H, cols], mask [cols], gathered entries and the row's terms;
      // the block's union of picks and one row's columns.
      const int64_t M = block_rows(), cols = max_window() + max_compressed(L.ratio);
      const bool csa = L.ratio == 4;
      const int64_t k = csa ? v_.index_topk : 0;
      const int64_t floats = M * H * cols + cols + (csa ? max_compressed(L.ratio) * hd : 0) + k;
      Buf fslabs = thread_slabs(4 * floats), islabs = thread_slabs(4 * (M * k + k));
      attention_core_workspace(L.ratio, false);
    }
    kv.reset();
    // The output: z = grouped wo_a·RoPE⁻¹(o), then wo_b.
    Buf z = act(T * v_.o_groups * v_.o_lora);
    ws_.top_nt(T, v_.o_lora, HD / v_.o_groups);
    o.reset();
    Buf y = linear_forward(L.wo_b);
    if (keeps_input(L.wo_b)) s.z = z;
    s.q = q;
    s.q_rstd = q_rstd;
    s.stats = stats;
    s.entries = entries;
    s.picks = picks;
    return y;
  }

  Buf attention_backward(const V4LayerShape& L, AttnSaved& s) {
    const int64_t T = d_.T, H = v_.H, hd = v_.hd, HD = H * hd;
    const int64_t g = v_.o_groups, ol = v_.o_lora, gi = HD / g;
    // The entries and picks stay referenced until the backward returns.
    const Buf entries = std::move(s.entries), picks = std::move(s.picks);
    Buf positions = i32(MemCategory::Scratch, T);
    Buf dz = linear_backward(L.wo_b);
    s.z.reset();
    Buf dO = act(T * HD);
    ws_.top_nn(T, gi, ol);
    Buf kv = act(T * hd);  // kv_norm's output again, rotated
    // wo_a's gradient (pretraining) needs its input o again.
    const bool need_o = d_.base_grads;
    Buf dq = act(T * HD);
    Buf o = need_o ? act(T * HD) : Buf();
    Buf row_terms = act(T * H), sink_terms = act(T * H);
    {
      const int64_t M = block_rows(), cols = max_window() + max_compressed(L.ratio);
      const bool csa = L.ratio == 4;
      const int64_t k = v_.index_topk;
      const int64_t gathered = csa ? max_compressed(L.ratio) * hd : 0;
      Buf slabs = thread_slabs(4 * (2 * M * H * cols + cols + gathered));
      Buf id_slabs = thread_slabs(csa ? 4 * (M * k + k) : 0);
      attention_core_workspace(L.ratio, true);
    }
    if (need_o) {
      ws_.top_tn(ol, gi, T);
      o.reset();
    }
    dz.reset();
    sink_terms.reset();
    Buf dkv = act(T * hd);
    {
      const int64_t kb = 32;
      Buf slabs = thread_slabs(4 * (2 * block_rows() * H * kb + kb));
    }
    dO.reset();
    kv.reset();
    row_terms.reset();
    s.stats.reset();
    s.q.reset();
    s.q_rstd.reset();
    Buf dqr;
    {
      Buf qr = act(T * v_.q_lora);  // q_norm's output again
      dqr = linear_backward(L.wq_b);
    }
    dq.reset();
    Buf dx;
    {
      Buf d_a = act(T * v_.q_lora);  // q_norm backward
      s.q_norm = {};
      dx = linear_backward(L.wq_a);
    }
    dqr.reset();
    Buf dkv_pre = act(T * hd);  // kv_norm backward
    s.kv_norm = {};
    dkv.reset();
    linear_backward(L.wkv, /*new_dx=*/false);
    return dx;
  }

  // ---------------------------------------------------------- blocks (v4_model.cpp)

  Buf block_forward(size_t l, const Buf& X, BlockSaved& s) {
    const V4LayerShape& L = layers_[l];
    const int64_t D = d_.D;
    phase_layer(l, "attention forward");
    Buf a;
    {
      Buf u = hc_pre(X, s.hc_attn);
      Buf x = norm_forward(u, D, s.attn_norm);
      Buf qr = attention_query_residual(L, s.attn);
      Buf entries, picks;
      if (L.ratio > 0) {
        phase_layer(l, "compressor forward");
        entries = compressor_forward(L.ratio, v_.hd);
        if (L.ratio == 4) {
          phase_layer(l, "indexer forward");
          picks = indexer_forward();
        }
        phase_layer(l, "attention forward");
      }
      a = attention_forward(L, entries, picks, s.attn);
    }
    Buf X1 = hc_post(a, s.hc_attn);
    a.reset();
    phase_layer(l, "MoE forward");
    Buf f;
    {
      Buf u = hc_pre(X1, s.hc_ffn);
      Buf x = norm_forward(u, D, s.ffn_norm);
      f = moe_forward(L.ffn, s.moe);
    }
    return hc_post(f, s.hc_ffn);
  }

  Buf block_backward(size_t l, BlockSaved& s) {
    const V4LayerShape& L = layers_[l];
    const int64_t T = d_.T, D = d_.D;
    phase_layer(l, "MoE backward");
    Buf du;
    {
      Buf d_f = hc_backward_post(s.hc_ffn);
      Buf d_x;
      {
        Buf x = act(T * D);  // ffn_norm's output again
        d_x = moe_backward(L.ffn, s.moe);
      }
      d_f.reset();
      du = act(T * D);
      s.ffn_norm = {};
    }
    Buf dX1 = hc_backward_pre(s.hc_ffn);
    du.reset();
    phase_layer(l, "attention backward");
    Buf d_a = hc_backward_post(s.hc_attn);
    dX1.reset();
    Buf d_x;
    {
      Buf x = act(T * D);  // attn_norm's output again
      Buf d_entries = L.ratio > 0 ? act(d_.B * (d_.S / L.ratio) * v_.hd) : Buf();
      d_x = attention_backward(L, s.attn);
      d_a.reset();
      if (L.ratio > 0) {
        phase_layer(l, "compressor backward");
        compressor_backward(L.ratio, v_.hd);
      }
    }
    du = act(T * D);
    s.attn_norm = {};
    d_x.reset();
    return hc_backward_pre(s.hc_attn);
  }

  const V4Dims& v_;
  const std::vector<V4LayerShape>& layers_;
  RopeTableState window_rope_, compressed_rope_;
};

}  // namespace

ReplayResult replay_v4_training_step(const Dims& d, const V4Dims& v,
                                     const std::vector<V4LayerShape>& layers, Ledger& ledger,
                                     Workspace& ws) {
  V4StepReplay replay(d, v, layers, ledger, ws);
  replay.run();
  return {replay.saved_after_forward, replay.saved_per_layer};
}

}  // namespace moe::memory_replay
