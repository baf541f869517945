#include "model/v4/indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "core/thread_slabs.h"
#include "kernels/gemm.h"

namespace moe {

namespace {

// One token's picks: I(s) = Σ_h w_h·ReLU(sc[h, s]) over its `visible` entries (sc [H, visible]),
// then the top `topk` ids in ascending order. forward() and forward_cached() both select here,
// so a token gets the same picks from either.
void select_entries(const float* sc, const float* w, int64_t H, int64_t visible, int64_t topk,
                    float* score, int32_t* ids, int32_t* out) {
  std::fill(score, score + visible, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    const float* sh = sc + h * visible;
    for (int64_t s = 0; s < visible; ++s) score[s] += std::max(sh[s], 0.0f) * w[h];
  }
  // A total order: higher score first, then the lower id; NaN below every number.
  auto key = [&](int32_t s) {
    const float v = score[s];
    return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
  };
  auto before = [&](int32_t a, int32_t c) {
    const float ka = key(a), kc = key(c);
    if (ka != kc) return ka > kc;
    const bool na = std::isnan(score[a]), nc = std::isnan(score[c]);
    if (na != nc) return nc;  // -inf outranks NaN
    return a < c;
  };
  for (int64_t s = 0; s < visible; ++s) ids[s] = static_cast<int32_t>(s);
  std::nth_element(ids, ids + topk - 1, ids + visible, before);
  std::sort(ids, ids + topk);
  std::copy(ids, ids + topk, out);
}

// The factor of the head weights, d_i^-0.5 · n_heads^-0.5.
float head_weight_scale(int64_t head_dim, int64_t n_heads) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim) * n_heads));
}

// A token that sees at most topk entries picks them all, whatever the scores.
void pick_all_visible(int64_t visible, int64_t topk, int32_t* out) {
  for (int64_t i = 0; i < topk; ++i) out[i] = i < visible ? static_cast<int32_t>(i) : -1;
}

}  // namespace

void V4Indexer::init(const std::string& prefix, const V4IndexerDims& dims) {
  dim = dims.dim;
  q_lora = dims.q_lora;
  n_heads = dims.n_heads;
  head_dim = dims.head_dim;
  rope_dim = dims.rope_dim;
  topk = dims.topk;
  ratio = dims.ratio;
  MOE_CHECK(dim > 0 && q_lora > 0 && n_heads > 0 && head_dim > 0 && topk > 0 && ratio > 0,
            "{}: indexer needs positive dim, q_lora, n_heads, head_dim, topk and ratio", prefix);
  qk_precision = dims.qk_precision;
  MOE_CHECK(qk_precision == SimulatedPrecision::None ||
                qk_precision == SimulatedPrecision::HadamardFp4,
            "{}: the indexer's simulated precision must be none or Hadamard + FP4", prefix);
  wq_b.init(prefix + "wq_b.weight", {n_heads * head_dim, q_lora}, /*decay=*/true);
  weights_proj.init(prefix + "weights_proj.weight", {n_heads, dim}, /*decay=*/true);
  // Its keys get the queries' treatment, so both sides of q·k sit in the same rotated frame.
  compressor.init(prefix + "compressor.", {.dim = dim,
                                           .head_dim = head_dim,
                                           .rope_dim = rope_dim,
                                           .ratio = ratio,
                                           .eps = dims.eps,
                                           .entry_precision = qk_precision});
  // Loaded and saved with the model, never trained (see the header).
  ParamList own;
  collect(own);
  for (Param* p : own) p->trainable = false;
}

void V4Indexer::share_rope(std::shared_ptr<RopeTable> table) {
  rope_ = table;
  compressor.share_rope(std::move(table));
}

void V4Indexer::collect(ParamList& out) {
  out.push_back(&wq_b);
  out.push_back(&weights_proj);
  compressor.collect(out);
}

Tensor V4Indexer::forward(const Tensor& x, const Tensor& qr, const BatchShape& shape) {
  const int64_t B = shape.batch, S = shape.seq, T = shape.tokens();
  MOE_CHECK(x.ndim() == 2 && x.dim(0) == T && x.dim(1) == dim,
            "{}: expected x [{} x {}, {}], got {}", wq_b.name, B, S, dim, shape_str(x.shape()));
  MOE_CHECK(qr.ndim() == 2 && qr.dim(0) == T && qr.dim(1) == q_lora,
            "{}: expected qr [{} x {}, {}], got {}", wq_b.name, B, S, q_lora,
            shape_str(qr.shape()));
  MOE_CHECK(rope_dim == 0 || (rope_ != nullptr && rope_->dim() == rope_dim),
            "{}: needs a RoPE table of {} dims (share_rope before forward)", wq_b.name, rope_dim);
  Tensor picks = Tensor::empty({T, topk}, DType::I32, MemCategory::Routing);
  int32_t* pk = picks.i32();

  // Token t sees floor((t+1)/ratio) entries; from t0 on there are more than topk, and only those
  // tokens need scores. Before t0 the picks are every visible entry.
  const int64_t t0 = std::min(S, (topk + 1) * ratio - 1);
  parallel_for(0, T, [&](int64_t r) {
    const int64_t t = r % S;
    if (t >= t0) return;
    pick_all_visible((t + 1) / ratio, topk, pk + r * topk);
  });
  if (t0 >= S) return picks;

  const int64_t W = S / ratio, nq = S - t0, H = n_heads, di = head_dim, hd = H * di;
  const Tensor keys = compressor.forward(x, shape, Pass::Eval).entries;  // [B, W, d_i]

  // q and the head weights of the scored tokens only: [B·nq, H·d_i] and [B·nq, H].
  Tensor q = Tensor::empty({B * nq, hd}, DType::F32, MemCategory::Scratch);
  Tensor hw = Tensor::empty({B * nq, H}, DType::F32, MemCategory::Scratch);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r0 = b * S + t0;
    gemm_nt(nq, hd, q_lora, qr.f32() + r0 * q_lora, q_lora, wq_b.w(), q_lora,
            q.f32() + b * nq * hd, hd, false);
    gemm_nt(nq, H, dim, x.f32() + r0 * dim, dim, weights_proj.w(), dim, hw.f32() + b * nq * H, H,
            false);
  }
  const float scale = head_weight_scale(di, H);
  {
    float* w = hw.f32();
    for (int64_t i = 0; i < hw.numel(); ++i) w[i] *= scale;
  }
  if (rope_dim > 0) {
    rope_->ensure(S);
    Tensor pos = Tensor::empty({B * nq}, DType::I32, MemCategory::Scratch);
    for (int64_t i = 0; i < B * nq; ++i) pos.i32()[i] = static_cast<int32_t>(t0 + i % nq);
    rope_forward(*rope_, q.f32() + (di - rope_dim), B * nq, H, hd, di, pos.i32());
  }
  simulate_precision(qk_precision, q.f32(), B * nq * H, di, rope_dim);

  // Tokens t0 + 4g .. t0 + 4g + 3 see the same entries ((t0 + 1) is a multiple of ratio), so
  // a group's head scores [group·H, visible] come from one GEMM (its q rows are contiguous);
  // then per token I over the visible entries and the selection. Later groups see more
  // entries, hence the dynamic schedule.
  const int64_t groups = (nq + ratio - 1) / ratio;
  const int64_t threads = num_threads();
  const int64_t slab = (ratio * H + 1) * W;
  Tensor fscratch = Tensor::empty({threads * slab}, DType::F32, MemCategory::Scratch);
  Tensor iscratch = Tensor::empty({threads * W}, DType::I32, MemCategory::Scratch);
  parallel_for_dynamic(0, B * groups, [&](int64_t item) {
    const int64_t b = item / groups, i0 = (item % groups) * ratio;
    const int64_t n_tok = std::min(ratio, nq - i0), visible = (t0 + i0 + 1) / ratio;
    float* sc = fscratch.f32() + thread_index() * slab;
    float* score = sc + ratio * H * W;
    int32_t* ids = iscratch.i32() + thread_index() * W;
    gemm_nt_serial(n_tok * H, visible, di, q.f32() + (b * nq + i0) * hd, di,
                   keys.f32() + b * W * di, di, sc, visible, false);
    for (int64_t j = 0; j < n_tok; ++j) {
      const int64_t i = b * nq + i0 + j, t = t0 + i0 + j;
      select_entries(sc + j * H * visible, hw.f32() + i * H, H, visible, topk, score, ids,
                     pk + (b * S + t) * topk);
    }
  });
  return picks;
}

Tensor V4Indexer::forward_cached(const Tensor& x, const Tensor& qr,
                                 std::span<const CachedChunk> chunks,
                                 const V4CompressorCache& keys) {
  const int64_t T = x.dim(0);
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dim, "{}: expected x [T, {}], got {}", wq_b.name, dim,
            shape_str(x.shape()));
  MOE_CHECK(qr.ndim() == 2 && qr.dim(0) == T && qr.dim(1) == q_lora,
            "{}: expected qr [{}, {}], got {}", wq_b.name, T, q_lora, shape_str(qr.shape()));
  const std::vector<int64_t> first = chunk_first_rows(chunks, T, wq_b.name);
  Tensor picks = Tensor::empty({T, topk}, DType::I32, MemCategory::Routing);
  int32_t* pk = picks.i32();
  compressor.forward_cached(x, chunks, keys);

  struct Scored {
    int64_t row, position, slot;
  };
  std::vector<Scored> scored;
  int64_t max_visible = 0;
  for (size_t i = 0; i < chunks.size(); ++i)
    for (int64_t j = 0; j < chunks[i].count; ++j) {
      const int64_t row = first[i] + j, t = chunks[i].past + j, visible = (t + 1) / ratio;
      if (visible <= topk) {
        pick_all_visible(visible, topk, pk + row * topk);
      } else {
        scored.push_back({row, t, chunks[i].slot});
        max_visible = std::max(max_visible, visible);
      }
    }
  if (scored.empty()) return picks;

  // q and the head weights of the scored rows, gathered so that one GEMM serves them all (a
  // row's bits do not depend on the rows beside it).
  const int64_t n = static_cast<int64_t>(scored.size()), H = n_heads, di = head_dim, hd = H * di;
  Tensor q = Tensor::empty({n, hd}, DType::F32, MemCategory::Scratch);
  Tensor hw = Tensor::empty({n, H}, DType::F32, MemCategory::Scratch);
  {
    Tensor qr_rows = Tensor::empty({n, q_lora}, DType::F32, MemCategory::Scratch);
    Tensor x_rows = Tensor::empty({n, dim}, DType::F32, MemCategory::Scratch);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t r = scored[static_cast<size_t>(k)].row;
      std::copy_n(qr.f32() + r * q_lora, q_lora, qr_rows.f32() + k * q_lora);
      std::copy_n(x.f32() + r * dim, dim, x_rows.f32() + k * dim);
    }
    gemm_nt(n, hd, q_lora, qr_rows.f32(), q_lora, wq_b.w(), q_lora, q.f32(), hd, false);
    gemm_nt(n, H, dim, x_rows.f32(), dim, weights_proj.w(), dim, hw.f32(), H, false);
  }
  const float scale = head_weight_scale(di, H);
  for (int64_t i = 0; i < hw.numel(); ++i) hw.f32()[i] *= scale;
  if (rope_dim > 0) {
    Tensor pos = Tensor::empty({n}, DType::I32, MemCategory::Scratch);
    int64_t last = 0;
    for (int64_t k = 0; k < n; ++k) {
      pos.i32()[k] = static_cast<int32_t>(scored[static_cast<size_t>(k)].position);
      last = std::max(last, scored[static_cast<size_t>(k)].position);
    }
    rope_->ensure(last + 1);
    rope_forward(*rope_, q.f32() + (di - rope_dim), n, H, hd, di, pos.i32());
  }
  simulate_precision(qk_precision, q.f32(), n * H, di, rope_dim);

  const ThreadSlabs fslabs((H + 1) * max_visible);
  const ThreadSlabs islabs(max_visible, DType::I32);
  parallel_for_dynamic(0, n, [&](int64_t k) {
    const Scored& s = scored[static_cast<size_t>(k)];
    const int64_t visible = (s.position + 1) / ratio;
    float* sc = fslabs.mine();
    gemm_nt_serial(H, visible, di, q.f32() + k * hd, di,
                   keys.entries + s.slot * keys.max_entries * di, di, sc, visible, false);
    select_entries(sc, hw.f32() + k * H, H, visible, topk, sc + H * max_visible,
                   islabs.mine_i32(), pk + s.row * topk);
  });
  return picks;
}

}  // namespace moe
