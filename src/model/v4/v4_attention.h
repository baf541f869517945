#pragma once
// DeepSeek-V4 attention (SPEC §6.5), forward and backward side by side (the layer convention of
// model/layers.h): shared-KV multi-query attention with per-head q normalisation, partial RoPE,
// a per-head attention sink, a sliding window plus optional compressed entries, and the grouped
// low-rank output projection.
//
//   qr = q_norm(wq_a·x)                                  [T, q_lora]  (the CSA indexer reads it)
//   q  = RoPE(rms(wq_b·qr) per head)                     [T, H, d]    (weightless head norm)
//   kv = RoPE(kv_norm(wkv·x))                            [T, d]       (key and value at once;
//                                                                      optionally FP8-simulated)
//   o_h(t) = Σ_j p_j kv_j,  p = softmax over [scale·q_h(t)·kv_j for visible j ; attn_sink_h]
//            (the sink column carries no value, so Σ_j p_j < 1)
//   o' = RoPE⁻¹(o) at the query's position; z_j = wo_a_j·o'_j per group; y = wo_b·z.
//
// Rows are sequence-major (row = b·S + s), position s. Keys of query s: its own sequence's
// s−window+1 .. s (clamped at 0) and, with a CompressedKv (model/v4/compressed_kv.h), the entries
// visible to it: HCA all w < ⌊(s+1)/ratio⌋, CSA only the picked ids (which must be visible).
//
// The compressor and indexer run between query_residual() and forward(): the indexer needs qr,
// the attention needs its picks. A caller without an indexer may call forward() alone.
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

struct V4AttentionDims {
  int64_t hidden = 0;       // D
  int64_t heads = 0;        // H
  int64_t head_dim = 0;     // d: q, key and value width (one KV head)
  int64_t rope_dim = 0;     // the last rope_dim dims of every head rotate (even, <= d)
  int64_t q_lora_rank = 0;  // wq_a's output
  int64_t o_groups = 0;     // g: divides H; group j reads heads [j·H/g, (j+1)·H/g)
  int64_t o_lora_rank = 0;  // each group's wo_a output
  int64_t window = 0;       // sliding window length (>= 1), the query itself included
  double eps = 1e-6;        // q_norm, kv_norm and the per-head q normalisation
  // Fp8NonRope: DeepSeek's reference quantize-dequantizes kv's non-RoPE features to FP8 after
  // its RoPE (model/v4/simulated_precision.h); the backward passes it as identity.
  SimulatedPrecision kv_precision = SimulatedPrecision::None;
};

class V4Attention {
 public:
  // prefix like "layers.3.attn." (the released keys follow: wq_a.weight, q_norm.weight,
  // wq_b.weight, wkv.weight, kv_norm.weight, wo_a.weight, wo_b.weight, attn_sink). `rope` is the
  // layer's flavour (RopeParams in model/rope.h); its mscale must be 1, as the output's inverse
  // rotation is the transpose one. The table starts empty and grows with the sequences seen.
  void init(const std::string& prefix, const V4AttentionDims& dims, const RopeParams& rope);
  // Layers of one flavour may share one table.
  void share_rope(std::shared_ptr<RopeTable> table);
  const std::shared_ptr<RopeTable>& rope() const { return rope_; }

  // qr = q_norm(wq_a·x) [T, q_lora_rank], for the CSA indexer; hand the result to forward() for
  // the same x and pass. Nothing of it needs a gradient from the indexer (SPEC §6.6).
  Tensor query_residual(const Tensor& x, Pass pass, SaveInput save_input = SaveInput::Yes);
  // y [T, hidden]. `qr`: what query_residual(x, pass, save_input) returned just before, or
  // undefined (then computed here). `ckv`: the layer's compressed entries (undefined: sliding
  // window only). With SaveInput::No x is not kept; backward then needs it handed back.
  Tensor forward(const Tensor& x, const BatchShape& shape, Pass pass, const CompressedKv& ckv = {},
                 const Tensor& qr = {}, SaveInput save_input = SaveInput::Yes);
  // -> dx [T, hidden]; parameter gradients accumulate where allocated. `d_entries`: when the
  // forward had compressed entries, an F32 [B, W, d] tensor their gradient (key and value side
  // together) is ADDED to, so the caller zeroes it or sums several contributions in it;
  // undefined skips that gradient (only right when nothing upstream of the entries needs one).
  Tensor backward(const Tensor& dy, const Tensor& d_entries = {});
  // After a SaveInput::No forward: x is the forward's input, rebuilt bitwise by the caller.
  Tensor backward(const Tensor& dy, const Tensor& x, const Tensor& d_entries);

  // Cached inference (model/v4/v4_cache.h): x [T, hidden] holds the chunks' new rows, qr what
  // query_residual(x, Pass::Inference) just returned. A query at position t sees its slot's kv
  // rows of t - window + 1 .. t (the ring's and this forward's, whose rows then go into the
  // ring) and, for ratio > 0, the slot's entries in `cache` (the compressor completes this
  // forward's windows first): HCA every visible one, CSA the rows of `picks` (I32 [T, k], the
  // indexer's). Computes forward()'s bits for the same tokens: the scores are the same dot
  // products, and the softmax adds its terms in an order of their own (see the .cpp), wherever
  // the keys sit in the block. Nothing is saved.
  Tensor forward_cached(const Tensor& x, const Tensor& qr, std::span<const CachedChunk> chunks,
                        const V4LayerCache& cache, const Tensor& picks = {});
  void collect(ParamList& out);
  bool has_saved() const { return saved_q_.defined(); }

  Linear wq_a;    // [q_lora, D]
  RMSNorm q_norm;
  Linear wq_b;    // [H·d, q_lora]
  Linear wkv;     // [d, D]
  RMSNorm kv_norm;
  // Grouped: rows [j·o_lora, (j+1)·o_lora) map group j's H·d/g inputs. A bare Param, as the
  // released key is one matrix but it acts as g separate ones.
  Param wo_a;     // [g·o_lora, H·d/g]
  Linear wo_b;    // [D, g·o_lora]
  Param attn_sink;  // [H], the sink logit of each head (no score scale applied to it)

  V4AttentionDims dims;
  float softmax_scale = 1.0f;  // d^-0.5

 private:
  int64_t qdim() const { return dims.heads * dims.head_dim; }
  int64_t group_in() const { return qdim() / dims.o_groups; }
  Tensor backward_impl(const Tensor& dy, const Tensor& x, const Tensor& d_entries);
  // The pieces forward() and forward_cached() share, per row at its position:
  //   q = RoPE(rms(wq_b·qr) per head) [T, H·d] (qr released after wq_b), each head's 1/rms
  //       into *q_rstd [T, H] when given;
  //   kv = RoPE(kv_norm(wkv·x)) [T, d] (wkv's forward in pass `first`, kv_norm's in `pass`),
  //        then dims.kv_precision (rotate_and_simulate_kv, which backward's rebuild shares);
  //   y = wo_b·grouped wo_a·RoPE⁻¹(o) [T, hidden] (o is rotated in place, then released).
  Tensor query_heads(Tensor qr, const Tensor& positions, Tensor* q_rstd);
  Tensor shared_kv(const Tensor& x, const Tensor& positions, Pass pass, Pass first);
  void rotate_and_simulate_kv(Tensor& kv, const Tensor& positions) const;
  Tensor output(Tensor o, const Tensor& positions, Pass pass);
  // The qr that query_residual() handed out, checked to be `qr` (undefined: computed now).
  Tensor take_query_residual(const Tensor& x, const Tensor& qr, Pass pass, SaveInput save_input);

  std::shared_ptr<RopeTable> rope_;
  Tensor ones_;  // [d] of 1: the weight of the weightless per-head normalisation

  // query_residual's result until forward takes it (checked to be the same tensor).
  Tensor pending_qr_;
  Pass pending_pass_ = Pass::Eval;
  SaveInput pending_save_ = SaveInput::Yes;

  // Saved by a Train forward, besides what the linears and norms keep for themselves (x by wq_a
  // and wkv, one shared tensor, unless SaveInput::No; wq_a's output and rstd by q_norm; wkv's
  // output and rstd by kv_norm; z = the grouped wo_a output by wo_b):
  //   q [T, H·d]       normalised and rotated: the scores' left side and dK's, and the per-head
  //                    norm's backward (rebuilding it would be a wq_b GEMM, H·d·q_lora per token);
  //   q_rstd [T, H]    that norm's 1/rms per head;
  //   stats [T, H, 2]  per query row the softmax shift m (max of its scores and the sink) and
  //                    1/(Σexp(s − m) + exp(sink − m)): backward rebuilds P from them.
  //   the CompressedKv's entries and picks (references to the caller's tensors, no copies).
  // Not saved, because backward rebuilds them:
  //   P [T, H, keys]   flash-style per block from q, kv and the stats: the score GEMM again;
  //   kv [T, d]        kv_norm's output from its saved input, then RoPE and the simulated
  //                    precision (elementwise / per row, bitwise);
  //   qr [T, q_lora]   q_norm.recompute_output() for wq_b's weight gradient;
  //   o [T, H·d]       wo_a's input, P·kv again inside the backward's block loop (one more GEMM
  //                    of the forward's size) instead of H·d floats per token held all step.
  // Backward runs two passes: a query-side one on the forward's blocks (dQ, o, the row terms
  // D = dO·o and the sink's gradient) and a key-side one in which each task owns a block of
  // window keys or compressed entries and rebuilds P and dS for the queries that see it, so
  // dkv and d_entries accumulate in a fixed order without per-task partial buffers (a second
  // score and dP GEMM is the price). Its transient peak is dO, dq and o, [T, H·d] each.
  BatchShape saved_shape_;
  CompressedKv saved_ckv_;
  Tensor saved_q_, saved_q_rstd_, saved_stats_;
  bool saved_x_kept_ = true;  // false after a SaveInput::No forward
};

}  // namespace moe
