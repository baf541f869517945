#include "model/v4/v4_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/thread_slabs.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm.h"
#include "kernels/quant_sim.h"
#include "kernels/vector_math.h"

namespace moe {

namespace {

Tensor activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemCategory::Activations);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// All heads read the same single KV head, so a query block stacks its rows' H heads into one
// score GEMM of about this many rows ([M·H, keys]): one key gather and one mask per block, and
// GEMMs tall enough to run at speed whatever H is. M depends on H only (never on the thread
// count), so the blocks, and with them every row's bits, are fixed by the shapes.
constexpr int64_t kStackedRows = 128;
// Keys (window positions or compressed entries) per task of the backward's key-side pass.
// Small, because a window block of n keys is seen by n + window − 1 queries.
constexpr int64_t kKeyBlock = 32;

// What the attention core reads; pointers into [T, ...] row-major tensors. A sequence's rows are
// its keys' positions pos0, pos0 + 1, ... (S of them); its queries are the rows from q_first on,
// indexed from 0 in q, picks, the output and the stats. The training forward has pos0 = 0 and
// q_first = 0 (every row a query); a cached forward runs one sequence per chunk whose first
// rows are the window's cached positions before the chunk.
struct Core {
  int64_t B = 0, S = 0, H = 0, d = 0, window = 0;
  int64_t q_first = 0, pos0 = 0;
  int64_t ratio = 0;  // 0: no compressed entries
  int64_t W = 0;      // entries per sequence
  int64_t k = 0;      // picks per query (CSA), 0 for HCA
  int64_t M = 0;      // query rows per block
  float scale = 1.0f;
  const float* q = nullptr;        // [B·Sq, H·d]
  const float* kv = nullptr;       // [B·S, d]
  const float* entries = nullptr;  // [B, W, d]
  const int32_t* picks = nullptr;  // [B·Sq, k]
  const float* sink = nullptr;     // [H]

  int64_t hd() const { return H * d; }
  int64_t queries() const { return S - q_first; }  // Sq
  // Row r (>= q_first) of sequence b among the queries.
  int64_t query_index(int64_t b, int64_t r) const { return b * queries() + r - q_first; }
  int64_t blocks() const { return (queries() + M - 1) / M; }
  bool csa() const { return picks != nullptr; }
  // Compressed columns a block can hold at most.
  int64_t max_compressed() const {
    if (ratio == 0) return 0;
    return csa() ? std::min(W, M * k) : W;
  }
  int64_t max_window() const { return std::min(S, M + window - 1); }
};

// The keys of one query block (rows [r0, r0 + rows) of sequence b), in column order: the window
// positions [kw0, kw0 + nw), then nc compressed entries (HCA: ids 0..nc−1; CSA: the ascending
// union of the rows' picks, gathered into a slab).
struct KeyLayout {
  int64_t b = 0, r0 = 0, rows = 0;
  int64_t kw0 = 0, nw = 0, nc = 0;
  const float* comp = nullptr;  // [nc, d]
  const int32_t* ids = nullptr;  // CSA: entry id of each compressed column
  int64_t cols() const { return nw + nc; }
};

KeyLayout key_layout(const Core& c, int64_t b, int64_t blk, float* gather, int32_t* ids) {
  KeyLayout L;
  L.b = b;
  L.r0 = c.q_first + blk * c.M;
  L.rows = std::min(c.S, L.r0 + c.M) - L.r0;
  L.kw0 = std::max<int64_t>(0, L.r0 - c.window + 1);
  L.nw = L.r0 + L.rows - L.kw0;
  if (c.ratio == 0) return L;
  if (!c.csa()) {
    // Entries visible to the block's last row; earlier rows mask the rest.
    L.nc = std::min(c.W, (c.pos0 + L.r0 + L.rows) / c.ratio);
    L.comp = c.entries + b * c.W * c.d;
    return L;
  }
  int64_t n = 0;
  for (int64_t i = 0; i < L.rows; ++i) {
    const int32_t* p = c.picks + c.query_index(b, L.r0 + i) * c.k;
    for (int64_t j = 0; j < c.k; ++j)
      if (p[j] >= 0) ids[n++] = p[j];
  }
  std::sort(ids, ids + n);
  n = std::unique(ids, ids + n) - ids;
  const float* e = c.entries + b * c.W * c.d;
  for (int64_t j = 0; j < n; ++j) std::copy_n(e + ids[j] * c.d, c.d, gather + j * c.d);
  L.nc = n;
  L.comp = gather;
  L.ids = ids;
  return L;
}

// The columns query row i of the block may attend: the window's [win_begin, win_end), and
// comp_count compressed ones, the first comp_count (HCA) or those listed in comp_cols (CSA,
// ascending, counted from the first compressed column).
struct RowColumns {
  int64_t win_begin = 0, win_end = 0, comp_count = 0;
  const int32_t* comp_cols = nullptr;
};

// cols: room for k column numbers (CSA).
RowColumns row_columns(const Core& c, const KeyLayout& L, int64_t i, int32_t* cols) {
  RowColumns rc;
  const int64_t t = L.r0 + i;
  rc.win_begin = std::max<int64_t>(0, t - c.window + 1) - L.kw0;
  rc.win_end = t + 1 - L.kw0;
  if (L.nc == 0) return rc;
  if (!c.csa()) {
    rc.comp_count = std::min(L.nc, (c.pos0 + t + 1) / c.ratio);
    return rc;
  }
  // The row's picks are ascending (checked by forward), and so is the union: one merge.
  const int32_t* p = c.picks + c.query_index(L.b, t) * c.k;
  int64_t u = 0;
  for (int64_t j = 0; j < c.k; ++j) {
    if (p[j] < 0) continue;
    while (L.ids[u] < p[j]) ++u;
    cols[rc.comp_count++] = static_cast<int32_t>(u);
  }
  rc.comp_cols = cols;
  return rc;
}

// 0 where query row i of the block may attend column j, −inf where not.
void key_mask(const Core& c, const KeyLayout& L, int64_t i, float* mask, int32_t* cols) {
  const RowColumns rc = row_columns(c, L, i, cols);
  std::fill(mask, mask + L.cols(), kNegInf);
  std::fill(mask + rc.win_begin, mask + rc.win_end, 0.0f);
  float* mc = mask + L.nw;
  if (rc.comp_cols) {
    for (int64_t j = 0; j < rc.comp_count; ++j) mc[rc.comp_cols[j]] = 0.0f;
  } else {
    std::fill(mc, mc + rc.comp_count, 0.0f);
  }
}

// sc [rows·H, N] (ld N) = scale · q_rows·keysᵀ + mask: one dot product over d per score, the
// window columns and the compressed ones from two GEMMs. Forward and backward call this on the
// same layout, so the backward's scores are bitwise the forward's. cols: as row_columns.
void block_scores(const Core& c, const KeyLayout& L, float* sc, float* mask, int32_t* cols) {
  const int64_t MH = L.rows * c.H, N = L.cols();
  const float* qrows = c.q + c.query_index(L.b, L.r0) * c.hd();
  gemm_nt_serial(MH, L.nw, c.d, qrows, c.d, c.kv + (L.b * c.S + L.kw0) * c.d, c.d, sc, N, false);
  gemm_nt_serial(MH, L.nc, c.d, qrows, c.d, L.comp, c.d, sc + L.nw, N, false);
  for (int64_t i = 0; i < L.rows; ++i) {
    key_mask(c, L, i, mask, cols);
    for (int64_t h = 0; h < c.H; ++h) {
      float* row = sc + (i * c.H + h) * N;
      scale_row(row, N, c.scale);
      for (int64_t j = 0; j < N; ++j) row[j] += mask[j];  // + 0 keeps a score's bits
    }
  }
}

// exp(sink − m) with the kernels' exp, so forward and backward agree bitwise.
float sink_exp(float sink, float m) {
  float e = sink;
  exp_shift_sum(&e, 1, m);
  return e;
}

// One score row (N columns, the window's nw first) in place to its softmax, with the sink as one
// more logit of zero value; returns the shift m and 1/Σ. The sum adds the row's visible terms in
// an order of their own: the window's from its first visible key, then the compressed ones in
// id order (each part in the 16 lanes of exp_shift_sum, so a term's lane is its rank in that
// part), then the sink. A term's place in the block's layout (which depends on the block the
// query falls in, and for CSA on the other rows' picks) thus never changes the bits: the
// training forward and a cached forward, which lay the same keys out differently, agree.
// gather: room for the row's compressed terms (CSA).
std::pair<float, float> softmax_with_sink(float* row, int64_t N, int64_t nw, const RowColumns& rc,
                                          float sink, float* gather) {
  const float m = std::max(row_max(row, N), sink);
  std::fill(row, row + rc.win_begin, 0.0f);
  std::fill(row + rc.win_end, row + nw, 0.0f);
  double sum = exp_shift_sum(row + rc.win_begin, rc.win_end - rc.win_begin, m);
  float* comp = row + nw;
  if (rc.comp_cols) {
    for (int64_t j = 0; j < rc.comp_count; ++j) gather[j] = comp[rc.comp_cols[j]];
    std::fill(comp, row + N, 0.0f);
    sum += exp_shift_sum(gather, rc.comp_count, m);
    for (int64_t j = 0; j < rc.comp_count; ++j) comp[rc.comp_cols[j]] = gather[j];
  } else {
    sum += exp_shift_sum(comp, rc.comp_count, m);
    std::fill(comp + rc.comp_count, row + N, 0.0f);
  }
  sum += static_cast<double>(sink_exp(sink, m));
  const float inv = static_cast<float>(1.0 / sum);
  scale_row(row, N, inv);
  return {m, inv};
}

// out_rows [rows·H, d] (ld d) (+)= P·keys over the layout's columns: one FMA chain per output
// element over the window keys then the compressed ones.
void block_pv(const Core& c, const KeyLayout& L, const float* P, float* out) {
  const int64_t MH = L.rows * c.H, N = L.cols();
  gemm_nn_serial(MH, c.d, L.nw, P, N, c.kv + (L.b * c.S + L.kw0) * c.d, c.d, out, c.d, false);
  gemm_nn_serial(MH, c.d, L.nc, P + L.nw, N, L.comp, c.d, out, c.d, true);
}

// The per-thread scratch of attend_block, sized for every Core it serves.
struct BlockScratch {
  int64_t score_rows = 0, cols = 0, gathered = 0, k = 0, m_rows = 0;
  void fit(const Core& c) {
    score_rows = std::max(score_rows, c.M * c.H);
    cols = std::max(cols, c.max_window() + c.max_compressed());
    gathered = std::max(gathered, c.csa() ? c.max_compressed() * c.d : 0);
    k = std::max(k, c.k);
    m_rows = std::max(m_rows, c.M);
  }
  // scores [score_rows, cols], mask [cols], gathered entries, the row's compressed terms [k]
  int64_t floats() const { return score_rows * cols + cols + gathered + k; }
  // the block's union of picks [m_rows·k], the row's compressed columns [k]
  int64_t ints() const { return m_rows * k + k; }
};

// One query block of sequence b: scores, softmax with the sink, P·keys into out (the Core's
// [B·Sq, H·d] output), and with `stats` each row's shift and 1/Σ ([B·Sq, H, 2]).
void attend_block(const Core& c, int64_t b, int64_t blk, const BlockScratch& size, float* fs,
                  int32_t* is, float* out, float* stats) {
  float* sc = fs;
  float* mask = sc + size.score_rows * size.cols;
  float* gathered = mask + size.cols;
  float* terms = gathered + size.gathered;
  int32_t* ids = is;
  int32_t* cols = ids + size.m_rows * size.k;
  const KeyLayout L = key_layout(c, b, blk, gathered, ids);
  const int64_t N = L.cols();
  block_scores(c, L, sc, mask, cols);
  for (int64_t i = 0; i < L.rows; ++i) {
    const RowColumns rc = row_columns(c, L, i, cols);
    for (int64_t h = 0; h < c.H; ++h) {
      const auto [m, inv] =
          softmax_with_sink(sc + (i * c.H + h) * N, N, L.nw, rc, c.sink[h], terms);
      if (stats) {
        float* s = stats + (c.query_index(b, L.r0 + i) * c.H + h) * 2;
        s[0] = m;
        s[1] = inv;
      }
    }
  }
  block_pv(c, L, sc, out + c.query_index(b, L.r0) * c.hd());
}

}  // namespace

// ---------------------------------------------------------------- init

void V4Attention::init(const std::string& prefix, const V4AttentionDims& d, const RopeParams& rp) {
  dims = d;
  MOE_CHECK(d.hidden > 0 && d.heads > 0 && d.head_dim > 0 && d.q_lora_rank > 0 &&
                d.o_groups > 0 && d.o_lora_rank > 0 && d.window > 0,
            "{}: V4 attention needs positive hidden, heads, head_dim, q_lora_rank, o_groups, "
            "o_lora_rank and window, got {}, {}, {}, {}, {}, {}, {}",
            prefix, d.hidden, d.heads, d.head_dim, d.q_lora_rank, d.o_groups, d.o_lora_rank,
            d.window);
  MOE_CHECK(d.rope_dim >= 0 && d.rope_dim % 2 == 0 && d.rope_dim <= d.head_dim,
            "{}: rope dims must be even and at most head_dim {}, got {}", prefix, d.head_dim,
            d.rope_dim);
  MOE_CHECK(d.heads % d.o_groups == 0, "{}: o_groups {} must divide the {} heads", prefix,
            d.o_groups, d.heads);
  MOE_CHECK(rp.dim == d.rope_dim, "{}: the RoPE flavour rotates {} dims, the heads {}", prefix,
            rp.dim, d.rope_dim);
  MOE_CHECK(d.kv_precision == SimulatedPrecision::None ||
                (d.kv_precision == SimulatedPrecision::Fp8NonRope &&
                 (d.head_dim - d.rope_dim) % kSimFp8Block == 0),
            "{}: the KV's simulated precision must be none, or FP8 on non-RoPE features that fill "
            "blocks of {} (head_dim {} - rope {})", prefix, kSimFp8Block, d.head_dim, d.rope_dim);
  wq_a.init(prefix + "wq_a.weight", d.hidden, d.q_lora_rank);
  q_norm.init(prefix + "q_norm.weight", d.q_lora_rank, d.eps);
  wq_b.init(prefix + "wq_b.weight", d.q_lora_rank, qdim());
  wkv.init(prefix + "wkv.weight", d.hidden, d.head_dim);
  kv_norm.init(prefix + "kv_norm.weight", d.head_dim, d.eps);
  wo_a.init(prefix + "wo_a.weight", {d.o_groups * d.o_lora_rank, group_in()}, /*decay=*/true);
  wo_b.init(prefix + "wo_b.weight", d.o_groups * d.o_lora_rank, d.hidden);
  // The sinks are per-head logits like a bias: no weight decay. Zero start = one phantom key of
  // score 0.
  attn_sink.init(prefix + "attn_sink", {d.heads}, /*decay=*/false);
  softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.head_dim)));
  ones_ = Tensor::empty({d.head_dim}, DType::F32, MemCategory::Weights);
  std::fill(ones_.f32(), ones_.f32() + d.head_dim, 1.0f);
  share_rope(std::make_shared<RopeTable>(rp, 0));
}

void V4Attention::share_rope(std::shared_ptr<RopeTable> table) {
  MOE_CHECK(table && table->dim() == dims.rope_dim && table->mscale() == 1.0,
            "{}: V4 attention needs a RoPE table of {} dims with mscale 1 (its output rotation "
            "is undone by the transpose rotation)",
            wo_b.weight.name, dims.rope_dim);
  rope_ = std::move(table);
}

void V4Attention::collect(ParamList& out) {
  wq_a.collect(out);
  q_norm.collect(out);
  wq_b.collect(out);
  wkv.collect(out);
  kv_norm.collect(out);
  out.push_back(&wo_a);
  wo_b.collect(out);
  out.push_back(&attn_sink);
}

// ---------------------------------------------------------------- forward

Tensor V4Attention::query_residual(const Tensor& x, Pass pass, SaveInput save_input) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dims.hidden, "{}: expected input [T, {}], got {}",
            wq_a.weight.name, dims.hidden, shape_str(x.shape()));
  const Pass first = save_input == SaveInput::Yes ? pass : Pass::Eval;
  Tensor qr = q_norm.forward(wq_a.forward(x, first), pass);
  pending_qr_ = qr;
  pending_pass_ = pass;
  pending_save_ = save_input;
  return qr;
}

Tensor V4Attention::forward(const Tensor& x, const BatchShape& shape, Pass pass,
                            const CompressedKv& ckv, const Tensor& qr_in, SaveInput save_input) {
  const std::string& name = wo_b.weight.name;
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dims.hidden && x.dim(0) == shape.tokens(),
            "{}: expected input [{} x {}, {}], got {}", name, shape.batch, shape.seq, dims.hidden,
            shape_str(x.shape()));
  const int64_t T = x.dim(0), B = shape.batch, S = shape.seq, H = dims.heads, d = dims.head_dim;
  const int64_t HD = qdim();
  Core c;
  c.B = B, c.S = S, c.H = H, c.d = d, c.window = dims.window;
  c.M = std::max<int64_t>(1, kStackedRows / H);
  c.scale = softmax_scale;
  c.sink = attn_sink.w();
  if (ckv.defined()) {
    const Tensor& e = ckv.entries;
    MOE_CHECK(e.defined() && e.dtype() == DType::F32 && e.ndim() == 3 && e.dim(0) == B &&
                  e.dim(1) == S / ckv.ratio && e.dim(2) == d,
              "{}: compressed entries must be F32 [{}, {} / {}, {}], got {}", name, B, S,
              ckv.ratio, d, e.defined() ? shape_str(e.shape()) : "none");
    c.ratio = ckv.ratio;
    c.W = e.dim(1);
    c.entries = e.f32();
    if (ckv.picked.defined()) {
      const Tensor& p = ckv.picked;
      MOE_CHECK(p.dtype() == DType::I32 && p.ndim() == 2 && p.dim(0) == T,
                "{}: picked must be I32 [{}, k], got {}", name, T, shape_str(p.shape()));
      c.k = p.dim(1);
      c.picks = p.i32();
      // A pick outside what the query may see would leak the future into the past.
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = t % S, visible = (s + 1) / ckv.ratio;
        int64_t last = -1;
        for (int64_t j = 0; j < c.k; ++j) {
          const int32_t w = c.picks[t * c.k + j];
          if (w < 0) continue;
          MOE_CHECK(w < visible, "{}: picked[{}, {}] = {} is not visible at position {} "
                    "(must be -1 or below floor((s + 1) / {}) = {})",
                    name, t, j, w, s, ckv.ratio, visible);
          MOE_CHECK(w > last, "{}: picked row {} must list ascending, distinct ids; {} follows {}",
                    name, t, w, last);
          last = w;
        }
      }
    }
  }
  Tensor qr = take_query_residual(x, qr_in, pass, save_input);
  MOE_CHECK(qr.ndim() == 2 && qr.dim(0) == T, "{}: qr has {} rows for {} tokens", name,
            qr.dim(0), T);

  const bool train = needs_backward(pass);
  const Pass first = save_input == SaveInput::Yes ? pass : Pass::Eval;
  rope_->ensure(S);
  const Tensor positions = sequence_positions(B, S);

  // q: wq_b saves nothing (backward rebuilds its input with q_norm.recompute_output()).
  Tensor q_rstd;
  Tensor q = query_heads(std::move(qr), positions, train ? &q_rstd : nullptr);
  // kv: kv_norm saves its input; the rotated output is rebuilt in backward.
  Tensor kv = shared_kv(x, positions, pass, first);

  c.q = q.f32();
  c.kv = kv.f32();
  Tensor o = activation({T, HD});
  Tensor stats = train ? activation({T, H, 2}) : Tensor();
  {
    const int64_t nblk = c.blocks();
    BlockScratch size;
    size.fit(c);
    const ThreadSlabs fslabs(size.floats()), islabs(size.ints(), DType::I32);
    float* st = train ? stats.f32() : nullptr;
    // The longest blocks (the most keys) first, to even out the dynamic schedule.
    parallel_for_dynamic(0, B * nblk, [&](int64_t task) {
      const int64_t b = task / nblk, blk = nblk - 1 - task % nblk;
      attend_block(c, b, blk, size, fslabs.mine(), islabs.mine_i32(), o.f32(), st);
    });
  }
  kv.reset();
  Tensor y = output(std::move(o), positions, pass);

  if (train) {
    saved_shape_ = shape;
    saved_ckv_ = ckv;
    saved_q_ = q;
    saved_q_rstd_ = q_rstd;
    saved_stats_ = stats;
    saved_x_kept_ = save_input == SaveInput::Yes;
  }
  return y;
}

Tensor V4Attention::take_query_residual(const Tensor& x, const Tensor& qr_in, Pass pass,
                                        SaveInput save_input) {
  Tensor qr;
  if (qr_in.defined()) {
    MOE_CHECK(pending_qr_.defined() && qr_in.raw() == pending_qr_.raw() &&
                  qr_in.shape() == pending_qr_.shape() && pending_pass_ == pass &&
                  pending_save_ == save_input,
              "{}: qr must be what query_residual(x, pass, save_input) just returned",
              wo_b.weight.name);
    qr = qr_in;
  } else {
    qr = query_residual(x, pass, save_input);
  }
  pending_qr_.reset();
  return qr;
}

Tensor V4Attention::query_heads(Tensor qr, const Tensor& positions, Tensor* q_rstd) {
  const int64_t T = qr.dim(0), H = dims.heads, d = dims.head_dim, HD = qdim();
  Tensor q = wq_b.forward(qr, Pass::Eval);
  qr.reset();
  if (q_rstd) *q_rstd = activation({T, H});
  float* qp = q.f32();
  float* rp = q_rstd ? q_rstd->f32() : nullptr;
  const float* ones = ones_.f32();
  const float eps = static_cast<float>(dims.eps);
  parallel_for(0, T, [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      float* v = qp + t * HD + h * d;
      const float r = rmsnorm_row(v, ones, v, d, eps);  // in place: the sum is taken first
      if (rp) rp[t * H + h] = r;
    }
  });
  rope_forward(*rope_, q.f32() + (d - dims.rope_dim), T, H, HD, d, positions.i32());
  return q;
}

Tensor V4Attention::shared_kv(const Tensor& x, const Tensor& positions, Pass pass, Pass first) {
  Tensor kv = kv_norm.forward(wkv.forward(x, first), pass);
  rotate_and_simulate_kv(kv, positions);
  return kv;
}

void V4Attention::rotate_and_simulate_kv(Tensor& kv, const Tensor& positions) const {
  const int64_t T = kv.dim(0), d = dims.head_dim;
  rope_forward(*rope_, kv.f32() + (d - dims.rope_dim), T, 1, d, 0, positions.i32());
  // After RoPE, as the reference: the quantized features and the rotated ones are disjoint.
  simulate_precision(dims.kv_precision, kv.f32(), T, d, dims.rope_dim);
}

Tensor V4Attention::output(Tensor o, const Tensor& positions, Pass pass) {
  const int64_t T = o.dim(0), d = dims.head_dim, HD = qdim();
  // Take the query position's rotation back out of the output, then the grouped projection.
  rope_inverse(*rope_, o.f32() + (d - dims.rope_dim), T, dims.heads, HD, d, positions.i32());
  const int64_t g = dims.o_groups, gi = group_in(), ol = dims.o_lora_rank;
  Tensor z = activation({T, g * ol});
  for (int64_t j = 0; j < g; ++j)
    gemm_nt(T, ol, gi, o.f32() + j * gi, HD, wo_a.w() + j * ol * gi, gi, z.f32() + j * ol, g * ol,
            false);
  o.reset();
  return wo_b.forward(z, pass);
}

// ---------------------------------------------------------------- cached inference

Tensor V4Attention::forward_cached(const Tensor& x, const Tensor& qr_in,
                                   std::span<const CachedChunk> chunks, const V4LayerCache& cache,
                                   const Tensor& picks) {
  const std::string& name = wo_b.weight.name;
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dims.hidden, "{}: expected input [T, {}], got {}", name,
            dims.hidden, shape_str(x.shape()));
  const int64_t T = x.dim(0), H = dims.heads, d = dims.head_dim, HD = qdim();
  const std::vector<int64_t> first = chunk_first_rows(chunks, T, name);
  Tensor qr = take_query_residual(x, qr_in, Pass::Inference, SaveInput::Yes);
  MOE_CHECK(qr.ndim() == 2 && qr.dim(0) == T, "{}: qr has {} rows for {} tokens", name,
            qr.dim(0), T);
  MOE_CHECK(picks.defined() == (cache.ratio == 4),
            "{}: a cached forward needs the indexer's picks exactly when the layer is CSA "
            "(ratio 4), here ratio {} with{} picks", name, cache.ratio,
            picks.defined() ? "" : "out");
  if (picks.defined())
    MOE_CHECK(picks.dtype() == DType::I32 && picks.ndim() == 2 && picks.dim(0) == T,
              "{}: picks must be I32 [{}, k], got {}", name, T, shape_str(picks.shape()));
  if (T == 0) return activation({0, dims.hidden});

  Tensor positions = Tensor::empty({T}, DType::I32, MemCategory::Activations);
  int64_t end = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    for (int64_t j = 0; j < chunks[i].count; ++j)
      positions.i32()[first[i] + j] = static_cast<int32_t>(chunks[i].past + j);
    end = std::max(end, chunks[i].past + chunks[i].count);
  }
  rope_->ensure(end);
  Tensor q = query_heads(std::move(qr), positions, nullptr);
  Tensor kv = shared_kv(x, positions, Pass::Inference, Pass::Inference);

  // Per chunk one sequence of keys, contiguous: the ring's rows of the window before the chunk,
  // then the chunk's own; its queries are the chunk's rows.
  const int64_t R = cache.window_rows;
  auto window_start = [&](const CachedChunk& ch) {
    return std::max<int64_t>(0, ch.past - dims.window + 1);
  };
  int64_t key_rows = 0;
  for (const CachedChunk& ch : chunks)
    if (ch.count > 0) key_rows += ch.past - window_start(ch) + ch.count;
  Tensor keys = activation({key_rows, d});
  std::vector<Core> cores;
  std::vector<int64_t> core_row0, task_end;
  BlockScratch size;
  int64_t at = 0, tasks = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CachedChunk& ch = chunks[i];
    if (ch.count == 0) continue;
    const int64_t k0 = window_start(ch), before = ch.past - k0;
    float* kb = keys.f32() + at * d;
    for (int64_t p = k0; p < ch.past; ++p)
      std::copy_n(cache.window + (ch.slot * R + p % R) * d, d, kb + (p - k0) * d);
    std::copy_n(kv.f32() + first[i] * d, ch.count * d, kb + before * d);
    Core c;
    c.B = 1, c.S = before + ch.count, c.H = H, c.d = d, c.window = dims.window;
    c.q_first = before, c.pos0 = k0;
    c.M = std::max<int64_t>(1, kStackedRows / H);
    c.scale = softmax_scale;
    c.sink = attn_sink.w();
    c.q = q.f32() + first[i] * HD;
    c.kv = kb;
    if (cache.ratio > 0) {
      const V4CompressorCache& e = cache.compressor;
      c.ratio = cache.ratio;
      c.W = std::min(e.max_entries, (ch.past + ch.count) / cache.ratio);
      c.entries = e.entries + ch.slot * e.max_entries * d;
      if (picks.defined()) {
        c.k = picks.dim(1);
        c.picks = picks.i32() + first[i] * c.k;
      }
    }
    size.fit(c);
    cores.push_back(c);
    core_row0.push_back(first[i]);
    tasks += c.blocks();
    task_end.push_back(tasks);
    at += c.S;
  }
  // The ring takes the new rows only now that every chunk has read the ones they replace.
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CachedChunk& ch = chunks[i];
    for (int64_t p = std::max(ch.past, ch.past + ch.count - R); p < ch.past + ch.count; ++p)
      std::copy_n(kv.f32() + (first[i] + p - ch.past) * d, d,
                  cache.window + (ch.slot * R + p % R) * d);
  }
  kv.reset();

  Tensor o = activation({T, HD});
  {
    const ThreadSlabs fslabs(size.floats()), islabs(size.ints(), DType::I32);
    parallel_for_dynamic(0, tasks, [&](int64_t task) {
      const size_t ci = static_cast<size_t>(
          std::upper_bound(task_end.begin(), task_end.end(), task) - task_end.begin());
      const int64_t blk = task - (ci == 0 ? 0 : task_end[ci - 1]);
      attend_block(cores[ci], 0, blk, size, fslabs.mine(), islabs.mine_i32(),
                   o.f32() + core_row0[ci] * HD, nullptr);
    });
  }
  keys.reset();
  return output(std::move(o), positions, Pass::Inference);
}

// ---------------------------------------------------------------- backward

Tensor V4Attention::backward(const Tensor& dy, const Tensor& d_entries) {
  MOE_CHECK(has_saved(), "{}: backward without a training forward", wo_b.weight.name);
  MOE_CHECK(saved_x_kept_, "{}: the forward did not save its input: call backward(dy, x, "
            "d_entries)", wo_b.weight.name);
  return backward_impl(dy, Tensor(), d_entries);
}

Tensor V4Attention::backward(const Tensor& dy, const Tensor& x, const Tensor& d_entries) {
  MOE_CHECK(has_saved(), "{}: backward without a training forward", wo_b.weight.name);
  MOE_CHECK(x.ndim() == 2 && x.dim(0) == saved_shape_.tokens() && x.dim(1) == dims.hidden,
            "{}: backward input must be [{}, {}], got {}", wo_b.weight.name,
            saved_shape_.tokens(), dims.hidden, shape_str(x.shape()));
  return backward_impl(dy, x, d_entries);
}

Tensor V4Attention::backward_impl(const Tensor& dy, const Tensor& x, const Tensor& d_entries) {
  const std::string& name = wo_b.weight.name;
  const BatchShape shape = saved_shape_;
  const int64_t T = shape.tokens(), B = shape.batch, S = shape.seq, H = dims.heads;
  const int64_t d = dims.head_dim, dr = dims.rope_dim, HD = qdim();
  MOE_CHECK(dy.ndim() == 2 && dy.dim(0) == T && dy.dim(1) == dims.hidden,
            "{}: dy must be [{}, {}], got {}", name, T, dims.hidden, shape_str(dy.shape()));
  const CompressedKv ckv = saved_ckv_;
  const bool want_entries = ckv.defined() && d_entries.defined();
  if (d_entries.defined())
    MOE_CHECK(ckv.defined() && d_entries.dtype() == DType::F32 &&
                  d_entries.shape() == ckv.entries.shape(),
              "{}: d_entries must be F32 {} like the forward's entries, got {}", name,
              ckv.defined() ? shape_str(ckv.entries.shape()) : "(none: the forward had no entries)",
              shape_str(d_entries.shape()));
  const Tensor positions = sequence_positions(B, S);
  const int64_t g = dims.o_groups, gi = group_in(), ol = dims.o_lora_rank;

  // Output side: dz through wo_b, then each group's dO' = dz_j·wo_a_j, then the transpose of the
  // inverse rotation (the forward rotation) gives dO in the attention's own frame.
  Tensor dz = wo_b.backward(dy);
  Tensor dO = activation({T, HD});
  for (int64_t j = 0; j < g; ++j)
    gemm_nn(T, gi, ol, dz.f32() + j * ol, g * ol, wo_a.w() + j * ol * gi, gi, dO.f32() + j * gi,
            HD, false);
  rope_forward(*rope_, dO.f32() + (d - dr), T, H, HD, d, positions.i32());

  // The forward's keys and values bit for bit. Their gradient below is that of the simulated
  // values, taken as the unquantized ones' (straight-through, as quantization-aware training).
  Tensor kv = kv_norm.recompute_output();
  rotate_and_simulate_kv(kv, positions);

  Core c;
  c.B = B, c.S = S, c.H = H, c.d = d, c.window = dims.window;
  c.M = std::max<int64_t>(1, kStackedRows / H);
  c.scale = softmax_scale;
  c.sink = attn_sink.w();
  c.q = saved_q_.f32();
  c.kv = kv.f32();
  if (ckv.defined()) {
    c.ratio = ckv.ratio;
    c.W = ckv.entries.dim(1);
    c.entries = ckv.entries.f32();
    if (ckv.picked.defined()) {
      c.k = ckv.picked.dim(1);
      c.picks = ckv.picked.i32();
    }
  }
  const float* st = saved_stats_.f32();
  const float* dOp = dO.f32();
  const bool need_o = wo_a.grad.defined();

  // Pass 1, query side, on the forward's blocks: P again (scores, then exp(s − m)·inv from the
  // saved stats), o = P·kv when wo_a needs its input, dP = dO·keysᵀ, the row term
  // D = Σ_j p_j·dp_j (= dO·o: the sink's value is zero, so it adds nothing), dS, and dQ = dS·keys.
  // Each query row belongs to one block, so dQ and o are written without conflicts.
  Tensor dq = activation({T, HD});
  Tensor o = need_o ? activation({T, HD}) : Tensor();
  Tensor rowD = activation({T, H});
  Tensor sink_terms = activation({T, H});  // −p_sink·D per row, summed per head below
  {
    const int64_t nblk = c.blocks(), MH = c.M * H;
    const int64_t cols = c.max_window() + c.max_compressed();
    const ThreadSlabs slabs(2 * MH * cols + cols + (c.csa() ? c.max_compressed() * d : 0),
                            DType::F32);
    // The block's union of picks [M·k], then one row's compressed columns [k].
    const ThreadSlabs id_slabs(c.csa() ? c.M * c.k + c.k : 0, DType::I32);
    float* dqp = dq.f32();
    float* op = need_o ? o.f32() : nullptr;
    float* Dp = rowD.f32();
    float* sp = sink_terms.f32();
    const float scale = c.scale;
    parallel_for_dynamic(0, B * nblk, [&](int64_t task) {
      const int64_t b = task / nblk, blk = nblk - 1 - task % nblk;
      float* P = slabs.mine();
      float* dP = P + MH * cols;
      float* mask = dP + MH * cols;
      int32_t* ids = id_slabs.mine_i32();
      const KeyLayout L = key_layout(c, b, blk, mask + cols, ids);
      const int64_t N = L.cols(), row0 = b * S + L.r0;
      block_scores(c, L, P, mask, ids + c.M * c.k);
      for (int64_t i = 0; i < L.rows; ++i)
        for (int64_t h = 0; h < H; ++h) {
          float* row = P + (i * H + h) * N;
          const float* s = st + ((row0 + i) * H + h) * 2;
          exp_shift_sum(row, N, s[0]);
          scale_row(row, N, s[1]);
        }
      if (op) block_pv(c, L, P, op + row0 * HD);
      const float* dOrows = dOp + row0 * HD;
      gemm_nt_serial(L.rows * H, L.nw, d, dOrows, d, c.kv + (b * S + L.kw0) * d, d, dP, N, false);
      gemm_nt_serial(L.rows * H, L.nc, d, dOrows, d, L.comp, d, dP + L.nw, N, false);
      for (int64_t i = 0; i < L.rows; ++i)
        for (int64_t h = 0; h < H; ++h) {
          // Softmax backward, dS = P ⊙ (dP − D) with D = rowsum(dP ⊙ P), times the score
          // scale; over P. Masked columns stay 0 as P is 0 there.
          const int64_t o = (i * H + h) * N;
          const double dot = softmax_backward_row(P + o, dP + o, N, scale);
          const int64_t r = (row0 + i) * H + h;
          const float* s = st + r * 2;
          Dp[r] = static_cast<float>(dot);
          sp[r] = static_cast<float>(-static_cast<double>(sink_exp(c.sink[h], s[0]) * s[1]) * dot);
        }
      block_pv(c, L, P, dqp + row0 * HD);  // dQ = dS·keys
    });
  }
  if (need_o) {
    rope_inverse(*rope_, o.f32() + (d - dr), T, H, HD, d, positions.i32());
    for (int64_t j = 0; j < g; ++j)
      gemm_tn(ol, gi, T, dz.f32() + j * ol, g * ol, o.f32() + j * gi, HD, wo_a.g() + j * ol * gi,
              gi, true);
    o.reset();
  }
  dz.reset();
  if (attn_sink.grad.defined()) {
    // One serial sum per head over the rows in order: the same bits for any thread count.
    const float* sp = sink_terms.f32();
    float* gs = attn_sink.g();
    for (int64_t h = 0; h < H; ++h) {
      double s = 0;
      for (int64_t t = 0; t < T; ++t) s += sp[t * H + h];
      gs[h] += static_cast<float>(s);
    }
  }
  sink_terms.reset();

  // Pass 2, key side: every key's gradient Σ over the (query, head) rows that see it of
  // dS·q (as a key) + P·dO (as a value), kv being both. Tasks own disjoint key blocks (window
  // positions of one sequence, or compressed entries), rebuild P and dS for the queries that see
  // them (scores again, then the saved stats and D), and accumulate in query order: no partial
  // buffers to reduce, and the same bits for any thread count. The price is a second score and
  // dP GEMM over the visible pairs.
  Tensor dkv = Tensor::zeros({T, d}, DType::F32, MemCategory::Activations);
  {
    const int64_t MH = c.M * H, kb = kKeyBlock;
    const int64_t win_blocks = (S + kb - 1) / kb;
    const int64_t ent_blocks = want_entries ? (c.W + kb - 1) / kb : 0;
    const int64_t per_b = win_blocks + ent_blocks;
    const ThreadSlabs slabs(2 * MH * kb + kb, DType::F32);
    const float* Dp = rowD.f32();
    float* dkvp = dkv.f32();
    float* dep = want_entries ? d_entries.f32() : nullptr;
    const float scale = c.scale;
    parallel_for_dynamic(0, B * per_b, [&](int64_t task) {
      const int64_t b = task / per_b, blk = task % per_b;
      const bool window_block = blk < win_blocks;
      const int64_t k0 = (window_block ? blk : blk - win_blocks) * kb;
      const int64_t nk = std::min(window_block ? S : c.W, k0 + kb) - k0;
      const float* keys = window_block ? c.kv + (b * S + k0) * d : c.entries + (b * c.W + k0) * d;
      float* dkeys = window_block ? dkvp + (b * S + k0) * d : dep + (b * c.W + k0) * d;
      // The queries that can see a key of this block.
      const int64_t t_begin = window_block ? k0 : (k0 + 1) * c.ratio - 1;
      const int64_t t_end = window_block ? std::min(S, k0 + nk + c.window - 1) : S;
      float* P = slabs.mine();
      float* dP = P + MH * kb;
      float* mask = dP + MH * kb;
      for (int64_t t0 = t_begin; t0 < t_end; t0 += c.M) {
        const int64_t rows = std::min(t_end, t0 + c.M) - t0, R = rows * H;
        const int64_t row0 = b * S + t0;
        const float* qrows = c.q + row0 * HD;
        const float* dOrows = dOp + row0 * HD;
        gemm_nt_serial(R, nk, d, qrows, d, keys, d, P, nk, false);
        bool any = false;
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t t = t0 + i;
          if (window_block) {
            const int64_t lo = std::max<int64_t>(0, t - c.window + 1);
            for (int64_t j = 0; j < nk; ++j)
              mask[j] = k0 + j >= lo && k0 + j <= t ? 0.0f : kNegInf;
            any = true;
          } else if (!c.csa()) {
            const int64_t visible = (t + 1) / c.ratio;
            for (int64_t j = 0; j < nk; ++j) mask[j] = k0 + j < visible ? 0.0f : kNegInf;
            any = true;
          } else {
            std::fill(mask, mask + nk, kNegInf);
            const int32_t* p = c.picks + (b * S + t) * c.k;
            for (int64_t j = 0; j < c.k; ++j)
              if (p[j] >= k0 && p[j] < k0 + nk) {
                mask[p[j] - k0] = 0.0f;
                any = true;
              }
          }
          for (int64_t h = 0; h < H; ++h) {
            float* row = P + (i * H + h) * nk;
            const float* s = st + ((row0 + i) * H + h) * 2;
            scale_row(row, nk, scale);
            for (int64_t j = 0; j < nk; ++j) row[j] += mask[j];
            exp_shift_sum(row, nk, s[0]);  // elementwise: the bits of the forward's P
            scale_row(row, nk, s[1]);
          }
        }
        if (!any) continue;  // a CSA chunk that picked none of these entries adds nothing
        gemm_nt_serial(R, nk, d, dOrows, d, keys, d, dP, nk, false);
        gemm_tn_serial(nk, d, R, P, nk, dOrows, d, dkeys, d, true);  // value side: Pᵀ·dO
        for (int64_t r = 0; r < R; ++r) {
          float* p = P + r * nk;
          const float* dp = dP + r * nk;
          const float D = Dp[row0 * H + r];
          for (int64_t j = 0; j < nk; ++j) p[j] = scale * (p[j] * (dp[j] - D));
        }
        gemm_tn_serial(nk, d, R, P, nk, qrows, d, dkeys, d, true);  // key side: dSᵀ·q
      }
    });
  }
  dO.reset();
  kv.reset();
  rowD.reset();
  saved_stats_.reset();
  saved_ckv_ = CompressedKv();

  // Per-head q normalisation and RoPE, backward in the rotated frame: with y = x·r per head,
  // dx = r·(dy − y·mean(y·dy)), and y·dy is the same before and after an orthogonal rotation,
  // so the projection runs on the saved (rotated) q and then the transpose rotation applies.
  {
    const float* qp = saved_q_.f32();
    const float* rp = saved_q_rstd_.f32();
    float* dqp = dq.f32();
    parallel_for(0, T, [&](int64_t t) {
      for (int64_t h = 0; h < H; ++h) {
        const float* y = qp + t * HD + h * d;
        float* g_ = dqp + t * HD + h * d;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(y[i]) * g_[i];
        const float mean = static_cast<float>(dot / static_cast<double>(d));
        const float r = rp[t * H + h];
        for (int64_t i = 0; i < d; ++i) g_[i] = r * (g_[i] - y[i] * mean);
      }
    });
  }
  saved_q_.reset();
  saved_q_rstd_.reset();
  rope_backward(*rope_, dq.f32() + (d - dr), T, H, HD, d, positions.i32());

  Tensor dqr;
  {
    const Tensor qr = q_norm.recompute_output();
    dqr = wq_b.backward(dq, qr);
  }
  dq.reset();
  Tensor dx = x.defined() ? wq_a.backward(q_norm.backward(dqr), x)
                          : wq_a.backward(q_norm.backward(dqr));
  dqr.reset();
  rope_backward(*rope_, dkv.f32() + (d - dr), T, 1, d, 0, positions.i32());
  const Tensor dkv_pre = kv_norm.backward(dkv);
  dkv.reset();
  if (x.defined())
    wkv.backward_accumulate(dkv_pre, dx, x);
  else
    wkv.backward_accumulate(dkv_pre, dx);
  return dx;
}

}  // namespace moe
