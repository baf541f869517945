#pragma once
// DeepSeek-V4's KV compressor (SPEC §6.6), forward and backward side by side (the layer
// convention of model/layers.h). Rows of x are sequence-major (row = b * seq + s); every
// sequence is compressed on its own, from position 0.
//
// Each complete window w of `ratio` tokens ([w·ratio, (w+1)·ratio)) becomes one entry:
//   c = wkv·x, z = wgate·x                        [coff·d_c] per token
//   slots: the window's own tokens (HCA: all features, CSA: the SECOND half), and for CSA also
//          the previous window's tokens with the FIRST half (masked out for window 0); a slot
//          of token j of its window scores z + ape[j] (the same half of ape as of z)
//   pooled[f] = Σ_slots softmax_slots(score[·, f]) · c[·, f]      (a softmax per feature)
//   entry = RoPE(RMSNorm_norm(pooled)) on the last rope_dim features, at position w·ratio.
// coff = 2 and overlapping windows iff ratio == 4 (CSA), as in DeepSeek's reference; any other
// ratio is HCA (coff = 1). The S mod ratio trailing tokens of a sequence form no entry.
//
// Saved for backward: x only, as a shared reference (no copy; free when the attention keeps the
// same tensor for its own projections), or nothing with SaveInput::No, where the caller hands x
// back to backward. Backward recomputes c and z for the windowed rows (two GEMMs as large as
// the forward's) instead of holding 2·coff·d_c floats per token (half of x for the main CSA
// compressor of V4-Flash) across the step; the softmax weights, pooled rows and RMS statistics
// are rebuilt from them bitwise, in the forward's order. Those rebuilt c and z (then their
// gradients, in place) are backward's transient peak: 2·coff·d_c floats per windowed token.
//
// Backward accumulates into a dx the caller gives (dx += ∂L/∂x), because x also feeds the
// attention's own projections; and into the gradients of wkv, wgate, ape and norm when they
// are allocated.
//
// Determinism: projections are the engine's FMA-chain GEMMs (per-sequence calls continue one
// chain in row order), the softmax exp is the Highway exp of kernels/vector_math (same bits on
// every SIMD target), every window is computed by one thread in slot order, and cross-window
// sums (ape's gradient) run over fixed column blocks in row order.
//
// Simulated precision (V4CompressorDims::entry_precision, model/v4/simulated_precision.h): after
// RoPE, DeepSeek's reference quantize-dequantizes the main compressor's entries to FP8 on their
// non-RoPE features (Fp8NonRope) and the indexer compressor's to FP4 after a Hadamard rotation
// (HadamardFp4); HF and Automodel do neither (the default, None). Backward passes Fp8NonRope as
// identity (straight-through: d_entries is taken as the gradient of the unquantized entries);
// HadamardFp4 serves the indexer, which has no backward, and refuses a training forward.
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "model/layers.h"
#include "model/param.h"
#include "model/rope.h"
#include "model/v4/compressed_kv.h"
#include "model/v4/simulated_precision.h"
#include "model/v4/v4_cache.h"

namespace moe {

struct V4CompressorDims {
  int64_t dim = 0;       // D: the width of x (hidden size)
  int64_t head_dim = 0;  // d_c: the width of an entry (head_dim main, index_head_dim indexer)
  int64_t rope_dim = 0;  // the trailing features RoPE rotates (qk_rope_head_dim; even, <= d_c)
  int64_t ratio = 0;     // tokens per window: 4 = CSA (overlapping), anything else = HCA
  double eps = 1e-6;     // the norm's (rms_norm_eps)
  SimulatedPrecision entry_precision = SimulatedPrecision::None;
};

class V4Compressor {
 public:
  // prefix like "layers.2.attn.compressor."; keys as released: wkv.weight [coff·d_c, D],
  // wgate.weight [coff·d_c, D], ape [ratio, coff·d_c], norm.weight [d_c].
  void init(const std::string& prefix, const V4CompressorDims& dims);
  // The layer's RoPE table, the compressed-layer flavour (RopeParams in model/rope.h: theta =
  // compress_rope_theta, YaRN always on, mscale 1), shared with the attention; forward grows it.
  void share_rope(std::shared_ptr<RopeTable> table) { rope_ = std::move(table); }
  const std::shared_ptr<RopeTable>& rope() const { return rope_; }

  bool overlap() const { return ratio == 4; }
  int64_t coff() const { return overlap() ? 2 : 1; }
  int64_t features() const { return coff() * head_dim; }  // width of c and z
  int64_t windows(int64_t seq) const { return seq / ratio; }

  // x [B·S, D] -> {ratio, entries F32 [B, W, d_c] (MemCategory::Activations), picked undefined}.
  CompressedKv forward(const Tensor& x, const BatchShape& shape, Pass pass,
                       SaveInput save_input = SaveInput::Yes);
  // d_entries [B, W, d_c] (or [B·W, d_c]); dx [B·S, D] += the input gradient. Releases what
  // forward saved.
  void backward(const Tensor& d_entries, const Tensor& dx);
  // After a SaveInput::No forward: x is the forward's input, rebuilt bitwise by the caller.
  void backward(const Tensor& d_entries, const Tensor& dx, const Tensor& x);

  // Cached inference (model/v4/v4_cache.h): x [T, D] holds the chunks' new rows. Every window
  // that completes within a chunk becomes its entry in the cache, pooled from the new rows' c
  // and z and the state ring's earlier ones in the order forward() pools (the same bits); then
  // the ring takes the new rows. Nothing is saved.
  void forward_cached(const Tensor& x, std::span<const CachedChunk> chunks,
                      const V4CompressorCache& cache);

  void collect(ParamList& out);
  bool has_saved() const { return pending_; }

  Param wkv, wgate, ape;
  RMSNorm norm;
  int64_t dim = 0, head_dim = 0, rope_dim = 0, ratio = 0;
  SimulatedPrecision entry_precision = SimulatedPrecision::None;

 private:
  // c and z [B·W·ratio, coff·d_c] of every sequence's complete-window rows.
  void project(const Tensor& x, const BatchShape& shape, float* c, float* z) const;
  // Per window: the softmax weights over its slots, written over z (each element of z belongs
  // to at most one window), and the pooled row [d_c].
  void pool(const float* c, float* zp, float* pooled, int64_t batch, int64_t W) const;
  // RMSNorm + RoPE (+ entry_precision) of `rows` pooled rows into entries, entry i at position
  // positions[i].
  void finish(const float* pooled, float* entries, int64_t rows, const Tensor& positions) const;
  Tensor entry_positions(int64_t batch, int64_t W) const;

  std::shared_ptr<RopeTable> rope_;
  Tensor saved_x_;
  BatchShape saved_shape_;
  bool pending_ = false;  // a Train forward ran (x saved, or handed back by the caller)
};

}  // namespace moe
