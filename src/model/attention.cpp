#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/thread_slabs.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm.h"
#include "kernels/vector_math.h"

namespace moe {

namespace {

Tensor activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemCategory::Activations);
}

// Query rows per attention block. A block of rows [r0, r1) only needs keys [0, r1), so blocking
// skips most of the masked upper triangle ((n+1)/2n of the full S x S work for n blocks) while
// the matmuls stay large enough to run at speed.
constexpr int64_t kBlock = 64;

}  // namespace

void MLAttention::init(const std::string& prefix, const ModelConfig& cfg) {
  hidden = cfg.hidden_size;
  heads = cfg.num_attention_heads;
  q_lora_rank = cfg.q_lora_rank;
  kv_lora_rank = cfg.kv_lora_rank;
  nope = cfg.qk_nope_head_dim;
  rope_dim = cfg.qk_rope_head_dim;
  v_dim = cfg.v_head_dim;
  MOE_CHECK(hidden > 0 && heads > 0 && kv_lora_rank > 0 && v_dim > 0 && nope >= 0 &&
                q_lora_rank >= 0 && qk_dim() > 0,
            "{}: MLA needs positive hidden_size, num_attention_heads, kv_lora_rank, v_head_dim "
            "and qk head dim, got {}, {}, {}, {}, {}",
            prefix, hidden, heads, kv_lora_rank, v_dim, qk_dim());
  MOE_CHECK(rope_dim >= 0 && rope_dim % 2 == 0, "{}: qk_rope_head_dim must be even, got {}",
            prefix, rope_dim);
  const int64_t q_out = heads * qk_dim();
  if (q_lora_rank > 0) {
    q_a_proj.init(prefix + "q_a_proj.weight", hidden, q_lora_rank);
    q_a_layernorm.init(prefix + "q_a_layernorm.weight", q_lora_rank, cfg.rms_norm_eps);
    q_b_proj.init(prefix + "q_b_proj.weight", q_lora_rank, q_out);
  } else {
    q_proj.init(prefix + "q_proj.weight", hidden, q_out);
  }
  kv_a_proj.init(prefix + "kv_a_proj_with_mqa.weight", {kv_lora_rank + rope_dim, hidden},
                 /*decay=*/true);
  kv_a_layernorm.init(prefix + "kv_a_layernorm.weight", kv_lora_rank, cfg.rms_norm_eps);
  kv_b_proj.init(prefix + "kv_b_proj.weight", kv_lora_rank, heads * (nope + v_dim));
  o_proj.init(prefix + "o_proj.weight", heads * v_dim, hidden);
  softmax_scale = static_cast<float>(mla_softmax_scale(cfg));
  // Empty until the first forward: a full 160K-position YaRN table is tens of MB per layer.
  rope_ = std::make_shared<RopeTable>(cfg, 0);
}

void MLAttention::collect(ParamList& out) {
  if (q_lora_rank > 0) {
    q_a_proj.collect(out);
    q_a_layernorm.collect(out);
    q_b_proj.collect(out);
  } else {
    q_proj.collect(out);
  }
  out.push_back(&kv_a_proj);
  kv_a_layernorm.collect(out);
  kv_b_proj.collect(out);
  o_proj.collect(out);
}

// ---------------------------------------------------------------- query path

Tensor MLAttention::query(const Tensor& x, const Tensor& positions, Pass pass,
                          SaveInput save_input) {
  const Pass first = save_input == SaveInput::Yes ? pass : Pass::Eval;
  Tensor q;
  if (q_lora_rank > 0) {
    Tensor a = q_a_proj.forward(x, first);
    q = q_b_proj.forward(q_a_layernorm.forward(a, pass), pass);
  } else {
    q = q_proj.forward(x, first);
  }
  // In place is safe: the q linear saved its input, not this output.
  rope_forward(*rope_, q.f32() + nope, x.dim(0), heads, heads * qk_dim(), qk_dim(),
               positions.i32());
  return q;
}

Tensor MLAttention::query_backward(const Tensor& dq, const Tensor& x) {
  rope_backward(*rope_, dq.f32() + nope, dq.dim(0), heads, heads * qk_dim(), qk_dim(),
                saved_positions_.i32());
  if (q_lora_rank > 0)
    return q_a_proj.backward(q_a_layernorm.backward(q_b_proj.backward(dq)), x);
  return q_proj.backward(dq, x);
}

// ---------------------------------------------------------------- latent KV

// kv_a_proj_with_mqa as two GEMMs on its row blocks, so c_kv and k_pe come out as separate
// contiguous tensors: the norm needs c_kv contiguous and the KV cache stores them apart.
void MLAttention::latent_kv(const Tensor& x, const Tensor& positions, Tensor& c_kv,
                            Tensor& k_pe) const {
  const int64_t T = x.dim(0);
  const float* w = kv_a_proj.w();
  c_kv = activation({T, kv_lora_rank});
  k_pe = activation({T, rope_dim});
  gemm_nt(T, kv_lora_rank, hidden, x.f32(), hidden, w, hidden, c_kv.f32(), kv_lora_rank, false);
  gemm_nt(T, rope_dim, hidden, x.f32(), hidden, w + kv_lora_rank * hidden, hidden, k_pe.f32(),
          rope_dim, false);
  if (kv_a_lora) {
    const Tensor xs = kv_a_lora->project(x);
    kv_a_lora->expand_add(xs, 0, kv_lora_rank, c_kv.f32(), kv_lora_rank);
    kv_a_lora->expand_add(xs, kv_lora_rank, rope_dim, k_pe.f32(), rope_dim);
  }
  rope_forward(*rope_, k_pe.f32(), T, 1, rope_dim, 0, positions.i32());
}

// ---------------------------------------------------------------- attention core

namespace {

// Scores of query rows [r0, r0 + M) of one (b, h) against keys [0, N), into sc (ld S):
// scale · (q_nope·k_nopeᵀ + q_pe·k_peᵀ), each score one chain of multiply-adds over the whole
// head (the nope dims, then the rope dims), then scaled. With k_cat (training) the head's keys
// are one [S, nope + rope] matrix and the chain is one GEMM; without it (cached inference) the
// rope GEMM continues the nope GEMM's chains in C. Same chain, same bits, so a cached forward
// equals the training forward and the backward's recomputed scores equal the forward's.
struct ScoreArgs {
  const float* qrows;  // first query row of the block, head h
  const float* k_nope;
  const float* k_rot;
  int64_t ldq, ldkv, dn, dr, S;
  float scale;
  const float* k_cat = nullptr;  // [S, dn + dr]: k_nope | k_rot of this head
};

void block_scores(const ScoreArgs& a, int64_t M, int64_t N, float* sc) {
  if (a.k_cat) {
    gemm_nt_serial(M, N, a.dn + a.dr, a.qrows, a.ldq, a.k_cat, a.dn + a.dr, sc, a.S, false);
  } else {
    gemm_nt_serial(M, N, a.dn, a.qrows, a.ldq, a.k_nope, a.ldkv, sc, a.S, /*accumulate=*/false);
    gemm_nt_serial(M, N, a.dr, a.qrows + a.dn, a.ldq, a.k_rot, a.dr, sc, a.S, /*accumulate=*/true);
  }
  for (int64_t i = 0; i < M; ++i) scale_row(sc + i * a.S, N, a.scale);
}

// Every head's keys as one matrix, [B, H, S, nope + rope] = k_nope | k_pe: the scores, dQ and dK
// then take one GEMM each per block instead of a nope and a rope GEMM. The rope GEMMs were 16
// wide or deep: each packed its operand again for a sixteenth of the work, at about a quarter
// of the FMA peak.
Tensor concat_keys(const float* kv, int64_t ldkv, const float* k_pe, int64_t B, int64_t S,
                   int64_t H, int64_t dn, int64_t dr, int64_t dv) {
  const int64_t dk = dn + dr;
  Tensor k_cat = activation({B, H, S, dk});
  float* out = k_cat.f32();
  parallel_for(0, B * S, [&](int64_t t) {
    const int64_t b = t / S, s = t % S;
    for (int64_t h = 0; h < H; ++h) {
      float* row = out + ((b * H + h) * S + s) * dk;
      std::copy_n(kv + t * ldkv + h * (dn + dv), dn, row);
      std::copy_n(k_pe + t * dr, dr, row + dn);
    }
  });
  return k_cat;
}

// Causal attention of M query rows, the first at position pos0: row i sees keys [0, pos0 + i].
// Scores into sc (ld a.S), softmax, then out (ld ldo) = P·v over the N = pos0 + M keys. With
// `stats`, each row's max and 1/Σexp(s − max) go to stats[2i], stats[2i + 1]: training's
// backward rebuilds P from them. Masked keys inside [0, N) take part in the P·v GEMM with
// weight 0, which leaves every sum unchanged.
void attend_rows(const ScoreArgs& a, const float* v, int64_t ldv, int64_t dv, int64_t M,
                 int64_t pos0, float* sc, float* out, int64_t ldo, float* stats) {
  const int64_t N = pos0 + M;
  block_scores(a, M, N, sc);
  for (int64_t i = 0; i < M; ++i) {
    float* row = sc + i * a.S;
    const int64_t valid = pos0 + i + 1;
    // softmax_inplace spelled out, to keep the two numbers backward replays it with.
    const float mx = row_max(row, valid);
    const float inv = static_cast<float>(1.0 / exp_shift_sum(row, valid, mx));
    scale_row(row, valid, inv);
    if (stats) {
      stats[2 * i] = mx;
      stats[2 * i + 1] = inv;
    }
    std::fill(row + valid, row + N, 0.0f);
  }
  gemm_nn_serial(M, dv, N, sc, a.S, v, ldv, out, ldo, false);
}

}  // namespace

// out[b*S+s, h*v:(h+1)*v] = softmax_causal(scale * q_bh · k_bhᵀ) · v_bh, with k = [k_nope, k_pe].
// When `stats` is defined (training) each row's max and 1/Σexp are written there: backward
// rebuilds the block's P from them instead of having it saved.
void MLAttention::attention_core(const Tensor& q, const Tensor& kv, const Tensor& k_pe,
                                 const Tensor& out, const Tensor& stats,
                                 const BatchShape& shape) const {
  const int64_t B = shape.batch, S = shape.seq, H = heads;
  const int64_t ldq = H * qk_dim(), ldkv = H * (nope + v_dim), ldo = H * v_dim;
  const int64_t nblk = (S + kBlock - 1) / kBlock;
  const float* qp = q.f32();
  const float* kvp = kv.f32();
  const float* kpe = k_pe.f32();
  float* op = out.f32();
  float* st = stats.defined() ? stats.f32() : nullptr;
  const ThreadSlabs slabs(std::min(kBlock, S) * S);
  const float scale = softmax_scale;
  const int64_t dn = nope, dr = rope_dim, dv = v_dim;
  const Tensor k_cat = concat_keys(kvp, ldkv, kpe, B, S, H, dn, dr, dv);
  const float* kcp = k_cat.f32();

  // Rows of one block are independent of every other block in the forward, so (b, h, block)
  // are all separate tasks; the longest blocks go first to even out the dynamic schedule.
  parallel_for_dynamic(0, B * H * nblk, [&](int64_t task) {
    const int64_t bh = task / nblk, blk = nblk - 1 - task % nblk;
    const int64_t b = bh / H, h = bh % H;
    const int64_t r0 = blk * kBlock, M = std::min(S, r0 + kBlock) - r0;
    const float* v = kvp + b * S * ldkv + h * (dn + dv) + dn;
    attend_rows({qp + (b * S + r0) * ldq + h * qk_dim(), nullptr, nullptr, ldq, ldkv, dn, dr, S,
                 scale, kcp + bh * S * (dn + dr)},
                v, ldkv, dv, M, r0, slabs.mine(), op + (b * S + r0) * ldo + h * dv, ldo,
                st ? st + 2 * (bh * S + r0) : nullptr);
  });
}

// ---------------------------------------------------------------- forward

Tensor MLAttention::forward(const Tensor& x, const BatchShape& shape, Pass pass,
                            SaveInput save_input) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == hidden && x.dim(0) == shape.tokens(),
            "{}: expected input [{} x {}, {}], got {}", o_proj.weight.name, shape.batch,
            shape.seq, hidden, shape_str(x.shape()));
  const int64_t T = x.dim(0), B = shape.batch, S = shape.seq;
  const bool train = needs_backward(pass);
  rope_->ensure(S);
  Tensor positions = sequence_positions(B, S);

  Tensor q = query(x, positions, pass, save_input);

  Tensor c_kv, k_pe;
  latent_kv(x, positions, c_kv, k_pe);
  // kv_b_proj keeps nothing: backward rebuilds its input from the norm's saved c_kv (see the
  // header), and kv from that.
  Tensor kv = kv_b_proj.forward(kv_a_layernorm.forward(c_kv, pass), Pass::Eval);
  c_kv.reset();

  Tensor out = activation({T, heads * v_dim});
  // Training keeps two floats per query row and head instead of P [B, H, S, S].
  Tensor stats = train ? activation({B, heads, S, 2}) : Tensor();
  attention_core(q, kv, k_pe, out, stats, shape);

  if (train) {
    saved_shape_ = shape;
    if (save_input == SaveInput::Yes) saved_x_ = x;
    saved_positions_ = positions;
    saved_q_ = q;
    saved_k_pe_ = k_pe;
    saved_stats_ = stats;
  }
  return o_proj.forward(out, pass);
}

// ---------------------------------------------------------------- cached inference

bool MLAttention::absorbed_for(int64_t count, int64_t past) const {
  // Multiply-adds per head (the causal halving applies to both alike):
  //   absorbed: c·r·(nope + v) to fold W_kv_b in and out, c·L·(2r + rope) over the latents;
  //   expanded: L·r·(nope + v) to rebuild k_nope and v, c·L·(nope + rope + v) attention.
  const int64_t c = count, L = past + count, r = kv_lora_rank;
  const int64_t absorbed = c * r * (nope + v_dim) + c * L * (2 * r + rope_dim);
  const int64_t expanded = L * r * (nope + v_dim) + c * L * (nope + rope_dim + v_dim);
  return absorbed <= expanded;
}

Tensor MLAttention::forward_cached(const Tensor& x, std::span<const CachedChunk> chunks,
                                   const LatentCacheLayer& cache) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == hidden, "{}: expected input [T, {}], got {}",
            o_proj.weight.name, hidden, shape_str(x.shape()));
  const int64_t T = x.dim(0);
  std::vector<int64_t> rows0;
  int64_t rows = 0, max_pos = 0;
  for (const CachedChunk& c : chunks) {
    MOE_CHECK(c.count >= 0 && c.past >= 0 && c.past + c.count <= cache.max_len,
              "{}: cached chunk at {} + {} tokens exceeds the cache's {} positions",
              o_proj.weight.name, c.past, c.count, cache.max_len);
    rows0.push_back(rows);
    rows += c.count;
    max_pos = std::max(max_pos, c.past + c.count);
  }
  MOE_CHECK(rows == T, "{}: the chunks hold {} tokens but the input has {} rows",
            o_proj.weight.name, rows, T);
  if (T == 0) return activation({0, hidden});
  rope_->ensure(max_pos);
  Tensor positions = Tensor::empty({T}, DType::I32, MemCategory::Activations);
  for (size_t i = 0; i < chunks.size(); ++i)
    for (int64_t j = 0; j < chunks[i].count; ++j)
      positions.i32()[rows0[i] + j] = static_cast<int32_t>(chunks[i].past + j);

  Tensor q = query(x, positions, Pass::Inference, SaveInput::Yes);
  Tensor c_kv, k_pe;
  latent_kv(x, positions, c_kv, k_pe);
  const Tensor c_norm = kv_a_layernorm.forward(c_kv, Pass::Inference);
  c_kv.reset();
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CachedChunk& c = chunks[i];
    const int64_t at = c.slot * cache.max_len + c.past;
    std::copy_n(c_norm.f32() + rows0[i] * kv_lora_rank, c.count * kv_lora_rank,
                cache.latent + at * kv_lora_rank);
    std::copy_n(k_pe.f32() + rows0[i] * rope_dim, c.count * rope_dim, cache.k_rope + at * rope_dim);
  }

  Tensor out = activation({T, heads * v_dim});
  std::vector<CachedChunk> absorbed;
  std::vector<int64_t> absorbed_rows0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].count == 0) continue;
    if (absorbed_for(chunks[i].count, chunks[i].past)) {
      absorbed.push_back(chunks[i]);
      absorbed_rows0.push_back(rows0[i]);
    } else {
      cached_expanded(q, chunks[i], rows0[i], cache, out);
    }
  }
  if (!absorbed.empty()) cached_absorbed(q, absorbed, absorbed_rows0, cache, out);
  return o_proj.forward(out, Pass::Inference);
}

void MLAttention::cached_expanded(const Tensor& q, const CachedChunk& chunk, int64_t row0,
                                  const LatentCacheLayer& cache, const Tensor& out) {
  const int64_t H = heads, c = chunk.count, L = chunk.past + chunk.count;
  const int64_t ldq = H * qk_dim(), ldkv = H * (nope + v_dim), ldo = H * v_dim;
  const int64_t at = chunk.slot * cache.max_len;
  // kv_b_proj over the whole prefix (its LoRA adapter included), from the cached latents.
  Tensor latent = activation({L, kv_lora_rank});
  std::copy_n(cache.latent + at * kv_lora_rank, L * kv_lora_rank, latent.f32());
  const Tensor kv = kv_b_proj.forward(latent, Pass::Inference);
  latent.reset();
  const float* kpe = cache.k_rope + at * rope_dim;
  const int64_t nblk = (c + kBlock - 1) / kBlock;
  const ThreadSlabs slabs(std::min(kBlock, c) * L);
  const float* qp = q.f32() + row0 * ldq;
  float* op = out.f32() + row0 * ldo;
  const float* kvp = kv.f32();
  parallel_for_dynamic(0, H * nblk, [&](int64_t task) {
    const int64_t h = task / nblk, blk = nblk - 1 - task % nblk;
    const int64_t r0 = blk * kBlock, M = std::min(c, r0 + kBlock) - r0;
    const float* k_nope = kvp + h * (nope + v_dim);
    attend_rows({qp + r0 * ldq + h * qk_dim(), k_nope, kpe, ldq, ldkv, nope, rope_dim, L,
                 softmax_scale},
                k_nope + nope, ldkv, v_dim, M, chunk.past + r0, slabs.mine(),
                op + r0 * ldo + h * v_dim, ldo, nullptr);
  });
}

void MLAttention::cached_absorbed(const Tensor& q, std::span<const CachedChunk> chunks,
                                  std::span<const int64_t> rows0, const LatentCacheLayer& cache,
                                  const Tensor& out) const {
  const int64_t H = heads, r = kv_lora_rank, dr = rope_dim, dv = v_dim;
  const int64_t ldq = H * qk_dim(), ldo = H * dv, lda = r + dr;
  // Scratch for the longest sequence rounded up to 256 positions: its size changes once every
  // 256 decode steps, where a size growing by one position per step would creep through the
  // heap, and it does not grow with the cache's length.
  int64_t max_c = 0, longest = 0;
  for (const CachedChunk& c : chunks) {
    max_c = std::max(max_c, c.count);
    longest = std::max(longest, c.past + c.count);
  }
  const int64_t max_l = std::min(cache.max_len, (longest + 255) / 256 * 256);
  // kv_b_proj's rows for head h: [nope rows producing k_nope | v rows producing v], each r wide.
  const float* wkv = kv_b_proj.weight.w();
  const LoraAdapter* lora = kv_b_proj.lora.get();
  const int64_t rank = lora ? lora->shape().rank : 0;
  // Per thread: the absorbed query [c, r + rope], the scores [c, L], the latent output [c, r]
  // and the adapter's [c, rank] intermediate.
  const int64_t each = max_c * lda + max_c * max_l + max_c * r + max_c * rank;
  const ThreadSlabs slabs(each);
  const int64_t n = static_cast<int64_t>(chunks.size());
  parallel_for_dynamic(0, n * H, [&](int64_t task) {
    const CachedChunk& ch = chunks[static_cast<size_t>(task / H)];
    const int64_t h = task % H, c = ch.count, L = ch.past + c;
    const int64_t row0 = rows0[static_cast<size_t>(task / H)];
    float* qa = slabs.mine();
    float* sc = qa + max_c * lda;
    float* o_lat = sc + max_c * max_l;
    float* t = o_lat + max_c * r;
    const float* q_nope = q.f32() + row0 * ldq + h * qk_dim();
    const float* w_k = wkv + h * (nope + dv) * r;  // [nope, r]
    const float* w_v = w_k + nope * r;              // [dv, r]
    // q_lat = q_nope·W_k (+ s·(q_nope·B_k)·A), then the rotated part beside it.
    gemm_nn_serial(c, r, nope, q_nope, ldq, w_k, r, qa, lda, false);
    if (lora) {
      const float* b_k = lora->B.w() + h * (nope + dv) * rank;  // [nope, rank]
      gemm_nn_serial(c, rank, nope, q_nope, ldq, b_k, rank, t, rank, false);
      scale_row(t, c * rank, lora->shape().scale);
      gemm_nn_serial(c, r, rank, t, rank, lora->A.w(), r, qa, lda, true);
    }
    for (int64_t i = 0; i < c; ++i) std::copy_n(q_nope + i * ldq + nope, dr, qa + i * lda + r);
    const int64_t at = ch.slot * cache.max_len;
    const float* latent = cache.latent + at * r;
    attend_rows({qa, latent, cache.k_rope + at * dr, lda, r, r, dr, L, softmax_scale}, latent, r,
                r, c, ch.past, sc, o_lat, r, nullptr);
    // out_h = o_lat·W_vᵀ (+ s·(o_lat·Aᵀ)·B_vᵀ).
    float* o = out.f32() + row0 * ldo + h * dv;
    gemm_nt_serial(c, dv, r, o_lat, r, w_v, r, o, ldo, false);
    if (lora) {
      gemm_nt_serial(c, rank, r, o_lat, r, lora->A.w(), r, t, rank, false);
      scale_row(t, c * rank, lora->shape().scale);
      const float* b_v = lora->B.w() + (h * (nope + dv) + nope) * rank;  // [dv, rank]
      gemm_nt_serial(c, dv, rank, t, rank, b_v, rank, o, ldo, true);
    }
  });
}

// ---------------------------------------------------------------- backward

Tensor MLAttention::backward(const Tensor& dy) {
  MOE_CHECK(has_saved(), "{}: backward without a training forward", o_proj.weight.name);
  MOE_CHECK(saved_x_.defined(), "{}: the forward did not save its input: call backward(dy, x)",
            o_proj.weight.name);
  Tensor x = std::move(saved_x_);
  return backward(dy, x);
}

Tensor MLAttention::backward(const Tensor& dy, const Tensor& x_in) {
  MOE_CHECK(has_saved(), "{}: backward without a training forward", o_proj.weight.name);
  MOE_CHECK(x_in.ndim() == 2 && x_in.dim(0) == saved_shape_.tokens() && x_in.dim(1) == hidden,
            "{}: backward input must be [{}, {}], got {}", o_proj.weight.name,
            saved_shape_.tokens(), hidden, shape_str(x_in.shape()));
  const BatchShape shape = saved_shape_;
  const int64_t T = shape.tokens(), B = shape.batch, S = shape.seq, H = heads;
  const int64_t dn = nope, dr = rope_dim, dv = v_dim;
  const int64_t ldq = H * qk_dim(), ldkv = H * (dn + dv), ldo = H * dv;
  const int64_t nblk = (S + kBlock - 1) / kBlock;

  Tensor d_out = o_proj.backward(dy);  // [T, H*v]
  Tensor q = std::move(saved_q_);
  Tensor c_kv_normed = kv_a_layernorm.recompute_output();
  Tensor kv = kv_b_proj.forward(c_kv_normed, Pass::Eval);
  Tensor dq = activation({T, ldq});  // every element written once per block row
  // dV gathers contributions from every later query block: accumulated from zero. (dK does too,
  // per head in dk_heads below, and is copied into its columns here once complete.)
  Tensor dkv = Tensor::zeros({T, ldkv}, DType::F32, MemCategory::Activations);
  Tensor dk_pe = activation({T, dr});
  {
    const int64_t dk = dn + dr;
    const Tensor k_cat = concat_keys(kv.f32(), ldkv, saved_k_pe_.f32(), B, S, H, dn, dr, dv);
    // Each (b, h) task accumulates its head's dK = dK_nope | dK_pe [S, nope + rope] here from
    // zero; the task then moves dK_nope into dkv, and since k_pe is shared by all heads, the
    // heads' dK_pe are summed in order afterwards (same bits for any thread count).
    Tensor dk_heads = Tensor::zeros({B, H, S, dk}, DType::F32, MemCategory::Activations);
    const float* qp = q.f32();
    const float* kvp = kv.f32();
    const float* kcp = k_cat.f32();
    const float* st = saved_stats_.f32();
    const float* dop = d_out.f32();
    float* dqp = dq.f32();
    float* dkvp = dkv.f32();
    float* dkh = dk_heads.f32();
    const int64_t slab = std::min(kBlock, S) * S;
    const ThreadSlabs slabs(2 * slab);  // P (then dS) and dP of one block
    const float scale = softmax_scale;
    // Blocks of one (b, h) accumulate into the same dK/dV rows, so they run in order in one task.
    // Tasks are taken dynamically: with the work split in halves, one thread waited about 190 µs
    // per layer for the other (a `small` step on a Zen 5).
    parallel_for_dynamic(0, B * H, [&](int64_t bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* v = kvp + b * S * ldkv + h * (dn + dv) + dn;
      const float* keys = kcp + bh * S * dk;
      float* dk_nope = dkvp + b * S * ldkv + h * (dn + dv);
      float* dvp = dk_nope + dn;
      float* dkeys = dkh + bh * S * dk;
      float* P = slabs.mine();
      float* dP = P + slab;
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t r0 = blk * kBlock, r1 = std::min(S, r0 + kBlock), M = r1 - r0, N = r1;
        const float* dO = dop + (b * S + r0) * ldo + h * dv;
        const float* qrows = qp + (b * S + r0) * ldq + h * qk_dim();
        float* dqrows = dqp + (b * S + r0) * ldq + h * qk_dim();
        // P again, exactly as the forward made it: same score GEMMs, then exp(s − max)·inv.
        block_scores({qrows, nullptr, nullptr, ldq, ldkv, dn, dr, S, scale, keys}, M, N, P);
        for (int64_t i = 0; i < M; ++i) {
          float* row = P + i * S;
          const int64_t valid = r0 + i + 1;
          const float* rs = st + 2 * (bh * S + r0 + i);
          exp_shift_sum(row, valid, rs[0]);
          scale_row(row, valid, rs[1]);
          std::fill(row + valid, row + N, 0.0f);
        }
        // dV[0:N] += Pᵀ·dO and dP = dO·Vᵀ.
        gemm_tn_serial(N, dv, M, P, S, dO, ldo, dvp, ldkv, /*accumulate=*/true);
        gemm_nt_serial(M, N, dv, dO, ldo, v, ldkv, dP, S, /*accumulate=*/false);
        // Softmax backward, dS = P ⊙ (dP − rowsum(dP ⊙ P)), times the score scale; written
        // over P. Masked entries stay 0 because P is 0 there.
        for (int64_t i = 0; i < M; ++i)
          softmax_backward_row(P + i * S, dP + i * S, r0 + i + 1, scale);
        // dQ = dS·K for this block's rows; dK[0:N] += dSᵀ·Q.
        gemm_nn_serial(M, dk, N, P, S, keys, dk, dqrows, ldq, false);
        gemm_tn_serial(N, dk, M, P, S, qrows, ldq, dkeys, dk, true);
      }
      for (int64_t s = 0; s < S; ++s) std::copy_n(dkeys + s * dk, dn, dk_nope + s * ldkv);
    });

    float* dkpe = dk_pe.f32();
    parallel_for(0, T, [&](int64_t t) {
      const int64_t b = t / S, s = t % S;
      float* out = dkpe + t * dr;
      const float* src = dkh + (b * H * S + s) * dk + dn;
      std::copy(src, src + dr, out);
      for (int64_t h = 1; h < H; ++h)
        for (int64_t i = 0; i < dr; ++i) out[i] += src[h * S * dk + i];
    });
  }
  saved_stats_.reset();
  saved_k_pe_.reset();
  q.reset();
  kv.reset();
  d_out.reset();
  rope_backward(*rope_, dk_pe.f32(), T, 1, dr, 0, saved_positions_.i32());

  Tensor dc_kv = kv_a_layernorm.backward(kv_b_proj.backward(dkv, c_kv_normed));
  c_kv_normed.reset();
  dkv.reset();
  Tensor dx = query_backward(dq, x_in);
  dq.reset();

  // kv_a_proj_with_mqa: dx += [dc_kv | dk_pe]·W, dW += [dc_kv | dk_pe]ᵀ·x, per row block of W.
  const float* w = kv_a_proj.w();
  const int64_t D = hidden;
  gemm_nn(T, D, kv_lora_rank, dc_kv.f32(), kv_lora_rank, w, D, dx.f32(), D, true);
  gemm_nn(T, D, dr, dk_pe.f32(), dr, w + kv_lora_rank * D, D, dx.f32(), D, true);
  if (kv_a_lora) {
    Tensor g = activation({T, kv_a_lora->shape().rank});
    kv_a_lora->grad_input_block(dc_kv.f32(), kv_lora_rank, 0, kv_lora_rank, g, /*first=*/true);
    kv_a_lora->grad_input_block(dk_pe.f32(), dr, kv_lora_rank, dr, g, /*first=*/false);
    kv_a_lora->grad_input_finish(g, dx.f32(), D);
    const Tensor xs = kv_a_lora->project(x_in);
    kv_a_lora->grad_weights_block(xs, dc_kv.f32(), kv_lora_rank, 0, kv_lora_rank);
    kv_a_lora->grad_weights_block(xs, dk_pe.f32(), dr, kv_lora_rank, dr);
    kv_a_lora->grad_weights_input_side(x_in, g);
  }
  if (kv_a_proj.grad.defined()) {
    const float* x = x_in.f32();
    float* g = kv_a_proj.g();
    gemm_tn(kv_lora_rank, D, T, dc_kv.f32(), kv_lora_rank, x, D, g, D, true);
    gemm_tn(dr, D, T, dk_pe.f32(), dr, x, D, g + kv_lora_rank * D, D, true);
  }
  saved_x_.reset();
  saved_positions_.reset();
  return dx;
}

}  // namespace moe
