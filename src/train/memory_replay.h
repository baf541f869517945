#pragma once
// The replay behind `moe plan` (train/memory_plan.h): one training micro-batch of
// DeepSeekModel or DeepSeekV4Model, allocation by allocation in the engine's order, against a
// ledger that keeps MemoryTracker's per-category current and peak bytes, plus the kernels'
// workspace bound. The shapes below are what the replay needs of a model and a run.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/memory.h"
#include "kernels/gemm.h"
#include "kernels/kernel_scratch.h"

namespace moe::memory_replay {

inline constexpr size_t kCategories = static_cast<size_t>(MemCategory::Count);
inline size_t at(MemCategory c) { return static_cast<size_t>(c); }

// ---------------------------------------------------------------- the ledger
// MemoryTracker's bookkeeping for the replayed step: current and peak bytes per category, and
// what the replay was doing when each peak was set.

class Ledger {
 public:
  void alloc(MemCategory c, int64_t bytes) {
    int64_t& cur = current_[at(c)];
    cur += bytes;
    if (cur > peak_[at(c)]) {
      peak_[at(c)] = cur;
      peak_phase_[at(c)] = phase_;
    }
  }
  void release(MemCategory c, int64_t bytes) { current_[at(c)] -= bytes; }
  int64_t current(MemCategory c) const { return current_[at(c)]; }
  int64_t peak(MemCategory c) const { return peak_[at(c)]; }
  const std::string& peak_phase(MemCategory c) const { return peak_phase_[at(c)]; }
  void set_phase(std::string p) { phase_ = std::move(p); }

 private:
  std::array<int64_t, kCategories> current_{}, peak_{};
  std::array<std::string, kCategories> peak_phase_;
  std::string phase_;
};

// kernels/kernel_scratch.h's per-thread slots, sized by the largest request each saw; each
// kernel reports what a call asks for on the current SIMD target (see memory_replay.cpp).
class Workspace {
 public:
  // A gemm_* called outside parallel loops. The layouts ask differently of the scratch: gemm_nt
  // packs nothing for a few rows and runs transposed for a few hundred rows against large
  // weights; gemm_tn may pack A once for all threads.
  void top(int64_t M, int64_t N, int64_t K, GemmLayout layout);
  void top_nt(int64_t M, int64_t N, int64_t K) { top(M, N, K, GemmLayout::NT); }
  void top_nn(int64_t M, int64_t N, int64_t K) { top(M, N, K, GemmLayout::NN); }
  void top_tn(int64_t M, int64_t N, int64_t K) { top(M, N, K, GemmLayout::TN); }
  // A gemm_*_serial inside a parallel loop: any thread.
  void serial(int64_t M, int64_t N, int64_t K, GemmLayout layout);
  void serial_nt(int64_t M, int64_t N, int64_t K) { serial(M, N, K, GemmLayout::NT); }
  void serial_nn(int64_t M, int64_t N, int64_t K) { serial(M, N, K, GemmLayout::NN); }
  void serial_tn(int64_t M, int64_t N, int64_t K) { serial(M, N, K, GemmLayout::TN); }
  // Serial calls of any number of rows up to m (an expert's share of the tokens): a call of
  // fewer rows may ask more (gemm_nt below its transposed range packs the weights).
  void serial_up_to(int64_t m, int64_t N, int64_t K, GemmLayout layout);
  // mxfp4_gemm_nt / _nn calls of up to m rows (inside parallel loops).
  void mxfp4_nt(int64_t m);
  void mxfp4_nn(int64_t m, int64_t rows, int64_t cols);  // W of rows × cols
  // Any kernel call asking for s, on any thread.
  void on_any_thread(ScratchFloats s);
  int64_t bytes(int threads) const;
  int64_t main_bytes() const { return bytes(1); }

 private:
  int64_t main0_ = 0, main1_ = 0, any0_ = 0, any1_ = 0;
};

// ---------------------------------------------------------------- the model's shapes

struct Lin {
  int64_t in = 0, out = 0;
  int64_t r = 0;  // LoRA rank; 0: no adapter
  int64_t adapter_params() const { return r * (in + out); }
};

struct LayerShape {
  bool moe = false;
  bool q_lora = false;
  Lin q, q_a, q_b, kv_a, kv_b, o;
  Lin gate, up, down;  // the dense MLP, or the shared experts (out == 0: none)
  int64_t er_gate = 0, er_up = 0, er_down = 0;  // routed experts' grouped adapters (rank; 0: none)
  bool any_expert_adapter() const { return er_gate || er_up || er_down; }
};

struct Dims {
  int64_t B = 0, S = 0, T = 0, D = 0, V = 0, L = 0;
  int64_t H = 0, dn = 0, dr = 0, dv = 0, qr = 0, kvr = 0;
  int64_t E = 0, E_loc = 0, k = 0, Im = 0;
  int64_t slots = 0, R = 0;  // token slots of this rank; rows its experts compute
  int64_t ep = 1;
  int threads = 1;
  bool finetune = false;
  bool base_grads = false;        // pretraining: every trainable base weight has a gradient
  bool experts_trainable = false; // fp32 routed experts in pretraining
  bool mxfp4 = false;
  bool dropout = false;           // LoRA dropout masks materialised
  bool aux = false;               // sequence-wise aux loss
  // The most rows one expert may get: a weight gradient's contraction over them sizes the
  // serial matmuls' packed buffers, which keep their largest size, and routing is skewed at
  // times (an untrained router on repetitive text sends most tokens to a few experts).
  int64_t max_rows_per_expert() const { return E_loc > 0 ? R : 0; }
};

struct ReplayResult {
  int64_t saved_after_forward = 0;        // activations saved for backward before the LM head
  std::vector<int64_t> saved_per_layer;   // of which each layer's
};

// Replays one micro-batch's forward and backward into `ledger` and `ws`.
ReplayResult replay_training_step(const Dims& d, const std::vector<LayerShape>& layers,
                                  Ledger& ledger, Workspace& ws);

// ---------------------------------------------------------------- DeepSeek-V4

// What DeepSeek-V4 adds to Dims (model/v4/*.h): the mHC streams, the attention's, compressors'
// and indexer's widths, and the MTP layer.
struct V4Dims {
  int64_t n = 0;                // hc_mult: residual streams per token
  int64_t sinkhorn_iters = 0;   // hc_sinkhorn_iters
  int64_t H = 0, hd = 0, rope = 0, q_lora = 0, o_groups = 0, o_lora = 0, window = 0;
  int64_t index_heads = 0, index_dim = 0, index_topk = 0;
  bool mtp = false;  // the last layer shape is the MTP block
  int64_t mixes() const { return (2 + n) * n; }
};

struct V4LayerShape {
  int64_t ratio = 0;  // 0: sliding window only; 4: CSA (compressor + indexer); else HCA
  Lin wq_a, wq_b, wkv, wo_b;
  LayerShape ffn;  // the MoE: shared experts (gate, up, down) and routed experts' adapters
};

// The same for DeepSeekV4Model: `layers` are the main blocks, then the MTP block if v.mtp.
// The RoPE tables, which the first step grows, are charged to MemCategory::Weights here.
ReplayResult replay_v4_training_step(const Dims& d, const V4Dims& v,
                                     const std::vector<V4LayerShape>& layers, Ledger& ledger,
                                     Workspace& ws);

}  // namespace moe::memory_replay
