#include "model/v4/compressor.h"

#include <algorithm>

#include "core/thread_slabs.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/activations.h"
#include "kernels/gemm.h"
#include "kernels/quant_sim.h"
#include "kernels/vector_math.h"

namespace moe {

namespace {

Tensor activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemCategory::Activations);
}

// The slots of window w (index wi = b·W + w over all sequences) as offsets into the rows of c/z
// ([B·W·ratio, F], window-major) and into ape ([ratio, F]). CSA lists the previous window's
// tokens first (their first half), then the window's own (their second half), the order of the
// reference's overlap layout; the softmax and the pooled sum run in this slot order.
struct WindowSlots {
  int64_t wi, ratio, F, own_off;
  bool has_prev;
  int64_t count() const { return has_prev ? 2 * ratio : ratio; }
  int64_t row_at(int64_t s) const {  // offset of the slot's features in c/z
    if (has_prev && s < ratio) return ((wi - 1) * ratio + s) * F;
    const int64_t j = has_prev ? s - ratio : s;
    return (wi * ratio + j) * F + own_off;
  }
  int64_t ape_at(int64_t s) const {
    if (has_prev && s < ratio) return s * F;
    const int64_t j = has_prev ? s - ratio : s;
    return j * F + own_off;
  }
};

// One slot of a window: its c and z features (already at the slot's half), its ape row, and
// where its softmax weights go (null: nowhere).
struct PoolSlot {
  const float* c;
  const float* z;
  const float* ape;
  float* weights;
};

// pooled [d] = Σ_s softmax_s(z_s + ape_s)·c_s, a softmax per feature, over slot_at(0..n-1) in
// that order. The training forward and the cached one both pool through here, so an entry has
// the same bits whichever built it. scratch: (n + 2)·d floats.
template <class SlotAt>
void pool_window(const SlotAt& slot_at, int64_t n, int64_t d, float* scratch, float* pooled) {
  float* e = scratch;
  float* mx = e + n * d;
  float* sum = mx + d;
  for (int64_t s = 0; s < n; ++s) {
    const PoolSlot slot = slot_at(s);
    float* es = e + s * d;
    for (int64_t f = 0; f < d; ++f) es[f] = slot.z[f] + slot.ape[f];
  }
  std::copy(e, e + d, mx);
  for (int64_t s = 1; s < n; ++s)
    for (int64_t f = 0; f < d; ++f) mx[f] = std::max(mx[f], e[s * d + f]);
  for (int64_t s = 0; s < n; ++s) {
    float* es = e + s * d;
    for (int64_t f = 0; f < d; ++f) es[f] -= mx[f];
    exp_shift_sum(es, d, 0.0f);  // es = exp(es) (the returned row sum is not needed)
  }
  std::copy(e, e + d, sum);
  for (int64_t s = 1; s < n; ++s)
    for (int64_t f = 0; f < d; ++f) sum[f] += e[s * d + f];
  std::fill(pooled, pooled + d, 0.0f);
  for (int64_t s = 0; s < n; ++s) {
    const PoolSlot slot = slot_at(s);
    const float* es = e + s * d;
    for (int64_t f = 0; f < d; ++f) {
      const float p = es[f] / sum[f];
      if (slot.weights) slot.weights[f] = p;
      pooled[f] += p * slot.c[f];
    }
  }
}

}  // namespace

void V4Compressor::init(const std::string& prefix, const V4CompressorDims& dims) {
  dim = dims.dim;
  head_dim = dims.head_dim;
  rope_dim = dims.rope_dim;
  ratio = dims.ratio;
  MOE_CHECK(dim > 0 && head_dim > 0 && ratio > 0, "{}: compressor needs dim, head_dim and ratio "
            "> 0, got {}, {}, {}", prefix, dim, head_dim, ratio);
  MOE_CHECK(rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= head_dim,
            "{}: rope dims must be even and at most head_dim {}, got {}", prefix, head_dim, rope_dim);
  entry_precision = dims.entry_precision;
  if (entry_precision == SimulatedPrecision::Fp8NonRope)
    MOE_CHECK((head_dim - rope_dim) % kSimFp8Block == 0,
              "{}: simulated FP8 entries need non-RoPE features in whole blocks of {}, got head_dim "
              "{} - rope {}", prefix, kSimFp8Block, head_dim, rope_dim);
  if (entry_precision == SimulatedPrecision::HadamardFp4)
    MOE_CHECK(head_dim % kSimFp4Block == 0 && (head_dim & (head_dim - 1)) == 0,
              "{}: Hadamard-rotated FP4 entries need a power-of-two head_dim >= {}, got {}", prefix,
              kSimFp4Block, head_dim);
  wkv.init(prefix + "wkv.weight", {features(), dim}, /*decay=*/true);
  wgate.init(prefix + "wgate.weight", {features(), dim}, /*decay=*/true);
  // A bias on the gate scores: no weight decay, like the engine's other biases.
  ape.init(prefix + "ape", {ratio, features()}, /*decay=*/false);
  norm.init(prefix + "norm.weight", head_dim, dims.eps);
}

void V4Compressor::collect(ParamList& out) {
  out.push_back(&wkv);
  out.push_back(&wgate);
  out.push_back(&ape);
  norm.collect(out);
}

void V4Compressor::project(const Tensor& x, const BatchShape& shape, float* c, float* z) const {
  const int64_t S = shape.seq, W = windows(S), rows = W * ratio, F = features();
  if (rows == 0) return;
  // Windowed rows of all sequences are contiguous when S is a multiple of ratio: one call.
  const int64_t calls = rows == S ? 1 : shape.batch;
  const int64_t m = rows == S ? shape.batch * S : rows;
  for (int64_t b = 0; b < calls; ++b) {
    const float* xb = x.f32() + b * S * dim;
    gemm_nt(m, F, dim, xb, dim, wkv.w(), dim, c + b * rows * F, F, false);
    gemm_nt(m, F, dim, xb, dim, wgate.w(), dim, z + b * rows * F, F, false);
  }
}

void V4Compressor::pool(const float* c, float* zp, float* pooled, int64_t batch,
                        int64_t W) const {
  const int64_t d = head_dim, F = features(), max_slots = coff() * ratio;
  const float* a = ape.w();
  // Per thread: the slots' scores [max_slots, d], then the per-feature max and sum [d] each.
  const ThreadSlabs slabs((max_slots + 2) * d);
  parallel_for(0, batch * W, [&](int64_t wi) {
    const WindowSlots ws{wi, ratio, F, overlap() ? d : 0, overlap() && wi % W > 0};
    // The weights go over z: each element of z belongs to at most one window.
    pool_window(
        [&](int64_t s) {
          const int64_t at = ws.row_at(s);
          return PoolSlot{c + at, zp + at, a + ws.ape_at(s), zp + at};
        },
        ws.count(), d, slabs.mine(), pooled + wi * d);
  });
}

Tensor V4Compressor::entry_positions(int64_t batch, int64_t W) const {
  Tensor pos = Tensor::empty({batch * W}, DType::I32, MemCategory::Scratch);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t w = 0; w < W; ++w) pos.i32()[b * W + w] = static_cast<int32_t>(w * ratio);
  return pos;
}

void V4Compressor::finish(const float* pooled, float* entries, int64_t rows,
                          const Tensor& positions) const {
  rmsnorm_forward(pooled, norm.weight.w(), entries, nullptr, rows, head_dim, norm.eps);
  if (rope_dim > 0 && rows > 0)
    rope_forward(*rope_, entries + (head_dim - rope_dim), rows, 1, head_dim, head_dim,
                 positions.i32());
  simulate_precision(entry_precision, entries, rows, head_dim, rope_dim);
}

CompressedKv V4Compressor::forward(const Tensor& x, const BatchShape& shape, Pass pass,
                                   SaveInput save_input) {
  MOE_CHECK(x.ndim() == 2 && x.dim(0) == shape.tokens() && x.dim(1) == dim,
            "{}: expected input [{} x {}, {}], got {}", wkv.name, shape.batch, shape.seq, dim,
            shape_str(x.shape()));
  MOE_CHECK(rope_dim == 0 || (rope_ != nullptr && rope_->dim() == rope_dim),
            "{}: needs a RoPE table of {} dims (share_rope before forward)", wkv.name, rope_dim);
  MOE_CHECK(!(needs_backward(pass) && entry_precision == SimulatedPrecision::HadamardFp4),
            "{}: Hadamard-rotated FP4 entries (the indexer's) have no backward; run the forward "
            "in Pass::Eval or Pass::Inference", wkv.name);
  const int64_t B = shape.batch, W = windows(shape.seq), F = features();
  if (rope_dim > 0 && W > 0) rope_->ensure((W - 1) * ratio + 1);
  CompressedKv out;
  out.ratio = ratio;
  out.entries = activation({B, W, head_dim});
  {
    // Temporaries of this call only; backward rebuilds them (see the header).
    Tensor c = activation({B * W * ratio, F}), z = activation({B * W * ratio, F});
    Tensor pooled = activation({B * W, head_dim});
    project(x, shape, c.f32(), z.f32());
    pool(c.f32(), z.f32(), pooled.f32(), B, W);
    // An entry sits at its window's first token, w·ratio (the reference's freqs_cis[:cutoff:ratio]).
    finish(pooled.f32(), out.entries.f32(), B * W, entry_positions(B, W));
  }
  if (needs_backward(pass)) {
    if (save_input == SaveInput::Yes) saved_x_ = x;
    saved_shape_ = shape;
    pending_ = true;
  }
  return out;
}

void V4Compressor::forward_cached(const Tensor& x, std::span<const CachedChunk> chunks,
                                  const V4CompressorCache& cache) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == dim, "{}: expected input [T, {}], got {}", wkv.name, dim,
            shape_str(x.shape()));
  MOE_CHECK(rope_dim == 0 || (rope_ != nullptr && rope_->dim() == rope_dim),
            "{}: needs a RoPE table of {} dims (share_rope before forward)", wkv.name, rope_dim);
  const int64_t T = x.dim(0), d = head_dim, F = features(), R = cache.state_rows;
  const std::vector<int64_t> first = chunk_first_rows(chunks, T, wkv.name);
  if (T == 0) return;
  // c and z of every new row: a GEMM row's bits do not depend on the other rows, so these are
  // the training forward's values for the same tokens.
  Tensor c = activation({T, F}), z = activation({T, F});
  gemm_nt(T, F, dim, x.f32(), dim, wkv.w(), dim, c.f32(), F, false);
  gemm_nt(T, F, dim, x.f32(), dim, wgate.w(), dim, z.f32(), F, false);

  // The windows that complete within a chunk (and fit the cache), in chunk then window order.
  struct Done {
    size_t chunk;
    int64_t window;
  };
  std::vector<Done> done;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CachedChunk& ch = chunks[i];
    const int64_t end = std::min(ch.past + ch.count, cache.max_entries * ratio);
    for (int64_t w = ch.past / ratio; (w + 1) * ratio <= end; ++w) done.push_back({i, w});
  }
  const int64_t n_done = static_cast<int64_t>(done.size());
  if (n_done > 0) {
    Tensor pooled = activation({n_done, d}), entries = activation({n_done, d});
    Tensor positions = Tensor::empty({n_done}, DType::I32, MemCategory::Activations);
    const int64_t own_off = overlap() ? d : 0, max_slots = coff() * ratio;
    const float* a = ape.w();
    const ThreadSlabs slabs((max_slots + 2) * d);
    parallel_for(0, n_done, [&](int64_t k) {
      const CachedChunk& ch = chunks[done[static_cast<size_t>(k)].chunk];
      const int64_t w = done[static_cast<size_t>(k)].window;
      const int64_t row0 = first[done[static_cast<size_t>(k)].chunk];
      // Position p's projections: this forward's row, or the ring's for earlier positions (a
      // completing window reaches back at most 2·ratio - 1 positions, all still in the ring).
      auto features_at = [&](const float* fresh, const float* ring, int64_t p) {
        return p >= ch.past ? fresh + (row0 + p - ch.past) * F
                            : ring + (ch.slot * R + p % R) * F;
      };
      // forward()'s slot order: CSA the previous window's tokens (first half) before the
      // window's own (second half); HCA the window's tokens.
      const bool has_prev = overlap() && w > 0;
      pool_window(
          [&](int64_t s) {
            const bool prev = has_prev && s < ratio;
            const int64_t j = prev ? s : has_prev ? s - ratio : s;
            const int64_t p = (prev ? w - 1 : w) * ratio + j;
            const int64_t off = prev ? 0 : own_off;
            return PoolSlot{features_at(c.f32(), cache.kv_state, p) + off,
                            features_at(z.f32(), cache.gate_state, p) + off,
                            a + j * F + off, nullptr};
          },
          has_prev ? 2 * ratio : ratio, d, slabs.mine(), pooled.f32() + k * d);
      positions.i32()[k] = static_cast<int32_t>(w * ratio);
    });
    if (rope_dim > 0) {
      int64_t last = 0;
      for (const Done& dn : done) last = std::max(last, dn.window);
      rope_->ensure(last * ratio + 1);
    }
    finish(pooled.f32(), entries.f32(), n_done, positions);
    for (int64_t k = 0; k < n_done; ++k) {
      const Done& dn = done[static_cast<size_t>(k)];
      std::copy_n(entries.f32() + k * d, d,
                  cache.entries + (chunks[dn.chunk].slot * cache.max_entries + dn.window) * d);
    }
  }
  // The ring takes each chunk's latest rows only after the pooling above read the older ones.
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CachedChunk& ch = chunks[i];
    for (int64_t p = std::max(ch.past, ch.past + ch.count - R); p < ch.past + ch.count; ++p) {
      const int64_t from = (first[i] + p - ch.past) * F, to = (ch.slot * R + p % R) * F;
      std::copy_n(c.f32() + from, F, cache.kv_state + to);
      std::copy_n(z.f32() + from, F, cache.gate_state + to);
    }
  }
}

void V4Compressor::backward(const Tensor& d_entries, const Tensor& dx) {
  MOE_CHECK(pending_, "{}: backward without a training forward", wkv.name);
  MOE_CHECK(saved_x_.defined(), "{}: the forward did not save its input; pass it to backward",
            wkv.name);
  backward(d_entries, dx, saved_x_);
}

void V4Compressor::backward(const Tensor& d_entries, const Tensor& dx, const Tensor& input) {
  MOE_CHECK(pending_, "{}: backward without a training forward", wkv.name);
  const Tensor x = input;  // may be saved_x_, released below
  saved_x_.reset();
  pending_ = false;
  const BatchShape shape = saved_shape_;
  const int64_t B = shape.batch, S = shape.seq, T = shape.tokens(), W = windows(S);
  const int64_t d = head_dim, F = features(), m = ratio, rows = W * m;
  MOE_CHECK(x.defined() && x.ndim() == 2 && x.dim(0) == T && x.dim(1) == dim,
            "{}: backward input must be [{}, {}], got {}", wkv.name, T, dim, shape_str(x.shape()));
  MOE_CHECK(dx.defined() && dx.ndim() == 2 && dx.dim(0) == T && dx.dim(1) == dim,
            "{}: dx must be [{}, {}], got {}", wkv.name, T, dim, shape_str(dx.shape()));
  MOE_CHECK(d_entries.numel() == B * W * d && d_entries.dim(-1) == d,
            "{}: d_entries must be [{}, {}, {}], got {}", wkv.name, B, W, d,
            shape_str(d_entries.shape()));
  if (W == 0) return;  // no entry: x had no influence through the compressor

  // The forward again, keeping the softmax weights (over z) and the RMS statistics.
  Tensor c = activation({B * rows, F}), zp = activation({B * rows, F});
  Tensor pooled = activation({B * W, d}), rstd = activation({B * W});
  project(x, shape, c.f32(), zp.f32());
  pool(c.f32(), zp.f32(), pooled.f32(), B, W);

  // Through RoPE (its transpose) and the norm: dpooled [B·W, d].
  Tensor dpooled = activation({B * W, d});
  {
    Tensor g = activation({B * W, d});
    g.copy_from(d_entries.view({B * W, d}));
    if (rope_dim > 0) {
      const Tensor pos = entry_positions(B, W);
      rope_backward(*rope_, g.f32() + (d - rope_dim), B * W, 1, d, d, pos.i32());
    }
    {
      Tensor scratch = activation({B * W, d});  // the norm's output, not needed here
      rmsnorm_forward(pooled.f32(), norm.weight.w(), scratch.f32(), rstd.f32(), B * W, d,
                      norm.eps);
    }
    rmsnorm_backward(pooled.f32(), norm.weight.w(), rstd.f32(), g.f32(), dpooled.f32(),
                     norm.weight.grad.defined() ? norm.weight.g() : nullptr, B * W, d);
  }

  // Through the pooling: with p the softmax weights and gp = dpooled,
  //   dc_s = p_s·gp,   dscore_s = p_s·(gp·c_s − Σ_s' p_s'·gp·c_s') = dc_s·(c_s − pooled),
  // written over c and p (each element belongs to one window, so windows run in parallel).
  // Features no window reads (CSA: the first half of the last window's tokens) get 0.
  {
    float* cp = c.f32();
    float* pp = zp.f32();
    const float* pl = pooled.f32();
    const float* gpl = dpooled.f32();
    parallel_for(0, B * W, [&](int64_t wi) {
      const WindowSlots ws{wi, m, F, overlap() ? d : 0, overlap() && wi % W > 0};
      const float* gp = gpl + wi * d;
      const float* pw = pl + wi * d;
      for (int64_t s = 0; s < ws.count(); ++s) {
        const int64_t at = ws.row_at(s);
        float* cs = cp + at;
        float* ps = pp + at;
        for (int64_t f = 0; f < d; ++f) {
          const float dc = ps[f] * gp[f];
          ps[f] = dc * (cs[f] - pw[f]);
          cs[f] = dc;
        }
      }
      if (overlap() && wi % W == W - 1)
        for (int64_t j = 0; j < m; ++j) {
          std::fill_n(cp + (wi * m + j) * F, d, 0.0f);
          std::fill_n(pp + (wi * m + j) * F, d, 0.0f);
        }
    });
  }
  const float* dc = c.f32();
  const float* dz = zp.f32();

  // ape: slot j of every window scores with ape[j], so its gradient is the sum of dz over the
  // rows at offset j of their window (both halves at once for CSA). Column blocks own their
  // sums and visit rows in order: same bits for any thread count.
  if (ape.grad.defined()) {
    const int64_t blocks = (F + 63) / 64;
    float* ga = ape.g();
    parallel_for(0, m * blocks, [&](int64_t it) {
      const int64_t j = it / blocks, lo = (it % blocks) * 64, hi = std::min(F, lo + 64);
      double acc[64] = {};
      for (int64_t wi = 0; wi < B * W; ++wi) {
        const float* row = dz + (wi * m + j) * F;
        for (int64_t f = lo; f < hi; ++f) acc[f - lo] += row[f];
      }
      for (int64_t f = lo; f < hi; ++f) ga[j * F + f] += static_cast<float>(acc[f - lo]);
    });
  }

  // dx += dc·wkv + dz·wgate and dW += dᵀ·x over the windowed rows; per-sequence calls continue
  // one chain in row order, so the bits are those of a single call.
  const int64_t calls = rows == S ? 1 : B;
  const int64_t rows_per_call = rows == S ? T : rows;
  for (int64_t b = 0; b < calls; ++b) {
    const float* dcb = dc + b * rows * F;
    const float* dzb = dz + b * rows * F;
    float* dxb = dx.f32() + b * S * dim;
    linear_backward_input(dcb, wkv.w(), dxb, rows_per_call, dim, F, true);
    linear_backward_input(dzb, wgate.w(), dxb, rows_per_call, dim, F, true);
  }
  for (int64_t b = 0; b < calls; ++b) {
    const float* xb = x.f32() + b * S * dim;
    if (wkv.grad.defined())
      linear_backward_weight(dc + b * rows * F, xb, wkv.g(), rows_per_call, dim, F);
    if (wgate.grad.defined())
      linear_backward_weight(dz + b * rows * F, xb, wgate.g(), rows_per_call, dim, F);
  }
}

}  // namespace moe
