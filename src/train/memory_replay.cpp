#include "train/memory_replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "kernels/gemm.h"
#include "kernels/mxfp4_gemm.h"
#include "model/lm_head_loss.h"
#include "train/memory_replay_parts.h"

namespace moe::memory_replay {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace

// ---------------------------------------------------------------- shared parts

Buf ReplayParts::thread_slabs(int64_t bytes) {
  return make(MemCategory::Scratch, d_.threads * round_up(std::max<int64_t>(bytes, 1), 64));
}

// ---------------------------------------------------------- Linear + LoRA (layers.cpp)

Buf ReplayParts::lora_project(const Lin& l, int64_t rows) {
  Buf xd = d_.dropout ? act(rows * l.in) : Buf();
  Buf xs = act(rows * l.r);
  ws_.top_nt(rows, l.r, l.in);
  return xs;
}

Buf ReplayParts::linear_forward(const Lin& l, int64_t rows) {
  Buf y = act(rows * l.out);
  ws_.top_nt(rows, l.out, l.in);
  if (l.r) {
    Buf xs = lora_project(l, rows);
    ws_.top_nt(rows, l.out, l.r);
  }
  return y;
}

Buf ReplayParts::linear_backward(const Lin& l, int64_t rows, bool new_dx) {
  const int64_t T = rows;
  Buf dx = new_dx ? act(T * l.in) : Buf();
  ws_.top_nn(T, l.in, l.out);
  if (l.r) {
    Buf g = act(T * l.r);
    ws_.top_nn(T, l.r, l.out);
    {
      Buf d_xd = d_.dropout ? act(T * l.in) : Buf();
      ws_.top_nn(T, l.in, l.r);
    }
    {
      Buf xs = lora_project(l, rows);
      ws_.top_tn(l.out, l.r, T);
    }
    {
      Buf xd = d_.dropout ? act(T * l.in) : Buf();
      ws_.top_tn(l.r, l.in, T);
    }
  }
  if (d_.base_grads) ws_.top_tn(l.out, l.in, T);
  return dx;
}

Buf ReplayParts::norm_forward(const Buf& x, int64_t rows, int64_t dim, NormSaved& s) {
  Buf y = act(rows * dim);
  s.rstd = act(rows);
  s.x = x;
  return y;
}

// ---------------------------------------------------------- SwiGLU (dense MLP, shared experts)

Buf ReplayParts::swiglu_forward(const LayerShape& L, SwigluSaved& s) {
  Buf g = linear_forward(L.gate);
  Buf u = linear_forward(L.up);
  Buf h = act(d_.T * L.gate.out);
  s.g = g;
  s.u = u;
  return linear_forward(L.down);
}

Buf ReplayParts::swiglu_backward(const LayerShape& L, SwigluSaved& s) {
  Buf dh;
  {
    Buf h = keeps_input(L.down) ? act(d_.T * L.gate.out) : Buf();
    dh = linear_backward(L.down);
  }
  Buf dx = linear_backward(L.gate);
  linear_backward(L.up, /*new_dx=*/false);
  s = {};
  return dx;
}

// ---------------------------------------------------------- routed experts (moe_layer.cpp)

void ReplayParts::grouped_forward_add(int64_t in, int64_t out, int64_t r) {
  Buf xd = d_.dropout ? act(d_.R * in) : Buf();
  Buf xs = act(d_.R * r);
  ws_.serial_up_to(64, r, in, GemmLayout::NT);
  ws_.serial_up_to(64, out, r, GemmLayout::NT);
}

Buf ReplayParts::grouped_grad_input(int64_t in, int64_t out, int64_t r) {
  Buf g = act(d_.R * r);
  Buf d_xd = d_.dropout ? act(d_.R * in) : Buf();
  ws_.serial_nn(64, r, out);
  ws_.serial_nn(64, in, r);
  return g;
}

void ReplayParts::grouped_grad_weights(int64_t in, int64_t out, int64_t r) {
  Buf xd = d_.dropout ? act(d_.R * in) : Buf();
  Buf xs = act(d_.R * r);
  ws_.serial_up_to(64, r, in, GemmLayout::NT);
  const int64_t n = d_.max_rows_per_expert();
  ws_.serial_tn(std::min<int64_t>(1024, out), r, n);
  ws_.serial_tn(r, std::min<int64_t>(1024, in), n);
}

// Base expert matmuls: x [rows, in] · W[out, in]ᵀ (nt) or dy [rows, out] · W (nn).
void ReplayParts::experts_nt(int64_t in, int64_t out) {
  const int64_t m = std::min<int64_t>(512, d_.max_rows_per_expert());
  if (d_.mxfp4) return ws_.mxfp4_nt(m);
  ws_.serial_up_to(m, std::min<int64_t>(4096, out), in, GemmLayout::NT);
}

void ReplayParts::experts_nn(int64_t in, int64_t out) {
  const int64_t m = std::min<int64_t>(512, d_.max_rows_per_expert());
  const int64_t cols = std::min<int64_t>(4096, in);
  if (d_.mxfp4) return ws_.mxfp4_nn(m, out, cols);
  ws_.serial_nn(m, cols, out);
}

void ReplayParts::experts_weight_grad(int64_t in, int64_t out) {
  ws_.serial_tn(std::min<int64_t>(4096, out), std::min<int64_t>(4096, in),
                d_.max_rows_per_expert());
}

Buf ReplayParts::moe_forward(const LayerShape& L, MoeSaved& s) {
  const int64_t T = d_.T, D = d_.D, E = d_.E, R = d_.R, Im = d_.Im;
  Buf logits = act(T * E);
  ws_.top_nt(T, E, D);
  Buf ids = i32(MemCategory::Activations, T * d_.k), weights = act(T * d_.k),
      scores = act(T * E);
  logits.reset();
  Buf f = d_.aux ? act(d_.B * E) : Buf();
  Buf state, extra, rows, row_weights;
  if (d_.ep == 1) {
    state = i32(MemCategory::Routing, E + 1 + 2 * d_.slots);
    rows = act(d_.slots * D);
    row_weights = act(d_.slots);
  } else {
    extra = i32(MemCategory::Routing, 2 + 2 * d_.ep + d_.slots);
    Buf arrived = f32(MemCategory::Scratch, R), fake_ids = i32(MemCategory::Scratch, R);
    state = i32(MemCategory::Routing, d_.E_loc + 1 + 2 * R);
    Buf rows1 = act(R);
    row_weights = act(R);
    fake_ids.reset();
    arrived.reset();
    rows = act(R * D);
    rows1.reset();
  }
  Buf g = act(R * Im), u = act(R * Im);
  experts_nt(D, Im);
  Buf keys;
  if (d_.dropout && L.any_expert_adapter()) {
    Buf token_keys = i32(MemCategory::Routing, T);
    Buf moved = d_.ep > 1 ? act(R) : Buf();
    keys = i32(MemCategory::Routing, R);
  }
  if (L.er_gate) grouped_forward_add(D, Im, L.er_gate);
  if (L.er_up) grouped_forward_add(D, Im, L.er_up);
  // Kept only for trainable experts under EP; adapters alone re-fetch them in backward.
  const bool keep_rows = d_.experts_trainable && d_.ep > 1;
  if (!keep_rows) rows.reset();
  Buf h = act(R * Im);
  Buf o = act(R * D);
  experts_nt(Im, D);
  if (L.er_down) grouped_forward_add(Im, D, L.er_down);
  h.reset();
  Buf y = act(T * D);
  if (d_.ep > 1) Buf back = act(d_.slots * D);
  o.reset();
  if (L.gate.out > 0) Buf ys = swiglu_forward(L, s.shared);
  s.ids = ids;
  s.weights = weights;
  s.scores = scores;
  s.f = f;
  s.rows = rows;
  s.g = g;
  s.u = u;
  s.row_weights = row_weights;
  s.state = state;
  s.extra = extra;
  s.keys = keys;
  return y;
}

Buf ReplayParts::moe_backward(const LayerShape& L, MoeSaved& s) {
  const int64_t T = d_.T, D = d_.D, E = d_.E, R = d_.R, Im = d_.Im;
  Buf dx_shared = L.gate.out > 0 ? swiglu_backward(L, s.shared) : Buf();
  Buf d_out = act(R * D);
  Buf d_h = act(R * Im);
  experts_nn(Im, D);
  Buf g_down = L.er_down ? grouped_grad_input(Im, D, L.er_down) : Buf();
  Buf d_row_w = act(R);
  { Buf h_rows = f32(MemCategory::Scratch, static_cast<int64_t>(d_.threads) * Im); }
  if (d_.experts_trainable) experts_weight_grad(Im, D);
  if (L.er_down) grouped_grad_weights(Im, D, L.er_down);
  d_out.reset();
  d_h.reset();
  Buf rows;
  if (d_.experts_trainable || L.er_gate || L.er_up) rows = s.rows ? std::move(s.rows) : act(R * D);
  if (d_.experts_trainable) {
    experts_weight_grad(D, Im);
    experts_weight_grad(D, Im);
  }
  s.rows.reset();
  if (!L.er_gate && !L.er_up) rows.reset();
  Buf d_rows = act(R * D);
  experts_nn(D, Im);
  for (int64_t r : {L.er_gate, L.er_up}) {
    if (!r) continue;
    Buf g = grouped_grad_input(D, Im, r);
    grouped_grad_weights(D, Im, r);
  }
  rows.reset();
  s.g.reset();
  s.u.reset();
  Buf d_weights;
  if (d_.ep > 1) {
    Buf back = act(d_.slots);
    d_weights = act(T * d_.k);
  } else {
    d_weights = act(T * d_.k);
  }
  Buf dx = act(T * D);
  if (d_.ep > 1) Buf back = act(d_.slots * D);
  s.state.reset();
  s.extra.reset();
  d_rows.reset();
  Buf d_logits = act(T * E);
  if (d_.base_grads) ws_.top_tn(E, D, T);
  ws_.top_nn(T, D, E);
  s = {};
  return dx;
}

// ---------------------------------------------------------- LM head (lm_head_loss.cpp)

Buf ReplayParts::lm_head_loss() {
  const int64_t T = d_.T, D = d_.D;
  Buf dh = act(T * D);
  const int64_t rows = std::min(LMHeadLoss::chunk_rows(d_.V, D), T);
  Buf chunk = f32(MemCategory::Scratch, rows * d_.V);
  // Every chunk but the last has `rows` rows.
  for (const int64_t n : {rows, T % rows}) {
    if (n == 0) continue;
    ws_.top_nt(n, d_.V, D);
    ws_.top_nn(n, D, d_.V);
    if (d_.base_grads) ws_.top_tn(d_.V, D, n);
  }
  return dh;
}

namespace {

// ---------------------------------------------------------------- the replayed step
// One training micro-batch of DeepSeekModel (model/model.cpp), allocation by allocation in the
// engine's order. Buffers are released where the engine's tensors are (scopes, resets, moves),
// so the ledger's peaks are the tracker's.

struct AttnSaved {
  Buf positions, q, k_pe, stats, o_input, ckv, ckv_rstd, qa, qa_rstd, q_b_input;
};
struct LayerSaved {
  NormSaved in, post;
  AttnSaved attn;
  SwigluSaved mlp;
  MoeSaved moe;
};

class StepReplay : public ReplayParts {
 public:
  StepReplay(const Dims& d, const std::vector<LayerShape>& layers, Ledger& ledger, Workspace& ws)
      : ReplayParts(d, ledger, ws), layers_(layers) {}

  // Activations saved for backward once the forward is done (before the LM head).
  int64_t saved_after_forward = 0;
  std::vector<int64_t> saved_per_layer;

  void run() {
    const int64_t T = d_.T, D = d_.D;
    phase("embedding");
    Buf tokens = i32(MemCategory::Activations, T), targets = i32(MemCategory::Activations, T);
    std::vector<LayerSaved> saved(layers_.size());
    Buf x = act(T * D);
    int64_t before = ledger_.current(MemCategory::Activations);
    for (size_t l = 0; l < layers_.size(); ++l) {
      x = block_forward(l, x, saved[l]);
      const int64_t now = ledger_.current(MemCategory::Activations);
      saved_per_layer.push_back(now - before);
      before = now;
    }
    phase("final norm");
    NormSaved fin;
    Buf h = norm_forward(x, D, fin);
    x.reset();
    saved_after_forward = ledger_.current(MemCategory::Activations) - 4 * T * D;  // less h
    phase("LM head + loss (chunked logits)");
    Buf dh = lm_head_loss();
    h.reset();
    phase("final norm backward");
    Buf dx;
    {
      Buf d = std::move(dh);
      dx = act(T * D);
      fin = {};
    }
    for (size_t l = layers_.size(); l-- > 0;) {
      Buf next = block_backward(l, saved[l]);
      dx = std::move(next);
    }
    dx.reset();
  }

 private:
  void phase_layer(size_t l, const char* what) {
    ledger_.set_phase(fmt::format("layer {} ({}) {}", l, layers_[l].moe ? "MoE" : "dense", what));
  }

  // ---------------------------------------------------------- attention (attention.cpp)

  void attention_core_workspace(bool backward) {
    const int64_t S = d_.S;
    for (int64_t r0 = 0; r0 < S; r0 += 64) {
      const int64_t M = std::min<int64_t>(64, S - r0), N = r0 + M;
      const int64_t dk = d_.dn + d_.dr;
      ws_.serial_nt(M, N, dk);
      if (!backward) {
        ws_.serial_nn(M, d_.dv, N);
        continue;
      }
      ws_.serial_tn(N, d_.dv, M);
      ws_.serial_nt(M, N, d_.dv);
      ws_.serial_nn(M, dk, N);
      ws_.serial_tn(N, dk, M);
    }
  }

  Buf attention_forward(const LayerShape& L, AttnSaved& s) {
    const int64_t T = d_.T, H = d_.H;
    Buf positions = i32(MemCategory::Scratch, T);
    Buf q;
    if (L.q_lora) {
      Buf a = linear_forward(L.q_a);
      s.qa = a;
      s.qa_rstd = act(T);
      Buf n = act(T * d_.qr);
      if (keeps_input(L.q_b)) s.q_b_input = n;
      q = linear_forward(L.q_b);
    } else {
      q = linear_forward(L.q);
    }
    Buf c_kv = act(T * d_.kvr), k_pe = act(T * d_.dr);
    ws_.top_nt(T, d_.kvr, d_.D);
    ws_.top_nt(T, d_.dr, d_.D);
    if (L.kv_a.r) {
      Buf xs = lora_project(L.kv_a);
      ws_.top_nt(T, d_.kvr, L.kv_a.r);
      ws_.top_nt(T, d_.dr, L.kv_a.r);
    }
    Buf kv;
    {
      Buf n = act(T * d_.kvr);
      s.ckv = c_kv;
      s.ckv_rstd = act(T);
      kv = linear_forward(L.kv_b);
    }
    c_kv.reset();
    Buf out = act(T * H * d_.dv);
    Buf stats = act(T * H * 2);
    {
      Buf slabs = f32(MemCategory::Scratch, d_.threads * std::min<int64_t>(64, d_.S) * d_.S);
      Buf k_cat = act(T * H * (d_.dn + d_.dr));
      attention_core_workspace(false);
    }
    s.positions = positions;
    s.q = q;
    s.k_pe = k_pe;
    s.stats = stats;
    if (keeps_input(L.o)) s.o_input = out;
    return linear_forward(L.o);
  }

  Buf attention_backward(const LayerShape& L, AttnSaved& s) {
    const int64_t T = d_.T, H = d_.H, D = d_.D;
    Buf d_out = linear_backward(L.o);
    s.o_input.reset();
    Buf q = std::move(s.q);
    Buf c_kv_normed = act(T * d_.kvr);
    Buf kv = linear_forward(L.kv_b);
    Buf dq = act(T * H * (d_.dn + d_.dr));
    Buf dkv = act(T * H * (d_.dn + d_.dv));
    Buf dk_pe = act(T * d_.dr);
    {
      Buf k_cat = act(T * H * (d_.dn + d_.dr));
      Buf dk_heads = act(T * H * (d_.dn + d_.dr));
      Buf slabs = f32(MemCategory::Scratch, d_.threads * 2 * std::min<int64_t>(64, d_.S) * d_.S);
      attention_core_workspace(true);
    }
    s.stats.reset();
    s.k_pe.reset();
    q.reset();
    kv.reset();
    d_out.reset();
    Buf dc_kv;
    {
      Buf t = linear_backward(L.kv_b);
      dc_kv = act(T * d_.kvr);
      s.ckv.reset();
      s.ckv_rstd.reset();
    }
    c_kv_normed.reset();
    dkv.reset();
    Buf dx;
    if (L.q_lora) {
      Buf t1 = linear_backward(L.q_b);
      s.q_b_input.reset();
      Buf t2 = act(T * d_.qr);
      s.qa.reset();
      s.qa_rstd.reset();
      dx = linear_backward(L.q_a);
    } else {
      dx = linear_backward(L.q);
    }
    dq.reset();
    ws_.top_nn(T, D, d_.kvr);
    ws_.top_nn(T, D, d_.dr);
    if (L.kv_a.r) {
      const int64_t r = L.kv_a.r;
      Buf g = act(T * r);
      ws_.top_nn(T, r, d_.kvr);
      ws_.top_nn(T, r, d_.dr);
      {
        Buf d_xd = d_.dropout ? act(T * D) : Buf();
        ws_.top_nn(T, D, r);
      }
      Buf xs = lora_project(L.kv_a);
      ws_.top_tn(d_.kvr, r, T);
      ws_.top_tn(d_.dr, r, T);
      Buf xd = d_.dropout ? act(T * D) : Buf();
      ws_.top_tn(r, D, T);
    }
    if (d_.base_grads) {
      ws_.top_tn(d_.kvr, D, T);
      ws_.top_tn(d_.dr, D, T);
    }
    s = {};
    return dx;
  }

  // ---------------------------------------------------------- blocks (model.cpp)

  Buf block_forward(size_t l, const Buf& x, LayerSaved& s) {
    const LayerShape& L = layers_[l];
    const int64_t D = d_.D;
    phase_layer(l, "attention forward");
    Buf h;
    {
      Buf n1 = norm_forward(x, D, s.in);
      h = attention_forward(L, s.attn);
    }
    phase_layer(l, L.moe ? "MoE forward" : "MLP forward");
    Buf n2 = norm_forward(h, D, s.post);
    Buf out = L.moe ? moe_forward(L, s.moe) : swiglu_forward(L, s.mlp);
    n2.reset();
    return out;
  }

  Buf block_backward(size_t l, LayerSaved& s) {
    const LayerShape& L = layers_[l];
    const int64_t T = d_.T, D = d_.D;
    phase_layer(l, L.moe ? "MoE backward" : "MLP backward");
    Buf d_ffn;
    {
      Buf normed = act(T * D);
      d_ffn = L.moe ? moe_backward(L, s.moe) : swiglu_backward(L, s.mlp);
    }
    Buf dh = act(T * D);
    s.post = {};
    d_ffn.reset();
    phase_layer(l, "attention backward");
    Buf d_attn;
    {
      Buf normed = act(T * D);
      d_attn = attention_backward(L, s.attn);
    }
    Buf dx = act(T * D);
    s.in = {};
    d_attn.reset();
    return dx;
  }

  const std::vector<LayerShape>& layers_;
};

}  // namespace

ReplayResult replay_training_step(const Dims& d, const std::vector<LayerShape>& layers,
                                  Ledger& ledger, Workspace& ws) {
  StepReplay replay(d, layers, ledger, ws);
  replay.run();
  return {replay.saved_after_forward, replay.saved_per_layer};
}

// ---------------------------------------------------------------- kernel workspace
// kernels/kernel_scratch.h: per thread, slot 0 holds the fp32 GEMM's packed B (and gemm_tn's A
// packed for all threads; or an MXFP4 kernel's x panel / decoded W panel), slot 1 the GEMM's
// packed A panels (or MXFP4's decoded W rows). Each slot keeps the largest request it saw, and
// the kernels say what each call requests (gemm_scratch_floats, mxfp4_gemm_*_scratch_floats).
// What is modelled here is which thread asks: top-level GEMMs pack B on the calling (main)
// thread and hand row blocks to every thread when wide enough; serial GEMMs inside parallel
// loops, and the MXFP4 kernels, run on any thread.

void Workspace::top(int64_t M, int64_t N, int64_t K, GemmLayout layout) {
  const ScratchFloats s = gemm_scratch_floats(layout, M, N, K, /*serial=*/false);
  main0_ = std::max(main0_, s.slot0);
  main1_ = std::max(main1_, s.slot1);
  if (M * N * K >= kGemmParallelMinWork) any1_ = std::max(any1_, s.slot1);
}

void Workspace::on_any_thread(ScratchFloats s) {
  any0_ = std::max(any0_, s.slot0);
  any1_ = std::max(any1_, s.slot1);
}

void Workspace::serial(int64_t M, int64_t N, int64_t K, GemmLayout layout) {
  on_any_thread(gemm_scratch_floats(layout, M, N, K, /*serial=*/true));
}

void Workspace::serial_up_to(int64_t m, int64_t N, int64_t K, GemmLayout layout) {
  for (int64_t r = 1; r <= m; ++r) serial(r, N, K, layout);
}

// An expert's calls have any number of rows up to m, and a smaller call may run a kernel with a
// larger scratch than a larger call's (tile shapes round the x panel up to whole tiles): every
// count is asked.
void Workspace::mxfp4_nt(int64_t m) {
  for (int64_t r = 1; r <= m; ++r) on_any_thread(mxfp4_gemm_nt_scratch_floats(r));
}

void Workspace::mxfp4_nn(int64_t m, int64_t rows, int64_t cols) {
  for (int64_t r = 1; r <= m; ++r) on_any_thread(mxfp4_gemm_nn_scratch_floats(r, rows, cols));
}

int64_t Workspace::bytes(int threads) const {
  const auto r16 = [](int64_t f) { return round_up(f, 16); };
  const int64_t main = r16(std::max(main0_, any0_)) + r16(std::max(main1_, any1_));
  const int64_t other = r16(any0_) + r16(any1_);
  return 4 * (main + static_cast<int64_t>(std::max(threads, 1) - 1) * other);
}

}  // namespace moe::memory_replay
