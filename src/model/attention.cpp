#include "model/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

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
// the GEMMs stay large enough for BLAS to run at speed.
constexpr int64_t kBlock = 64;

// One [rows, ld]-strided scratch slab per OpenMP thread, so blocks reuse memory across tasks.
class ThreadSlabs {
 public:
  explicit ThreadSlabs(int64_t floats_each)
      : each_(floats_each),
        buf_(Tensor::empty({omp_get_max_threads() * floats_each}, DType::F32,
                           MemCategory::Scratch)) {}
  float* mine() const { return buf_.f32() + omp_get_thread_num() * each_; }

 private:
  int64_t each_;
  Tensor buf_;
};

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

Tensor MLAttention::query(const Tensor& x, const Tensor& positions, Pass pass) {
  Tensor q;
  if (q_lora_rank > 0) {
    Tensor a = q_a_proj.forward(x, pass);
    q = q_b_proj.forward(q_a_layernorm.forward(a, pass), pass);
  } else {
    q = q_proj.forward(x, pass);
  }
  // In place is safe: the q linear saved its input, not this output.
  rope_forward(*rope_, q.f32() + nope, x.dim(0), heads, heads * qk_dim(), qk_dim(),
               positions.i32());
  return q;
}

Tensor MLAttention::query_backward(const Tensor& dq) {
  rope_backward(*rope_, dq.f32() + nope, dq.dim(0), heads, heads * qk_dim(), qk_dim(),
                saved_positions_.i32());
  if (q_lora_rank > 0) return q_a_proj.backward(q_a_layernorm.backward(q_b_proj.backward(dq)));
  return q_proj.backward(dq);
}

// ---------------------------------------------------------------- attention core

// out[b*S+s, h*v:(h+1)*v] = softmax_causal(scale * q_bh · k_bhᵀ) · v_bh, with k = [k_nope, k_pe]
// handled as two accumulating GEMMs straight from the projection buffers (no concatenation).
// When `probs` is defined (training) the probabilities are written there for backward.
void MLAttention::attention_core(const Tensor& q, const Tensor& kv, const Tensor& k_pe,
                                 const Tensor& out, const Tensor& probs,
                                 const BatchShape& shape) const {
  const int64_t B = shape.batch, S = shape.seq, H = heads;
  const int64_t ldq = H * qk_dim(), ldkv = H * (nope + v_dim), ldo = H * v_dim;
  const int64_t nblk = (S + kBlock - 1) / kBlock;
  const float* qp = q.f32();
  const float* kvp = kv.f32();
  const float* kpe = k_pe.f32();
  float* op = out.f32();
  float* pp = probs.defined() ? probs.f32() : nullptr;
  const ThreadSlabs slabs(pp ? 0 : std::min(kBlock, S) * S);
  const float scale = softmax_scale;
  const int64_t dn = nope, dr = rope_dim, dv = v_dim;

  // Rows of one block are independent of every other block in the forward, so (b, h, block)
  // are all separate tasks; the longest blocks go first to even out the dynamic schedule.
  parallel_for_dynamic(0, B * H * nblk, [&](int64_t task) {
    const int64_t bh = task / nblk, blk = nblk - 1 - task % nblk;
    const int64_t b = bh / H, h = bh % H;
    const int64_t r0 = blk * kBlock, r1 = std::min(S, r0 + kBlock), M = r1 - r0, N = r1;
    float* sc = pp ? pp + (bh * S + r0) * S : slabs.mine();
    const float* qrows = qp + (b * S + r0) * ldq + h * qk_dim();
    const float* k_nope = kvp + b * S * ldkv + h * (dn + dv);
    const float* v = k_nope + dn;
    gemm_nt_serial(M, N, dn, qrows, ldq, k_nope, ldkv, sc, S, /*accumulate=*/false, scale);
    gemm_nt_serial(M, N, dr, qrows + dn, ldq, kpe + b * S * dr, dr, sc, S, /*accumulate=*/true, scale);
    for (int64_t i = 0; i < M; ++i) {
      float* row = sc + i * S;
      const int64_t valid = r0 + i + 1;  // keys 0..r0+i are visible
      softmax_inplace(row, valid);
      // Masked keys inside the block's [0, r1) window take part in the P·v GEMM and backward.
      std::fill(row + valid, row + N, 0.0f);
    }
    gemm_nn_serial(M, dv, N, sc, S, v, ldkv, op + (b * S + r0) * ldo + h * dv, ldo, false);
  });
}

// ---------------------------------------------------------------- forward

Tensor MLAttention::forward(const Tensor& x, const BatchShape& shape, Pass pass) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == hidden && x.dim(0) == shape.tokens(),
            "{}: expected input [{} x {}, {}], got {}", o_proj.weight.name, shape.batch,
            shape.seq, hidden, shape_str(x.shape()));
  const int64_t T = x.dim(0), B = shape.batch, S = shape.seq;
  const bool train = needs_backward(pass);
  rope_->ensure(S);
  Tensor positions = sequence_positions(B, S);

  Tensor q = query(x, positions, pass);

  // kv_a_proj_with_mqa as two GEMMs on its row blocks, so c_kv and k_pe come out as separate
  // contiguous tensors: the norm needs c_kv contiguous and the KV cache stores them apart.
  const float* w = kv_a_proj.w();
  Tensor c_kv = activation({T, kv_lora_rank});
  Tensor k_pe = activation({T, rope_dim});
  gemm_nt(T, kv_lora_rank, hidden, x.f32(), hidden, w, hidden, c_kv.f32(), kv_lora_rank, false);
  gemm_nt(T, rope_dim, hidden, x.f32(), hidden, w + kv_lora_rank * hidden, hidden, k_pe.f32(),
          rope_dim, false);
  rope_forward(*rope_, k_pe.f32(), T, 1, rope_dim, 0, positions.i32());
  Tensor kv = kv_b_proj.forward(kv_a_layernorm.forward(c_kv, pass), pass);

  Tensor out = activation({T, heads * v_dim});
  // Training keeps P [B, H, S, S]: H*S floats per token, more than everything else this layer
  // saves (~85K floats per token for V3 shapes) once S > ~660. A flash-style backward would keep
  // only the per-row log-sum-exp [B, H, S] and recompute q·kᵀ block by block (one more GEMM of
  // the six), saving H*(S-1) floats per token.
  Tensor probs = train ? activation({B, heads, S, S}) : Tensor();
  attention_core(q, kv, k_pe, out, probs, shape);

  if (train) {
    saved_shape_ = shape;
    saved_x_ = x;
    saved_positions_ = positions;
    saved_q_ = q;
    saved_kv_ = kv;
    saved_k_pe_ = k_pe;
    saved_p_ = probs;
  }
  return o_proj.forward(out, pass);
}

// ---------------------------------------------------------------- backward

Tensor MLAttention::backward(const Tensor& dy) {
  MOE_CHECK(has_saved(), "{}: backward without a training forward", o_proj.weight.name);
  const BatchShape shape = saved_shape_;
  const int64_t T = shape.tokens(), B = shape.batch, S = shape.seq, H = heads;
  const int64_t dn = nope, dr = rope_dim, dv = v_dim;
  const int64_t ldq = H * qk_dim(), ldkv = H * (dn + dv), ldo = H * dv;
  const int64_t nblk = (S + kBlock - 1) / kBlock;

  Tensor d_out = o_proj.backward(dy);  // [T, H*v]
  Tensor dq = activation({T, ldq});    // every element written once per block row
  // dK and dV gather contributions from every later query block: accumulated from zero.
  Tensor dkv = Tensor::zeros({T, ldkv}, DType::F32, MemCategory::Activations);
  Tensor dk_pe = activation({T, dr});
  {
    const float* qp = saved_q_.f32();
    const float* kvp = saved_kv_.f32();
    const float* kpe = saved_k_pe_.f32();
    const float* dop = d_out.f32();
    float* pp = saved_p_.f32();
    float* dqp = dq.f32();
    float* dkvp = dkv.f32();
    const ThreadSlabs slabs(std::min(kBlock, S) * S);
    const float scale = softmax_scale;
    // Blocks of one (b, h) accumulate into the same dK/dV rows, so they run in order in one task.
    parallel_for(0, B * H, [&](int64_t bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* k_nope = kvp + b * S * ldkv + h * (dn + dv);
      const float* v = k_nope + dn;
      const float* k_rot = kpe + b * S * dr;
      float* dk_nope = dkvp + b * S * ldkv + h * (dn + dv);
      float* dvp = dk_nope + dn;
      float* dP = slabs.mine();
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t r0 = blk * kBlock, r1 = std::min(S, r0 + kBlock), M = r1 - r0, N = r1;
        float* P = pp + (bh * S + r0) * S;
        const float* dO = dop + (b * S + r0) * ldo + h * dv;
        const float* qrows = qp + (b * S + r0) * ldq + h * qk_dim();
        float* dqrows = dqp + (b * S + r0) * ldq + h * qk_dim();
        // dV[0:N] += Pᵀ·dO and dP = dO·Vᵀ.
        gemm_tn_serial(N, dv, M, P, S, dO, ldo, dvp, ldkv, /*accumulate=*/true);
        gemm_nt_serial(M, N, dv, dO, ldo, v, ldkv, dP, S, /*accumulate=*/false);
        // Softmax backward, dS = P ⊙ (dP − rowsum(dP ⊙ P)), times the score scale; written
        // over P, which is not needed again. Masked entries stay 0 because P is 0 there.
        for (int64_t i = 0; i < M; ++i) {
          float* p = P + i * S;
          const float* dp = dP + i * S;
          const int64_t valid = r0 + i + 1;
          double dot = 0;
          for (int64_t j = 0; j < valid; ++j) dot += static_cast<double>(p[j]) * dp[j];
          const float d = static_cast<float>(dot);
          for (int64_t j = 0; j < valid; ++j) p[j] = scale * (p[j] * (dp[j] - d));
        }
        // dQ = dS·K for this block's rows; dK_nope[0:N] += dSᵀ·Q_nope (dK_pe: below).
        gemm_nn_serial(M, dn, N, P, S, k_nope, ldkv, dqrows, ldq, false);
        gemm_nn_serial(M, dr, N, P, S, k_rot, dr, dqrows + dn, ldq, false);
        gemm_tn_serial(N, dn, M, P, S, qrows, ldq, dk_nope, ldkv, true);
      }
    });

    // k_pe is shared by all heads: dK_pe[keys] = Σ_h dS_hᵀ·Q_pe_h. Tasks own a block of key rows
    // and add heads in order (no per-head partial buffer, same bits for any thread count). The
    // query rows >= k0 all have their columns [k0, k1) written (dS, or 0 where masked), so one
    // GEMM per head covers every query block at once.
    float* dkpe = dk_pe.f32();
    parallel_for_dynamic(0, B * nblk, [&](int64_t task) {
      const int64_t b = task / nblk, kb = task % nblk;  // longest first: kb = 0 sees all queries
      const int64_t k0 = kb * kBlock, k1 = std::min(S, k0 + kBlock);
      for (int64_t h = 0; h < H; ++h)
        gemm_tn_serial(k1 - k0, dr, S - k0, pp + ((b * H + h) * S + k0) * S + k0, S,
                qp + (b * S + k0) * ldq + h * qk_dim() + dn, ldq, dkpe + (b * S + k0) * dr, dr,
                /*accumulate=*/h > 0);
    });
  }
  saved_p_.reset();
  saved_q_.reset();
  saved_kv_.reset();
  saved_k_pe_.reset();
  rope_backward(*rope_, dk_pe.f32(), T, 1, dr, 0, saved_positions_.i32());

  Tensor dc_kv = kv_a_layernorm.backward(kv_b_proj.backward(dkv));
  Tensor dx = query_backward(dq);

  // kv_a_proj_with_mqa: dx += [dc_kv | dk_pe]·W, dW += [dc_kv | dk_pe]ᵀ·x, per row block of W.
  const float* w = kv_a_proj.w();
  const int64_t D = hidden;
  gemm_nn(T, D, kv_lora_rank, dc_kv.f32(), kv_lora_rank, w, D, dx.f32(), D, true);
  gemm_nn(T, D, dr, dk_pe.f32(), dr, w + kv_lora_rank * D, D, dx.f32(), D, true);
  if (kv_a_proj.grad.defined()) {
    const float* x = saved_x_.f32();
    float* g = kv_a_proj.g();
    gemm_tn(kv_lora_rank, D, T, dc_kv.f32(), kv_lora_rank, x, D, g, D, true);
    gemm_tn(dr, D, T, dk_pe.f32(), dr, x, D, g + kv_lora_rank * D, D, true);
  }
  saved_x_.reset();
  saved_positions_.reset();
  return dx;
}

}  // namespace moe
