#pragma once
// DeepSeek-V4's lightning indexer (SPEC §6.6): for every query token of a CSA layer, the
// compressed entries its attention uses. Rows are sequence-major (row = b * seq + t), position t.
//
//   q_h(t) = (wq_b · qr_t)_h                [n_heads, d_i], RoPE on its last rope_dim at t
//   k_s    = entry s of the indexer's own compressor (CSA, d_c = d_i; model/v4/compressor.h)
//   w_h(t) = (weights_proj · x_t)_h · d_i^-0.5 · n_heads^-0.5
//   I(t,s) = Σ_h w_h(t) · ReLU(q_h(t) · k_s)          for visible s < floor((t+1) / ratio)
//   picks(t) = the top min(topk, #visible) entries by I, ties to the lower id, in ascending
//              order, -1 in the remaining slots.
// When #visible <= topk (every token of a sequence with floor(S/ratio) <= topk, e.g. S <= 2051
// for V4-Flash) the picks are all visible entries whatever the scores, so nothing is computed
// for those tokens (and neither q nor the compressor when no token of the batch needs scores).
//
// No gradient, nothing saved: the picks are integers, so the LM loss sends no gradient to
// wq_b, weights_proj or the indexer's compressor; neither HF nor Automodel trains the indexer,
// and there is no indexer (KL) loss here. Its parameters are marked trainable = false, so a
// trainer neither allocates their gradients nor decays them.
//
// Simulated precision (V4IndexerDims::qk_precision): by default none, so the picks are those of
// HF and Automodel, which omit it. HadamardFp4 does what DeepSeek's reference does: q (per head,
// after RoPE) and k (the compressor's entries, after its norm and RoPE) are rotated by the
// orthonormal Hadamard transform and FP4-quantize-dequantized in blocks of 32
// (model/v4/simulated_precision.h). The rotation alone would cancel in q·k (HᵀH = I); the FP4
// grid, coarse in the rotated frame, changes the scores and so possibly the picks.
//
// Determinism: q, w and the scores are FMA-chain GEMMs, the head sum runs in head order on one
// thread per token, and the selection is a total order (score, then id; a NaN score ranks
// below every number).
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "model/param.h"
#include "model/rope.h"
#include "model/v4/compressor.h"

namespace moe {

struct V4IndexerDims {
  int64_t dim = 0;       // D: the width of x
  int64_t q_lora = 0;    // the width of qr (q_lora_rank)
  int64_t n_heads = 0;   // index_n_heads
  int64_t head_dim = 0;  // index_head_dim d_i
  int64_t rope_dim = 0;  // qk_rope_head_dim: the last rope_dim of each head are rotated
  int64_t topk = 0;      // index_topk
  int64_t ratio = 4;     // the CSA compress ratio
  double eps = 1e-6;     // its compressor's norm
  SimulatedPrecision qk_precision = SimulatedPrecision::None;  // None or HadamardFp4
};

class V4Indexer {
 public:
  // prefix like "layers.2.attn.indexer."; keys as released: wq_b.weight [n_heads·d_i, q_lora],
  // weights_proj.weight [n_heads, D], compressor.{wkv,wgate,norm}.weight, compressor.ape.
  void init(const std::string& prefix, const V4IndexerDims& dims);
  // The layer's compressed-layer RoPE table (shared with its compressor); grown as needed.
  void share_rope(std::shared_ptr<RopeTable> table);

  // x [B·S, D] (the attention's input), qr [B·S, q_lora] (its q_norm(wq_a x)) ->
  // picks I32 [B·S, topk] (MemCategory::Routing: selection state the attention keeps until its
  // backward, like the router's), for CompressedKv::picked.
  Tensor forward(const Tensor& x, const Tensor& qr, const BatchShape& shape);
  // Cached inference: x, qr [T, ...] the chunks' new rows -> picks I32 [T, topk] as forward's
  // for the same tokens. Its compressor first completes the chunks' windows in `keys` (a query
  // may see an entry its own chunk completed); then a query with more than topk visible entries
  // scores them all from the cache (O(entries) per token, as forward).
  Tensor forward_cached(const Tensor& x, const Tensor& qr, std::span<const CachedChunk> chunks,
                        const V4CompressorCache& keys);

  void collect(ParamList& out);

  Param wq_b, weights_proj;
  V4Compressor compressor;
  int64_t dim = 0, q_lora = 0, n_heads = 0, head_dim = 0, rope_dim = 0, topk = 0, ratio = 0;
  SimulatedPrecision qk_precision = SimulatedPrecision::None;

 private:
  std::shared_ptr<RopeTable> rope_;
};

}  // namespace moe
