#include "kernels/gemm.h"

// The engine's own fp32 matmuls (Highway, runtime dispatch). Design in one place:
//
// * Arithmetic, the same on every target. Each output element is one scalar chain of fused
//   multiply-adds over k in increasing order:
//       c = accumulate ? C[i,j] : +0;   for k in 0..K-1:  c = fma(A(i,k), B(k,j), c);   C[i,j] = c
//   Its bits therefore depend on row i of A, column j of B and the start value only: not on M
//   or N, the blocking, the thread count, the rank layout, or the vector width. The vector
//   kernels compute every lane as such a chain (a lane never mixes with another); K blocks hand
//   the running value on through C itself, which holds it exactly (fp32). Targets without a
//   hardware FMA (SSE4 and older, the forced scalar target) run the same chain with std::fma:
//   slow, but the same bits. Accumulating calls continue a chain: two calls over K1 then K2 rows
//   of a weight gradient give the bits of one call over K1 + K2.
//
// * Kernel (outer product, as GotoBLAS/BLIS): a register tile of kMr rows × kNv vectors of C;
//   per k, kNv vector loads of packed B and kMr broadcasts of A feed kMr·kNv FMAs. AVX-512:
//   12 × 32 (24 accumulators), AVX2: 6 × 16 (12 accumulators).
//
// * Operands. B is packed once per column block into panels of kNr columns, k-major: a copy for
//   nn/tn (B's rows are k), a transposition in registers for nt (B's rows are j). For nt/nn the
//   broadcasts read A's kMr rows in place unless its row stride would put them in a few L1
//   sets (rows_in_place); then, and for tn, A is copied per kMr-row micro-panel so that the
//   broadcasts walk one contiguous stream: in chunks of 16 k's per row for nt/nn, k-major for
//   tn — a copy, never a transposition. The micro-panel (≤ 24 KiB) stays in L1 while the B
//   panels stream from L2. nt with a few hundred rows or fewer against weights too large for
//   the L2 runs as its transpose Cᵀ = B·Aᵀ, so that the small operand is the packed one
//   (transposed_pays). nt with up to kNr rows packs nothing: W's rows are read in place, a kN-row
//   square at a time transposed in registers (1-4 rows, skinny_columns) or as broadcasts against
//   a k-major copy of x (5 to kNr rows, run_few_rows); nn with up to 2·kMr rows reads B's rows
//   in place (run_few_rows_nn).
//
// * Threads. All threads pack a column block of B together into one shared buffer, then take
//   tasks (row blocks, and column parts when rows alone are too few) dynamically, each packing
//   its A panels into per-thread scratch (tn with few rows of C: all threads pack A once, as
//   B). Any cut gives the same bits, so the cut is chosen for speed only.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/parallel.h"
#include "core/simd.h"
#include "kernels/kernel_scratch.h"
#include "kernels/read_bandwidth.h"

#ifndef MOE_KERNELS_GEMM_SHARED
#define MOE_KERNELS_GEMM_SHARED
namespace moe::gemm_detail {

using Layout = GemmLayout;

// C[M,N] (+)= op(A)[M,K] · op(B)[K,N]; A(i,k) and B(k,j) read through the layout.
struct Problem {
  Layout layout;
  int64_t M, N, K;
  const float* A;
  int64_t lda;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  bool accumulate;
  // C(i, j) is stored at C[j·ldc + i]: the problem is the transpose of the caller's (see
  // transposed_pays).
  bool c_transposed = false;
  // nn only: B's row k is rows->row(.., rows_k0 + k, ..) instead of B + k·ldb (B unused).
  const GemmRows* rows = nullptr;
  int64_t rows_k0 = 0;

  float a(int64_t i, int64_t k) const { return layout == Layout::TN ? A[k * lda + i] : A[i * lda + k]; }
  float b(int64_t k, int64_t j) const {
    if (rows) {
      float v;
      rows->row(rows->ctx, rows_k0 + k, j, 1, &v);
      return v;
    }
    return layout == Layout::NT ? B[j * ldb + k] : B[k * ldb + j];
  }
};

// Whether a call runs on all threads: the parallel forms, where the product is large enough to be
// worth waking them.
inline bool runs_wide(bool parallel, int64_t M, int64_t N, int64_t K) {
  return parallel && M * N * K >= kGemmParallelMinWork;
}

// A rectangle of C: rows [i0, i1), columns [j0, j1).
struct Block {
  int64_t i0, i1, j0, j1;
};

// The contract spelled out, for targets without a hardware FMA.
inline void exact_scalar(const Problem& p, const Block& blk) {
  for (int64_t i = blk.i0; i < blk.i1; ++i)
    for (int64_t j = blk.j0; j < blk.j1; ++j) {
      float c = p.accumulate ? p.C[i * p.ldc + j] : 0.0f;
      for (int64_t k = 0; k < p.K; ++k) c = std::fma(p.a(i, k), p.b(k, j), c);
      p.C[i * p.ldc + j] = c;
    }
}

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace moe::gemm_detail
#endif  // MOE_KERNELS_GEMM_SHARED

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/gemm.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "kernels/transpose-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace moe::gemm_detail;

#if HWY_NATIVE_FMA && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
constexpr int64_t kN = static_cast<int64_t>(hn::MaxLanes(D()));
static_assert(kN == 8 || kN == 16, "gemm kernels are tuned for 256- and 512-bit vectors");
// Register tile: kMr rows × kNv vectors; accumulators + kNv B vectors + 1 broadcast fit the
// register file (32 registers on AVX-512, 16 on AVX2).
constexpr int kMr = kN == 16 ? 12 : 6;
constexpr int kNv = 2;
constexpr int64_t kNr = kNv * kN;
// Contraction blocks of at most kKc (K split evenly, in multiples of 16, so no block is a short
// remainder); B block width (a kKc × kNc block of B, 2 MiB on AVX-512, is reused from L2 or L3
// by every row panel of a row block, whose C block stays in L2 over all of K); packed B of
// one column block is at most max_packed_b floats (kGemmPackedBFloats*, in L3), narrower for a
// long K.
// AVX-512: 512 (the 2048³ products 1-5% faster than 320 on a Zen 5, in medians of 6 runs);
// AVX2: 320 (512 was no faster).
constexpr int64_t kKc = kN == 16 ? 512 : 320;
constexpr int64_t kNc = kN == 16 ? 1024 : 512;
// Row blocks. A task's A panels meet each B slice it loads, so the taller the block, the fewer
// times a slice comes from L3. Where a column block of packed B overflows half the L2, blocks
// are tall: as many micro-panels as a quarter of the L2 holds at kKc, from 4 up to 16 (2048³
// on two threads of a Xeon with a 2 MiB L2 and a 480 MiB L3: 0.54-0.62 of the FMA peak with 4,
// 0.60-0.77 with 16, 5 alternated rounds; docs/PERF.md, session 27). Where packed B stays in
// L2, short blocks of 4 give the threads more tasks (the `small` model's products, K = 320,
// were no faster tall); the tail is short.
constexpr int64_t kMcShort = 4 * kMr;
constexpr int64_t kMcTall = 16 * kMr;
constexpr int64_t kFloatBytes = sizeof(float);
constexpr int64_t kLineFloats = 64 / kFloatBytes;
int64_t tall_rows() {
  return std::clamp(l2_cache_bytes() / 4 / (kKc * kFloatBytes) / kMr * kMr, kMcShort, kMcTall);
}
// A column block is whole panels: blocking() clamps to kNc, and packing a column block of kNc
// columns writes ceil(kNc / kNr) panels into a buffer sized for kNc (an 8 × 48 AVX-512 tile
// overran the heap that way).
static_assert(kNc % kNr == 0, "kNc must be a multiple of the panel width kNr");

// ------------------------------------------------------------------------------ packing

HWY_INLINE void transpose_square(V* r) { TransposeSquare<static_cast<int>(kN)>(D(), r); }

// The square of rows [0, rows) × columns [0, kn) at src (row stride ld), zero elsewhere,
// transposed in registers and handed to use(r): r[c] holds column c. Full squares, the common
// case, load without a branch per row and get their own copy of `use`: with the branches in
// the same path GCC kept all kN rows on the stack between the loads and the transpose. That
// made the skinny products (decoding) 7-10% slower; pack_b keeps the stack, as packing a cold B
// (an expert's weights, 8 rows per expert) ran 20% slower with the rows in registers.
template <class Use>
HWY_INLINE void with_transposed_square(const float* src, int64_t ld, int64_t rows, int64_t kn,
                                       const Use& use) {
  const D d;
  V r[kN];
  if (rows == kN && kn == kN) {
#pragma GCC unroll 16
    for (int q = 0; q < kN; ++q) r[q] = hn::LoadU(d, src + q * ld);
    transpose_square(r);
    use(r);
    return;
  }
#pragma GCC unroll 16
  for (int q = 0; q < kN; ++q) {
    if (q >= rows) r[q] = hn::Zero(d);
    else if (kn == kN) r[q] = hn::LoadU(d, src + q * ld);
    else r[q] = hn::MaskedLoad(hn::FirstN(d, static_cast<size_t>(kn)), d, src + q * ld);
  }
  transpose_square(r);
  use(r);
}

// Packs B(k, j) for k in [pc, pc + kc), j in [jc, jc + nc) into panels of kNr columns,
// out[(panel·kc + k)·kNr + column in panel]; columns past nc are zero. Only panels [jp0, jp1)
// and the block's rows [k0, k1) are written, so several threads can pack one block: nn and tn
// in items of rows across all panels, nt in items of panels over the whole block (k0 = 0,
// k1 = kc).
void pack_b(const Problem& p, int64_t pc, int64_t kc, int64_t jc, int64_t nc, int64_t jp0,
            int64_t jp1, int64_t k0, int64_t k1, float* out) {
  const D d;
  if (p.layout != Layout::NT) {
    // B's rows are k: copy kNr floats of each row into each panel (fewer at the right edge,
    // zero-filled). k outer: each row's span of the panels is read front to back, one stream
    // of whole lines, where a panel at a time read 2 lines per row down a strided column.
    // A produced B (GemmRows) writes each row's span of the block [jc + jp0·kNr, ...) here first.
    static_assert(kNc <= kGemmRowsMaxFloats, "a produced row spans at most one column block");
    alignas(64) float produced[kNc];
    const int64_t j_end = jc + nc;
    const int64_t j_from = jc + jp0 * kNr, j_to = std::min(j_end, jc + jp1 * kNr);
    for (int64_t k = k0; k < k1; ++k) {
      // Row k's columns from j_from: the block's panels [jp0, jp1).
      const float* row = produced;
      if (p.rows) p.rows->row(p.rows->ctx, p.rows_k0 + pc + k, j_from, j_to - j_from, produced);
      else row = p.B + (pc + k) * p.ldb + j_from;
      for (int64_t jp = jp0; jp < jp1; ++jp) {
        const int64_t w = std::min(kNr, j_end - (jc + jp * kNr));
        float* dst = out + (jp * kc + k) * kNr;
        for (int64_t v = 0; v < kNv; ++v) {
          const int64_t n = std::clamp<int64_t>(w - v * kN, 0, kN);
          const float* at = row + (jp - jp0) * kNr + v * kN;
          const V x = n == kN ? hn::LoadU(d, at)
                      : n == 0 ? hn::Zero(d)
                               : hn::MaskedLoad(hn::FirstN(d, static_cast<size_t>(n)), d, at);
          hn::Store(x, d, dst + v * kN);
        }
      }
    }
    return;
  }
  // nt: B's rows are j. Squares of kN columns × kN k's (from k0, a multiple of kN) are
  // transposed in registers; columns past nc read as zero rows, k's past k1 are masked off
  // (never read). The loads repeat with_transposed_square's general path on purpose: called
  // through one shared helper, GCC compiled this loop otherwise and a cold B (8 rows per
  // expert) packed about 3% slower.
  for (int64_t jp = jp0; jp < jp1; ++jp) {
    float* panel = out + jp * kc * kNr;
    for (int64_t v = 0; v < kNv; ++v) {
      const int64_t j0 = jc + jp * kNr + v * kN;
      const int64_t rows = std::clamp<int64_t>(jc + nc - j0, 0, kN);
      const int64_t next_rows = std::clamp<int64_t>(jc + nc - j0 - kN, 0, kN);
      for (int64_t kq = k0; kq < k1; kq += kN) {
        const int64_t kn = std::min(kN, k1 - kq);
        // The next kN rows of B, a line each as these pass the same k's (as skinny_columns
        // does): an expert's weights come from DRAM, and this loop's rows in lockstep waited on
        // each line. The experts' forward at 231 × 256 × 320, cold, on two threads: 1.08-1.13x,
        // pack_b 12% of the samples → 8% (docs/PERF.md, session 38).
        if (kq % kLineFloats == 0)
          for (int64_t q = 0; q < next_rows; ++q)
            __builtin_prefetch(p.B + (j0 + kN + q) * p.ldb + pc + kq);
        V r[kN];
#pragma GCC unroll 16
        for (int q = 0; q < kN; ++q) {
          const float* src = p.B + (j0 + q) * p.ldb + pc + kq;
          if (q >= rows) r[q] = hn::Zero(d);
          else if (kn == kN) r[q] = hn::LoadU(d, src);
          else r[q] = hn::MaskedLoad(hn::FirstN(d, static_cast<size_t>(kn)), d, src);
        }
        transpose_square(r);
        for (int64_t q = 0; q < kn; ++q) hn::Store(r[q], d, panel + (kq + q) * kNr + v * kN);
      }
    }
  }
}

// A micro-panel (rows [i0, i0 + MR), k in [pc, pc + kc)) is packed so that both ways A is stored
// become a copy, never a transposition:
//  * tn (A's rows are k): k-major, out[k·MR + i];
//  * nt, nn (A's rows are i): chunks of kChunk k's per row, rows side by side per chunk,
//    out[(k / kChunk)·MR·kChunk + i·kChunk + k % kChunk].
// Either way the kernel's broadcasts walk one contiguous stream.
constexpr int64_t kChunk = 16;
// Rows (k's) per packing item where an operand's rows are k: tn's A, nn's and tn's B.
constexpr int64_t kPackRows = 32;

template <int MR>
void pack_a_rows(const Problem& p, int64_t i0, int64_t pc, int64_t kc, float* out) {
  const D d;
  for (int i = 0; i < MR; ++i) {
    const float* src = p.A + (i0 + i) * p.lda + pc;
    float* dst = out + i * kChunk;
    int64_t k = 0;
    for (; k + kChunk <= kc; k += kChunk, dst += MR * kChunk)
      for (int64_t v = 0; v < kChunk; v += kN) hn::Store(hn::LoadU(d, src + k + v), d, dst + v);
    for (int64_t v = 0; k + v < kc; v += kN) {
      const auto m = hn::FirstN(d, static_cast<size_t>(kc - k - v));
      hn::Store(hn::MaskedLoad(m, d, src + k + v), d, dst + v);
    }
  }
}

// ------------------------------------------------------------------------------ micro-kernel

// Where the micro-kernel's broadcasts of A come from: a packed micro-panel in chunks of
// kChunk k's per row (nt, nn), a k-major packed micro-panel (tn), or A's rows themselves at
// stride lda (nt, nn where rows_in_place).
enum class AFrom { Panel, KMajorPanel, InPlace };

// How far ahead in packed B the AVX-512 micro-kernel prefetches, in rows of kNr floats.
constexpr int64_t kBAheadRows = 16;

// How many of a B panel's kNr columns a micro-kernel call computes: all of them; `cols` of them
// with masked loads and stores; or at most kN of them with one vector per row, so that a last
// panel of a few columns (a transposed product's last tokens, a LoRA rank of 16) costs half the
// multiply-adds: the experts' forward with 200 and 208 tokens each (remainders of 8 and 16)
// went from 225-238 to 235-254 GFLOP/s on AVX-512 (docs/PERF.md, session 32). The chains, and
// so the bits, are the same whichever computes a column.
enum class Width { Part, Full, Half };

// A register tile of MR rows × kV vectors of C at c (row stride ldc): the first `cols` columns
// (masks per vector), all of them when kFull. Loops are fully unrolled (constant trip counts),
// so the accumulators live in registers.
template <int kV>
HWY_INLINE void column_masks(int64_t cols, hn::Mask<D>* mask) {
  for (int v = 0; v < kV; ++v)
    mask[v] = hn::FirstN(D(), static_cast<size_t>(std::clamp<int64_t>(cols - v * kN, 0, kN)));
}
template <int MR, int kV, bool kFull>
HWY_INLINE void load_tile(V (*acc)[kV], const float* c, int64_t ldc, const hn::Mask<D>* mask,
                          bool load_c) {
  const D d;
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 24
    for (int v = 0; v < kV; ++v) {
      const float* src = c + i * ldc + v * kN;
      if (!load_c) acc[i][v] = hn::Zero(d);
      else if constexpr (kFull) acc[i][v] = hn::LoadU(d, src);
      else acc[i][v] = hn::MaskedLoad(mask[v], d, src);
    }
}
template <int MR, int kV, bool kFull>
HWY_INLINE void store_tile(const V (*acc)[kV], float* c, int64_t ldc, const hn::Mask<D>* mask) {
  const D d;
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 24
    for (int v = 0; v < kV; ++v) {
      float* dst = c + i * ldc + v * kN;
      if constexpr (kFull) hn::StoreU(acc[i][v], d, dst);
      else hn::BlendedStore(acc[i][v], mask[v], d, dst);
    }
}

// One k of the tile's chains: kV vectors of B's row (aligned: a packed panel) against the
// broadcasts of a(i) = a_col[i·stride].
template <int MR, int kV, bool kFull, bool kAligned>
HWY_INLINE void tile_step(V (*acc)[kV], const float* HWY_RESTRICT b_row,
                          const float* HWY_RESTRICT a_col, int64_t stride, const hn::Mask<D>* mask) {
  const D d;
  V b[kV];
#pragma GCC unroll 24
  for (int v = 0; v < kV; ++v) {
    if constexpr (!kFull) b[v] = hn::MaskedLoad(mask[v], d, b_row + v * kN);
    else if constexpr (kAligned) b[v] = hn::Load(d, b_row + v * kN);
    else b[v] = hn::LoadU(d, b_row + v * kN);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    const V a = hn::Set(d, a_col[i * stride]);
#pragma GCC unroll 24
    for (int v = 0; v < kV; ++v) acc[i][v] = hn::MulAdd(a, b[v], acc[i][v]);
  }
}

// C[0..MR, 0..cols) (+)= Ap · Bp over kc, for one packed A micro-panel and one packed B panel
// (rows of kNr floats). `load_c`: continue the chains stored in C (a later K block, or
// accumulate); else start at +0.
template <int MR, AFrom kA, Width kWidth>
HWY_NOINLINE void micro_kernel(const float* HWY_RESTRICT ap, const float* HWY_RESTRICT bp,
                               int64_t kc, float* c, int64_t ldc, bool load_c, int64_t cols,
                               int64_t lda) {
  const D d;
  constexpr bool kFull = kWidth == Width::Full;
  constexpr int kV = kWidth == Width::Half ? 1 : kNv;  // vectors per row
  hn::Mask<D> mask[kV];
  column_masks<kV>(cols, mask);
  V acc[MR][kV];
  load_tile<MR, kV, kFull>(acc, c, ldc, mask, load_c);
  // One step of the chains: a B row against the broadcasts of a(i) = a_col[i·stride].
  auto step = [&](const float* HWY_RESTRICT b_row, const float* HWY_RESTRICT a_col, int64_t stride) {
    // AVX-512: the B row kBAheadRows further on (2 KiB; past the panel's end, the start of the
    // next panel, which the next call reads) is fetched into L1 now. Each k reads two lines of
    // B, and where the B slice is not yet in L2 (its first micro-panel, or an expert's weights
    // packed just before) the loads waited on L3. 2048³ on two threads, 8 alternated rounds:
    // nt and nn ahead in all, tn in 5 (one level), 1.02-1.07x in means; `bench_moe`'s expert
    // forward and train step 1.04x and 1.03x in means of 10 rounds; 512³ on one thread (B in
    // L2) and the `small` model level. AVX2 (one line per k) was level or slower with it
    // (docs/PERF.md, session 30). Inline: GCC deletes calls to a function that only prefetches.
    if constexpr (kN == 16)
#pragma GCC unroll 4
      for (int64_t v = 0; v < kV * kN; v += kLineFloats)
        __builtin_prefetch(b_row + kBAheadRows * kNr + v);
    tile_step<MR, kV, kFull, /*kAligned=*/true>(acc, b_row, a_col, stride, mask);
  };
  if constexpr (kA == AFrom::InPlace) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) step(bp + k * kNr, ap + k, lda);
  } else if constexpr (kA == AFrom::KMajorPanel) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) step(bp + k * kNr, ap + k * MR, 1);
  } else {
    for (int64_t k0 = 0; k0 < kc; k0 += kChunk) {
      const float* a_chunk = ap + k0 * MR;
      const float* b_chunk = bp + k0 * kNr;
      const int64_t n = std::min(kChunk, kc - k0);
#pragma GCC unroll 4
      for (int64_t k = 0; k < n; ++k) step(b_chunk + k * kNr, a_chunk + k, kChunk);
    }
  }
  store_tile<MR, kV, kFull>(acc, c, ldc, mask);
}

template <int... I>
constexpr auto pack_a_table(std::integer_sequence<int, I...>) {
  return std::array<void (*)(const Problem&, int64_t, int64_t, int64_t, float*), sizeof...(I)>{
      &pack_a_rows<I + 1>...};
}
using MicroKernelFn = void (*)(const float*, const float*, int64_t, float*, int64_t, bool, int64_t,
                               int64_t);
template <AFrom kA, Width kWidth, int... I>
constexpr auto micro_kernel_table(std::integer_sequence<int, I...>) {
  return std::array<MicroKernelFn, sizeof...(I)>{&micro_kernel<I + 1, kA, kWidth>...};
}
constexpr auto kPackA = pack_a_table(std::make_integer_sequence<int, kMr>{});
template <AFrom kA>
constexpr std::array<std::array<MicroKernelFn, kMr>, 3> kernels_for() {
  return {micro_kernel_table<kA, Width::Part>(std::make_integer_sequence<int, kMr>{}),
          micro_kernel_table<kA, Width::Full>(std::make_integer_sequence<int, kMr>{}),
          micro_kernel_table<kA, Width::Half>(std::make_integer_sequence<int, kMr>{})};
}
// [AFrom][Width][rows - 1]
const std::array<std::array<std::array<MicroKernelFn, kMr>, 3>, 3> kMicroKernels = {
    kernels_for<AFrom::Panel>(), kernels_for<AFrom::KMajorPanel>(), kernels_for<AFrom::InPlace>()};

// Floats per packed A micro-panel.
constexpr int64_t kAPanel = kMr * kKc;

// tn's micro-panels of rows [i0, i1) (panel q at out + q·panel_floats), k-major, for the k's
// [k0, k1) of the K block at pc.
void pack_a_k_major(const Problem& p, int64_t i0, int64_t i1, int64_t pc, int64_t k0, int64_t k1,
                    int64_t panel_floats, float* out) {
  // k outer: each A row (a k) is read once, front to back, across all the panels. Full panels
  // copy kMr floats with a fixed-size copy (a vector or two); the last one may be narrower.
  const int64_t full = (i1 - i0) / kMr, rest = (i1 - i0) % kMr;
  const float* src = p.A + (pc + k0) * p.lda + i0;
  for (int64_t k = k0; k < k1; ++k, src += p.lda) {
    for (int64_t q = 0; q < full; ++q)
      std::memcpy(out + q * panel_floats + k * kMr, src + q * kMr, sizeof(float) * kMr);
    if (rest)
      std::memcpy(out + full * panel_floats + k * rest, src + full * kMr,
                  sizeof(float) * static_cast<size_t>(rest));
  }
}

// Packs the micro-panels of rows [i0, i1) (panel q at out + q·kAPanel) for k in [pc, pc + kc).
void pack_a(const Problem& p, int64_t i0, int64_t i1, int64_t pc, int64_t kc, float* out) {
  if (p.layout == Layout::TN) return pack_a_k_major(p, i0, i1, pc, 0, kc, kAPanel, out);
  for (int64_t i = i0, q = 0; i < i1; i += kMr, ++q)
    kPackA[static_cast<size_t>(std::min<int64_t>(kMr, i1 - i) - 1)](p, i, pc, kc,
                                                                    out + q * kAPanel);
}

// tn's A packed once for all tasks, by all threads together, as B is (null abuf: each task packs
// its own): per K block, the micro-panels of all M rows from row 0, panel_floats apart.
struct PackedA {
  const float* abuf = nullptr;
  int64_t panels = 0, panel_floats = 0;
  const float* panel(int64_t kb, int64_t i) const {
    return abuf + (kb * panels + i / kMr) * panel_floats;
  }
};

// B of one column block [jc, jc + nc), packed for all of K: panels of kNr columns per K block.
// Packing pays even where B's rows are k already (nn, tn): the kernel then streams contiguous
// panels, never B rows at a large power-of-two stride that would share a few cache sets.
struct PackedB {
  const float* bbuf;
  int64_t block_floats;  // floats per K block
  int64_t jc, nc;

  // Row k = 0 of K block kb (of kc rows) for the panel starting at column j (j - jc a multiple
  // of kNr).
  const float* panel(int64_t kb, int64_t kc, int64_t j) const {
    return bbuf + kb * block_floats + (j - jc) / kNr * kc * kNr;
  }
};

// C rows [i0, i1) × columns [j0, j1) (j0 - jc a multiple of kNr) over all of K in blocks of kcb:
// per K block, the row block's A micro-panels are packed, then each meets the B panels of one
// slice of the columns after another. A slice's panels (at most kSliceBytes) stay in L2 while
// all the micro-panels pass over them; over a whole column block (2 MiB per K block on AVX-512)
// every micro-panel streamed them from L3 again: 2048³ on two threads of a Zen 5 went from
// 463-476 to 480-484 GFLOP/s (nn, nt) and 457-462 to 470-472 (tn). The C block (≤ kMcTall rows)
// stays in L2 from one K block to the next.
constexpr int64_t kSliceBytes = 512 * 1024;

// How many of the L1's 64 sets the lines at one column of `rows` rows ld floats apart fall in.
int64_t l1_sets_of_rows(int64_t ld, int64_t rows) {
  constexpr int64_t kL1Sets = 64;
  uint64_t sets = 0;
  for (int64_t i = 0; i < rows; ++i) sets |= uint64_t{1} << (i * ld / kLineFloats % kL1Sets);
  return std::popcount(sets);
}

// nt and nn read A's rows in place, without a packed copy, where the kMr rows of a
// micro-panel spread over at least half as many of the L1's 64 sets (one line of each row is
// live at a time): the copy was 7.6% of a `small` training step, which runs 1-2% faster
// without it. A row stride near a multiple of 4 KiB puts the rows in a few sets, where B's
// stream evicts them: 2048³ (nt, nn) with its rows in place ran 0.66-0.68 of the FMA peak
// against 0.65-0.74 copied, so those strides keep the copy (docs/PERF.md, session 27).
bool rows_in_place(int64_t lda) { return l1_sets_of_rows(lda, kMr) >= kMr / 2; }

// The C tile at (i, j) of the next micro-kernel call (rows below i1, columns below j1), fetched
// for writing while this call runs. Its kMr rows lie a row stride apart, often in memory (a
// fresh output) or where large strides crowd a few cache sets, and the call's first k's would
// wait for them. Expert-shaped products on cold operands (256 × 256 × 320) ran 5-8% faster, the
// `small` model 1.023× the tokens/s (median of 6 alternated pairs), and `bench_moe`'s train step
// 0.543-0.546 → 0.562-0.578 of the FMA peak. Inlined by force: GCC takes a function whose only
// effect is a prefetch for a pure one and deletes its calls, so as a called function this one
// did nothing at all (docs/PERF.md, sessions 28 and 29).
HWY_INLINE void prefetch_c_tile(const Problem& p, int64_t i, int64_t j, int64_t i1, int64_t j1) {
  const int64_t rows = std::min<int64_t>(kMr, i1 - i);
  for (int64_t r = 0; r < rows; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < kNr; v += kLineFloats)
      if (j + v < j1) __builtin_prefetch(p.C + (i + r) * p.ldc + j + v, /*rw=*/1);
}

// A transposed problem's C block (rows [i0, i1) × columns [j0, j1), at `block` with row stride
// ld) from and to C, where C(i, j) lies at C[j·ldc + i]: kN × kN squares transposed in
// registers. A tile's kNr columns are as many rows of the caller's C, each written kMr floats at
// a time, so tiles stay in the block until their last K block, and only then go out: storing
// and reloading them transposed on every K block made the transposed products no faster.
void load_block_transposed(const Problem& p, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                           float* block, int64_t ld) {
  const D d;
  for (int64_t j = j0; j < j1; j += kN)
    for (int64_t i = i0; i < i1; i += kN) {
      const int64_t cols = std::min(kN, j1 - j), rows = std::min(kN, i1 - i);
      const auto lanes = hn::FirstN(d, static_cast<size_t>(cols));
      with_transposed_square(p.C + j * p.ldc + i, p.ldc, cols, rows, [&](const V* r) {
        for (int64_t q = 0; q < rows; ++q)
          hn::BlendedStore(r[q], lanes, d, block + (i - i0 + q) * ld + (j - j0));
      });
    }
}

void store_block_transposed(const Problem& p, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                            const float* block, int64_t ld) {
  const D d;
  for (int64_t j = j0; j < j1; j += kN)
    for (int64_t i = i0; i < i1; i += kN) {
      const int64_t cols = std::min(kN, j1 - j), rows = std::min(kN, i1 - i);
      const auto lanes = hn::FirstN(d, static_cast<size_t>(rows));
      with_transposed_square(block + (i - i0) * ld + (j - j0), ld, rows, cols, [&](const V* r) {
        for (int64_t c = 0; c < cols; ++c)
          hn::BlendedStore(r[c], lanes, d, p.C + (j + c) * p.ldc + i);
      });
    }
}

// The lines of the caller's C that the transposed tile at (i, j) will write (kNr rows of C from
// j, kMr floats each from i), fetched for writing while the call before it runs.
HWY_INLINE void prefetch_c_tile_transposed(const Problem& p, int64_t i, int64_t j, int64_t i1,
                                           int64_t j1) {
  if (i >= i1) return;
  const int64_t last = std::min(i1, i + kMr) - 1;
  for (int64_t c = 0; c < std::min(kNr, j1 - j); ++c) {
    float* row = p.C + (j + c) * p.ldc;
    __builtin_prefetch(row + i, /*rw=*/1);
    __builtin_prefetch(row + last, /*rw=*/1);  // kMr floats may cross into the next line
  }
}

// Part `part` of `parts` of the lines that rows [i, i + rows) of an in-place A span over k in
// [k0, k0 + kc), fetched while the current micro-panel's calls run. The kernel reads those rows
// straight from wherever they are, and a micro-panel's first call otherwise waits on its 6 rows
// from DRAM one line at a time per row (a fresh expert's tokens, or its weights in a transposed
// product): the experts' forward of the `small` model (231 × 256 × 320, cold, on two threads)
// 1.08x, 512 × 256 × 320 1.05x (docs/PERF.md, session 38).
HWY_INLINE void prefetch_a_rows(const Problem& p, int64_t i, int64_t rows, int64_t k0, int64_t kc,
                                int64_t part, int64_t parts) {
  // A row's span starts anywhere in a line, so it touches at most one line more than kc floats.
  const int64_t row_lines = ceil_div(kc, kLineFloats) + 1, lines = rows * row_lines;
  const int64_t per = ceil_div(lines, parts), begin = part * per;
  int64_t row = begin / row_lines, at = begin % row_lines;  // one division per call
  for (int64_t l = begin; l < std::min(lines, begin + per); ++l) {
    const auto line = reinterpret_cast<uintptr_t>(p.A + (i + row) * p.lda + k0) / 64;
    __builtin_prefetch(reinterpret_cast<const void*>((line + static_cast<uintptr_t>(at)) * 64));
    if (++at == row_lines) at = 0, ++row;
  }
}

void compute_block(const Problem& p, const PackedB& b, const PackedA& a, int64_t kcb, int64_t i0,
                   int64_t i1, int64_t j0, int64_t j1, float* abuf, float* cbuf) {
  const bool k_major = p.layout == Layout::TN;
  const bool in_place = !k_major && rows_in_place(p.lda);
  const AFrom from = in_place ? AFrom::InPlace : k_major ? AFrom::KMajorPanel : AFrom::Panel;
  const int64_t panels = ceil_div(j1 - j0, kNr);
  // C(i0, j0) of the tiles: C itself, or a transposed problem's block in cbuf.
  const int64_t ldc = p.c_transposed ? round_up(j1 - j0, kN) : p.ldc;
  float* const c0 = p.c_transposed ? cbuf : p.C + i0 * p.ldc + j0;
  if (p.c_transposed && p.accumulate) load_block_transposed(p, i0, i1, j0, j1, cbuf, ldc);
  for (int64_t pc = 0, kb = 0; pc < p.K; pc += kcb, ++kb) {
    const int64_t kc = std::min(kcb, p.K - pc);
    const bool load_c = p.accumulate || pc > 0;
    // Slices of equal width (in panels), each within kSliceBytes of packed B.
    const int64_t panel_bytes = kc * kNr * kFloatBytes;
    const int64_t most = std::max<int64_t>(1, kSliceBytes / panel_bytes);
    const int64_t slice = ceil_div(panels, ceil_div(panels, most)) * kNr;
    if (!in_place && !a.abuf) pack_a(p, i0, i1, pc, kc, abuf);
    const bool last = pc + kc >= p.K;
    for (int64_t js = j0; js < j1; js += slice) {
      const int64_t je = std::min(j1, js + slice);
      for (int64_t i = i0, q = 0; i < i1; i += kMr, ++q) {
        const size_t rows = static_cast<size_t>(std::min<int64_t>(kMr, i1 - i) - 1);
        const float* ap = in_place ? p.A + i * p.lda + pc
                          : a.abuf ? a.panel(kb, i) : abuf + q * kAPanel;
        for (int64_t j = js; j < je; j += kNr) {
          const int64_t cols = std::min(kNr, j1 - j);
          const bool slice_row_ends = j + kNr >= je;  // the next call starts the next row
          const int64_t next_i = slice_row_ends ? i + kMr : i;
          const int64_t next_j = slice_row_ends ? js : j + kNr;
          // A transposed problem's tiles live in cbuf, in L1 or L2, until their last K block.
          if (!p.c_transposed) prefetch_c_tile(p, next_i, next_j, i1, je);
          else if (last) prefetch_c_tile_transposed(p, next_i, next_j, i1, je);
          // The next micro-panel's rows of A, over the first slice's calls: the rows below in
          // this K block, or after the last of them the block's first rows in the next K block.
          if (in_place && js == j0) {
            const int64_t part = (j - js) / kNr, parts = ceil_div(je - js, kNr);
            if (i + kMr < i1)
              prefetch_a_rows(p, i + kMr, std::min<int64_t>(kMr, i1 - i - kMr), pc, kc, part,
                              parts);
            else if (!last)
              prefetch_a_rows(p, i0, std::min<int64_t>(kMr, i1 - i0), pc + kc,
                              std::min(kcb, p.K - pc - kc), part, parts);
          }
          float* const tile = c0 + (i - i0) * ldc + (j - j0);
          const Width width = cols == kNr ? Width::Full : cols <= kN ? Width::Half : Width::Part;
          kMicroKernels[static_cast<int>(from)][static_cast<int>(width)][rows](
              ap, b.panel(kb, kc, j), kc, tile, ldc, load_c, cols, p.lda);
          // A finished transposed tile goes out now, its stores draining while the next call
          // computes; at the block's end they would all wait on C's lines at once.
          if (p.c_transposed && last)
            store_block_transposed(p, i, i + static_cast<int64_t>(rows) + 1, j, j + cols, tile,
                                   ldc);
        }
      }
    }
  }
}

// Column blocks of B (packed once for all of K by all threads together, then shared) are cut,
// with the rows, into tasks (row blocks, and column parts when rows alone give too few) that
// threads take dynamically. Any cut gives the same bits, so it is chosen for speed:
// enough tasks to balance, few enough to keep A panels reused.
// The blocking of one run() (one slice of K): K blocks of kcb, column blocks of nc_max, each
// packed for all K blocks into k_blocks·block_floats floats.
struct Blocking {
  int64_t k_blocks, kcb, nc_max, block_floats;
};
Blocking blocking(int64_t N, int64_t K, int64_t max_packed_b) {
  const int64_t k_blocks = ceil_div(K, kKc);
  const int64_t kcb = std::min(kKc, round_up(ceil_div(K, k_blocks), 16));
  const int64_t nc_max = std::clamp(max_packed_b / (k_blocks * kcb) / kNr * kNr, kNr, kNc);
  return {k_blocks, kcb, nc_max, kcb * std::min(nc_max, round_up(N, kNr))};
}
// A panels of one task (slot 1; a transposed problem's C block follows them).
constexpr int64_t kAPanelsFloats = ceil_div(kMcTall, kMr) * kAPanel;

// Whether a column block of packed B overflows half the L2; row blocks are tall there.
bool overflows_half_l2(const Blocking& b) {
  return b.k_blocks * b.block_floats * kFloatBytes > l2_cache_bytes() / 2;
}
int64_t row_block(const Blocking& b) { return overflows_half_l2(b) ? tall_rows() : kMcShort; }
// Floats of a transposed problem's C block (slot 1, after the A panels): a row block by a column
// block, rows padded to whole vectors as compute_block lays them out.
int64_t c_block_floats(const Blocking& b, int64_t N) {
  return row_block(b) * round_up(std::min(b.nc_max, N), kN);
}

// tn's A is packed once for all tasks (PackedA, after packed B in slot 0), by all threads
// together, where it is at most a quarter of max_packed_b: a weight gradient over many tokens
// with few output rows. A task packing its own rows reads 4-16 micro-panels' worth of each A
// row (a k), one row after another at A's full stride, and again for each column part; packed
// once, A is read whole rows at a time. M = 256, N = 320, K = 2048 (the `small` model's shared
// expert) on two threads: 240-249 GFLOP/s packed per task, 273-276 packed once (medians of 200
// calls); M = 1024 level (docs/PERF.md, session 28). On one thread, an expert's weight gradient
// (256 × 320 × 231, cold): 1.10x, 320 × 256 × 231 1.27x (session 38). Floats of that copy; 0
// where tasks pack their own.
int64_t shared_a_floats(Layout layout, int64_t M, const Blocking& b, int64_t max_packed_b) {
  const int64_t floats = round_up(M, kMr) * b.k_blocks * b.kcb;
  return layout == Layout::TN && floats <= max_packed_b / 4 ? floats : 0;
}

// Items [0, n) on all threads (a static or a dynamic schedule), or one after another on the
// calling thread for a call that runs on one: that may be the main thread outside any loop,
// where parallel_for would wake the others.
template <class F>
void for_items(int threads, int64_t n, bool dynamic, const F& body) {
  if (threads <= 1)
    for (int64_t i = 0; i < n; ++i) body(i);
  else if (dynamic)
    parallel_for_dynamic(0, n, body);
  else
    parallel_for(0, n, body);
}

void run(const Problem& p, int threads, int64_t max_packed_b) {
  const Blocking blk = blocking(p.N, p.K, max_packed_b);
  const auto [k_blocks, kcb, nc_max, block_floats] = blk;
  const int64_t a_floats = shared_a_floats(p.layout, p.M, blk, max_packed_b);
  float* bbuf = kernel_scratch(0, k_blocks * block_floats + a_floats);
  float* const abuf = a_floats ? bbuf + k_blocks * block_floats : nullptr;
  const PackedA a{abuf, ceil_div(p.M, kMr), kcb * kMr};
  if (abuf) {
    // Items of kPackRows rows of A (k's), each read whole, front to back.
    const int64_t per_block = ceil_div(kcb, kPackRows);
    auto pack_a_item = [&](int64_t item) {
      const int64_t kb = item / per_block, k0 = item % per_block * kPackRows;
      const int64_t kc = std::min(kcb, p.K - kb * kcb);
      if (k0 < kc)
        pack_a_k_major(p, 0, p.M, kb * kcb, k0, std::min(kc, k0 + kPackRows), a.panel_floats,
                       abuf + kb * a.panels * a.panel_floats);
    };
    for_items(threads, k_blocks * per_block, /*dynamic=*/false, pack_a_item);
  }
  const int64_t mc = row_block(blk);
  const int64_t c_floats = p.c_transposed ? c_block_floats(blk, p.N) : 0;
  // The last rows, 2·threads short blocks, end the loop (below); the rest are blocks of mc. Blocks
  // start at whole micro-panels, where a shared A's panels do.
  const int64_t head_m =
      (p.M - (threads > 1 ? std::min(p.M, 2 * int64_t{threads} * kMcShort) : 0)) / kMr * kMr;
  const int64_t tail_m = p.M - head_m;
  const int64_t head_blocks = ceil_div(head_m, mc), tail_blocks = ceil_div(tail_m, kMcShort);
  for (int64_t jc = 0; jc < p.N; jc += nc_max) {
    const PackedB b{bbuf, block_floats, jc, std::min(nc_max, p.N - jc)};
    const int64_t panels = ceil_div(b.nc, kNr);
    // Packing items: for nn and tn, kPackRows rows of a K block across all the panels, each
    // read front to back as one stream; for nt, kPackGroup panels over a whole K block, each
    // reading its kNr rows of B along k. Items of 4 panels over a whole block read nn's and tn's
    // B 4 lines of each row at a time, every row again per item: by rows, tn 256 × 320 × 2048
    // on two threads ran 1.07x faster (medians of 40 alternated calls), 1024 × 320 × 2048 1.03x,
    // nn 2048 × 320 × 256 1.02x; on one thread an expert's tn 256 × 320 × 231 1.07x and nn
    // 231 × 320 × 256 1.08x (docs/PERF.md, session 38).
    constexpr int64_t kPackGroup = 4;
    const bool by_rows = p.layout != Layout::NT;
    const int64_t per_block = by_rows ? ceil_div(kcb, kPackRows) : ceil_div(panels, kPackGroup);
    auto pack_item = [&](int64_t item) {
      const int64_t kb = item / per_block, part = item % per_block;
      const int64_t kc = std::min(kcb, p.K - kb * kcb);
      float* const out = bbuf + kb * block_floats;
      if (!by_rows)
        pack_b(p, kb * kcb, kc, b.jc, b.nc, part * kPackGroup,
               std::min(panels, (part + 1) * kPackGroup), 0, kc, out);
      else if (part * kPackRows < kc)
        pack_b(p, kb * kcb, kc, b.jc, b.nc, 0, panels, part * kPackRows,
               std::min(kc, (part + 1) * kPackRows), out);
    };
    // Tasks are taken in order: the head's row blocks whole (or in column parts when rows alone
    // give too few tasks), then the tail's short row blocks cut in column parts of about 4
    // panels, so the loop does not end waiting on one thread's whole row block (hundreds of µs
    // at the LM head's width).
    auto parts_of = [&](int64_t n) {
      const int64_t width = ceil_div(panels, n) * kNr;
      return std::pair{ceil_div(b.nc, width), width};
    };
    int64_t want = 1;
    while (threads > 1 && (head_blocks + tail_blocks) * want < 4 * threads && want < panels) ++want;
    const auto [col_parts, part] = parts_of(want);
    const auto [tail_parts, tail_part] = parts_of(std::max(col_parts, ceil_div(panels, 4)));
    const int64_t head_tasks = head_blocks * col_parts;
    auto task = [&](int64_t t) {
      const bool tail = t >= head_tasks;
      const int64_t n = tail ? tail_parts : col_parts, width = tail ? tail_part : part;
      const int64_t r = (tail ? t - head_tasks : t) / n, c = (tail ? t - head_tasks : t) % n;
      const int64_t i0 = tail ? head_m + r * kMcShort : r * mc;
      const int64_t i1 = tail ? std::min(p.M, i0 + kMcShort) : std::min(head_m, i0 + mc);
      float* const scratch = kernel_scratch(1, kAPanelsFloats + c_floats);
      compute_block(p, b, a, kcb, i0, i1, b.jc + c * width,
                    std::min(b.jc + b.nc, b.jc + (c + 1) * width), scratch,
                    scratch + kAPanelsFloats);
    };
    const int64_t tasks = head_tasks + tail_blocks * tail_parts;
    for_items(threads, k_blocks * per_block, /*dynamic=*/false, pack_item);
    for_items(threads, tasks, /*dynamic=*/true, task);
  }
}

// A K longer than max_k runs as consecutive slices of K, each continuing the chains the previous
// one left in C, so packed B stays at most max_packed_b floats with column blocks at least 8
// panels wide however long K is (a weight gradient over many tokens).
int64_t slice_k(int64_t max_packed_b) { return max_packed_b / (8 * kNr); }

void run_sliced(const Problem& p, int threads, int64_t max_packed_b) {
  const int64_t max_k = slice_k(max_packed_b);
  for (int64_t k0 = 0; k0 < p.K; k0 += max_k) {
    Problem q = p;
    q.K = std::min(max_k, p.K - k0);
    q.accumulate = p.accumulate || k0 > 0;
    q.A = p.layout == Layout::TN ? p.A + k0 * p.lda : p.A + k0;
    if (!p.rows) q.B = p.layout == Layout::NT ? p.B + k0 : p.B + k0 * p.ldb;
    q.rows_k0 = p.rows_k0 + k0;
    run(q, threads, max_packed_b);
  }
}

// ------------------------------------------------------------------------------ skinny nt

// y = x·Wᵀ for a few rows of x (decoding: one token per sequence): packing W would read it,
// write a copy and read that again, while the product itself reads each weight once. Instead
// each task walks kN rows of W (output columns j) along k: a kN × kN square of W is loaded and
// transposed in registers (as pack_b does), and each of its k's feeds one FMA per row of x into
// accumulators whose lanes are the columns j — the same chain per C(i, j), in the same k order.
constexpr int64_t kSkinnyRows = 4;

// How far along K (floats) a group of `rows` rows of B that walks K in lockstep fetches the next
// group's rows: at the same k, unless the lines of both groups at one k would crowd fewer L1 sets
// than one group has rows; then half of K further on.
int64_t next_lines_ahead(int64_t ldb, int64_t rows, int64_t K) {
  return l1_sets_of_rows(ldb, 2 * rows) < rows ? round_up(K / 2, kLineFloats) : 0;
}

template <int M>
void skinny_columns(const Problem& p, int64_t j0) {
  const D d;
  const int64_t rows = std::min(kN, p.N - j0);
  const auto col_mask = hn::FirstN(d, static_cast<size_t>(rows));
  // The loops over the M rows are unrolled by force: left to GCC, the 3- and 4-row kernels kept
  // acc on the stack, a load and a store around every FMA (AVX2 and AVX-512 alike), and ran at
  // 0.55-0.7 of the speed (docs/PERF.md, session 40).
  V acc[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
    acc[i] = p.accumulate ? hn::MaskedLoad(col_mask, d, p.C + i * p.ldc + j0) : hn::Zero(d);
  // The next group's kN rows are fetched a line each as this group passes the same k's. A
  // group reads kN rows in lockstep, each row often a page or less, where the hardware
  // prefetchers barely start before it ends: M = 1 over 2048 × 1024 matrices from DRAM read
  // 10.4 GB/s without this, 12.3 with it, and a 20-layer model decoded 39.3-40.2 tokens/s
  // without, 42.2-44.3 with (docs/PERF.md, session 29). Prefetching each row further along
  // itself instead made decoding slower. Where the two groups' lines at one k crowd a few L1
  // sets (a row stride of a multiple of 1 KiB: K = 1024, 2048, 7168), the next group's lines
  // are fetched half a row further on (wrapping), or they would evict the lines being read: M =
  // 1-4 against 704 × 1024 weights from DRAM ran 1.25-1.35x faster (docs/PERF.md, session 41).
  // Written inline: GCC deletes calls to a function that only prefetches.
  const int64_t next_rows = std::clamp<int64_t>(p.N - j0 - kN, 0, kN);
  const float* next = next_rows > 0 ? p.B + (j0 + kN) * p.ldb : p.B;
  const int64_t ahead = next_lines_ahead(p.ldb, kN, p.K), wrap = round_up(p.K, kLineFloats);
  for (int64_t k0 = 0; k0 < p.K; k0 += kN) {
    const int64_t kn = std::min(kN, p.K - k0);
    if (k0 % kLineFloats == 0)
      for (int64_t q = 0; q < next_rows; ++q)
        __builtin_prefetch(next + q * p.ldb + (k0 + ahead) % wrap);
    with_transposed_square(p.B + j0 * p.ldb + k0, p.ldb, rows, kn, [&](const V* r) {
#pragma GCC unroll 16
      for (int64_t q = 0; q < kN; ++q)
        if (q < kn)
#pragma GCC unroll 8
          for (int i = 0; i < M; ++i)
            acc[i] = hn::MulAdd(hn::Set(d, p.A[i * p.lda + k0 + q]), r[q], acc[i]);
    });
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) hn::BlendedStore(acc[i], col_mask, d, p.C + i * p.ldc + j0);
}

// The N rows of B in groups of `rows` (from j0 = 0, rows, 2·rows, ...) handed to group(j0), four
// groups per task: the nt paths that read B's rows in place.
template <class F>
void for_row_groups(const Problem& p, int threads, int64_t rows, const F& group) {
  constexpr int64_t kGroupsPerTask = 4;
  const int64_t groups = ceil_div(p.N, rows), tasks = ceil_div(groups, kGroupsPerTask);
  for_items(threads, tasks, /*dynamic=*/false, [&](int64_t t) {
    for (int64_t g = t * kGroupsPerTask; g < std::min(groups, (t + 1) * kGroupsPerTask); ++g)
      group(g * rows);
  });
}

template <int M>
void run_skinny(const Problem& p, int threads) {
  for_row_groups(p, threads, kN, [&](int64_t j0) { skinny_columns<M>(p, j0); });
}

// ------------------------------------------------------------------------------ few rows nt

// y = x·Wᵀ for 5 to kNr rows of x (a few sequences decoded together, an expert's few tokens):
// too many rows for skinny_columns' accumulators, and packing W would read it, write a copy and
// read that again for a few multiply-adds per weight. Here the vectors run across the rows of x
// instead: x is copied k-major once per call (xt, kV vectors per k, zeros past M), and W's rows
// are read in place, one broadcast per weight, against the xt vectors of that k. A group of kFewW
// W rows walks K in lockstep: per k, kV xt loads and kFewW broadcasts feed kFewW · kV FMAs, with
// no transposition of W at all. The accumulators are columns j of C (lanes: rows i), so C goes
// in and out through a small tile; each C(i, j) is still the one chain over k in order
// (fma(w, x, c) = fma(x, w, c) bit for bit). Against the packed path (and the transposed one at
// kNr rows), W from DRAM, two threads on AVX2: 704 × 1024 weights 1.7-2.3x at 5-12 rows and
// 1.5-2.0x at 16; gemm_nt of 8 rows against 4096 × 1024 2.1-3.9x (docs/PERF.md, session 41).
// Six W rows: where the row stride is a multiple of 4 KiB (K = 1024, 2048, 7168) the six lines
// being read share one L1 set, and the 8-way sets leave room for little else (twelve rows ran
// at half the speed there, and no faster elsewhere).
constexpr int64_t kFewW = 6;
// K is walked in slices that keep xt within a quarter of a 512 KiB L2 (the chains continue
// through C from one slice to the next).
constexpr int64_t kFewSliceBytes = 128 * 1024;

template <int kV, int kJ>
HWY_INLINE void few_rows_group(const Problem& p, const float* HWY_RESTRICT xt, int64_t j0,
                               int64_t kn, bool load_c) {
  const D d;
  constexpr int64_t kLanes = kV * kN;
  const int64_t rows = std::min<int64_t>(kJ, p.N - j0);
  alignas(64) float tile[kJ][kLanes];
  V acc[kJ][kV];
  if (load_c) {
    for (int64_t r = 0; r < kJ; ++r)
      for (int64_t i = 0; i < kLanes; ++i)
        tile[r][i] = r < rows && i < p.M ? p.C[i * p.ldc + j0 + r] : 0.0f;
  }
#pragma GCC unroll 16
  for (int r = 0; r < kJ; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kV; ++v) acc[r][v] = load_c ? hn::Load(d, tile[r] + v * kN) : hn::Zero(d);
  // Rows past N repeat the last one (their columns are not stored).
  const float* w[kJ];
  for (int64_t r = 0; r < kJ; ++r) w[r] = p.B + (j0 + std::min<int64_t>(r, rows - 1)) * p.ldb;
  const int64_t next_rows = std::clamp<int64_t>(p.N - j0 - kJ, 0, kJ);
  const float* next = p.B + (j0 + (next_rows > 0 ? kJ : 0)) * p.ldb;
  // The next group's rows are fetched a line each as this group passes its k's (as in
  // skinny_columns, and half a row further on where the rows crowd a few L1 sets: 1.15-1.2x at
  // K = 1024). The k loop runs a line at a time, so the prefetches sit outside the FMA loop:
  // with them inside it behind a test of k, two W pointers lived on the stack.
  const int64_t ahead = next_lines_ahead(p.ldb, kJ, kn), wrap = round_up(kn, kLineFloats);
  for (int64_t k0 = 0; k0 < kn; k0 += kLineFloats) {
    for (int64_t q = 0; q < next_rows; ++q)
      __builtin_prefetch(next + q * p.ldb + (k0 + ahead) % wrap);
    const int64_t k1 = std::min(kn, k0 + kLineFloats);
    for (int64_t k = k0; k < k1; ++k) {
      V x[kV];
#pragma GCC unroll 2
      for (int v = 0; v < kV; ++v) x[v] = hn::Load(d, xt + k * kLanes + v * kN);
#pragma GCC unroll 16
      for (int r = 0; r < kJ; ++r) {
        const V a = hn::Set(d, w[r][k]);
#pragma GCC unroll 2
        for (int v = 0; v < kV; ++v) acc[r][v] = hn::MulAdd(a, x[v], acc[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kJ; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kV; ++v) hn::Store(acc[r][v], d, tile[r] + v * kN);
  for (int64_t i = 0; i < p.M; ++i)
    for (int64_t r = 0; r < rows; ++r) p.C[i * p.ldc + j0 + r] = tile[r][i];
}

// x rows [0, M) × k's [k0, k0 + kn) into xt[k · lanes + i], zeros for i >= M (lanes is M rounded
// up to whole vectors, so every square starts at a real row): kN × kN squares transposed in
// registers.
void pack_x_k_major(const Problem& p, int64_t k0, int64_t kn, int64_t lanes, float* xt) {
  const D d;
  for (int64_t i0 = 0; i0 < lanes; i0 += kN)
    for (int64_t k = 0; k < kn; k += kN) {
      const int64_t rows = std::clamp<int64_t>(p.M - i0, 0, kN), cols = std::min(kN, kn - k);
      with_transposed_square(p.A + i0 * p.lda + k0 + k, p.lda, rows, cols,
                             [&](const V* r) {
                               for (int64_t c = 0; c < cols; ++c)
                                 hn::Store(r[c], d, xt + (k + c) * lanes + i0);
                             });
    }
}

int64_t few_lanes(int64_t M) { return round_up(M, kN); }
int64_t few_slice_k(int64_t M) {
  const int64_t k = std::max<int64_t>(kLineFloats, kFewSliceBytes / kFloatBytes / few_lanes(M));
  return k / kLineFloats * kLineFloats;
}

template <int kV>
void run_few_rows(const Problem& p, int threads) {
  constexpr int64_t kLanes = kV * kN;
  const int64_t slice = few_slice_k(p.M);
  float* xt = kernel_scratch(0, std::min(slice, p.K) * kLanes);
  for (int64_t k0 = 0; k0 < p.K; k0 += slice) {
    const int64_t kn = std::min(slice, p.K - k0);
    pack_x_k_major(p, k0, kn, kLanes, xt);
    Problem q = p;
    q.B = p.B + k0;
    const bool load_c = p.accumulate || k0 > 0;
    for_row_groups(q, threads, kFewW,
                   [&](int64_t j0) { few_rows_group<kV, kFewW>(q, xt, j0, kn, load_c); });
  }
}

// ------------------------------------------------------------------------------ few rows nn

// C (+)= A·B for 1 to 2·kMr rows of A (an input gradient over an expert's few tokens): B's rows
// (the weight's rows, k) are read in place, where the packed path copies B first and then reads
// the copy for a few multiply-adds per weight. The register tile is a group of at most kMr rows
// of A by as many vectors of columns as keep kMr·kNv accumulators (one row: 12 vectors on AVX2),
// so each k reads one contiguous piece of B's row k; K goes in blocks of kFewNnK rows, each
// block's chains handed on through C. Each C(i, j) is the one chain over k in order. Against
// the packed path, two threads on AVX2, weights from DRAM: 704 × 1024 and 1024 × 704 at 1 row
// 1.7-2.1x, 8 rows 1.6-2.1x, 12 rows 1.1-1.6x (docs/PERF.md, session 41).
// 16 rows of B per block: 32 measured 0.87-0.94x on those weights (and 1.1-1.2x on the `small`
// model's 320 × 256, which stay in L3), 8 rows 0.8-0.9x.
constexpr int64_t kFewNnK = 16;
constexpr int64_t kFewNnAcc = kMr * kNv;
template <int MR>
constexpr int few_nn_vectors() { return std::max<int>(kNv, static_cast<int>(kFewNnAcc) / MR); }
constexpr int64_t kFewNnWidest = kFewNnAcc * kN;  // columns of a one-row tile

// Rows [i0, i0 + MR) × columns [j, j + cols) over k in [k0, k0 + kb): B's row k at
// b + (k - k0)·ldb.
// `prefetch`: fetch the same rows' next tile-width of columns as this tile passes them.
template <int MR, bool kFull>
HWY_INLINE void few_nn_tile(const Problem& p, int64_t i0, int64_t j, int64_t cols, int64_t k0,
                            int64_t kb, const float* b, int64_t ldb, bool load_c, bool prefetch) {
  const D d;
  constexpr int kV = few_nn_vectors<MR>();
  hn::Mask<D> mask[kV];
  column_masks<kV>(cols, mask);
  V acc[MR][kV];
  float* const c = p.C + i0 * p.ldc + j;
  load_tile<MR, kV, kFull>(acc, c, p.ldc, mask, load_c);
  const float* a = p.A + i0 * p.lda + k0;
  for (int64_t k = 0; k < kb; ++k, b += ldb) {
    if (prefetch)
#pragma GCC unroll 24
      for (int v = 0; v < kV; v += static_cast<int>(kLineFloats / kN))
        __builtin_prefetch(b + (kV + v) * kN);
    tile_step<MR, kV, kFull, /*kAligned=*/false>(acc, b, a + k, p.lda, mask);
  }
  store_tile<MR, kV, kFull>(acc, c, p.ldc, mask);
}

// One row group across columns [j0, j1) for one K block. B produced a row at a time
// (gemm_nn_serial_rows) goes through a small buffer on the stack, a tile's columns at a time.
template <int MR>
void few_nn_rows(const Problem& p, int64_t i0, int64_t j0, int64_t j1, int64_t k0, int64_t kb,
                 bool load_c, bool prefetch) {
  constexpr int64_t kWidth = few_nn_vectors<MR>() * kN;
  alignas(64) float produced[kFewNnK * kFewNnWidest];
  for (int64_t j = j0; j < j1; j += kWidth) {
    const int64_t cols = std::min(kWidth, j1 - j);
    const float* b = produced;
    int64_t ldb = kWidth;
    if (p.rows) {
      for (int64_t k = 0; k < kb; ++k)
        p.rows->row(p.rows->ctx, p.rows_k0 + k0 + k, j, cols, produced + k * kWidth);
    } else {
      b = p.B + k0 * p.ldb + j, ldb = p.ldb;
    }
    const bool ahead = prefetch && !p.rows;
    if (cols == kWidth) few_nn_tile<MR, true>(p, i0, j, cols, k0, kb, b, ldb, load_c, ahead);
    else few_nn_tile<MR, false>(p, i0, j, cols, k0, kb, b, ldb, load_c, ahead);
  }
}

template <int... I>
constexpr auto few_nn_table(std::integer_sequence<int, I...>) {
  using Fn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool);
  return std::array<Fn, sizeof...(I)>{&few_nn_rows<I + 1>...};
}
const auto kFewNnRows = few_nn_table(std::make_integer_sequence<int, kMr>{});

void run_few_rows_nn(const Problem& p, int threads) {
  // Row groups of at most kMr rows, as even as possible (8 rows: 4 + 4, not 6 + 2).
  const int64_t groups = ceil_div(p.M, kMr);
  // On one thread, whole rows of B per K block: as many sequential streams as the block has
  // rows (1.04-1.2x over parts of 384 columns); on more, parts of 768 columns.
  const int64_t part = threads <= 1 ? p.N : 768;
  const int64_t tasks = ceil_div(p.N, part);
  for_items(threads, tasks, /*dynamic=*/false, [&](int64_t t) {
    const int64_t j0 = t * part, j1 = std::min(p.N, j0 + part);
    for (int64_t k0 = 0; k0 < p.K; k0 += kFewNnK) {
      const int64_t kb = std::min(kFewNnK, p.K - k0);
      const bool load_c = p.accumulate || k0 > 0;
      for (int64_t g = 0, i0 = 0; g < groups; ++g) {
        const int64_t rows = (p.M - i0) / (groups - g);
        kFewNnRows[static_cast<size_t>(rows - 1)](p, i0, j0, j1, k0, kb, load_c, g == 0);
        i0 += rows;
      }
    }
  });
}

bool runs_few_rows(Layout layout, int64_t M) {
  return layout == Layout::NT && M > kSkinnyRows && M <= kNr;
}
// At most two row groups: each group reads the K block of B again (from L1), and a third made
// 16 rows 0.8-0.97x the packed path on two threads against 4096 × 1024 weights. And only where B
// overflows the L2: packing a B that fits costs a pass within the L2, and the packed path then
// writes C once, where this one writes it once per 16 rows of B (the `small` model's 256 × 320
// experts, from L3: 0.5-1.0x).
bool runs_few_rows_nn(Layout layout, int64_t M, int64_t N, int64_t K) {
  return layout == Layout::NN && M <= 2 * kMr && K * N * kFloatBytes > l2_cache_bytes();
}

// nt with few rows of A (tokens) against many of B (weights: an expert's projection) runs
// transposed, Cᵀ = B·Aᵀ, which is again nt: B's rows become the micro-panels the kernel
// broadcasts from, A is what gets packed, and C tiles are transposed on their way out. Where B's
// packed copy overflows half the L2, packing B reads the weights, writes a copy to L3 and reads
// that back for only M rows; transposed, the weights are read once. The experts' forward (64
// experts of 1024 × 704, weights from DRAM, the same rows per expert; docs/PERF.md, session 31):
//   AVX-512: 64 rows 1.25x, 128 rows 1.09-1.11x, 192 rows 1.02x, 256 rows 1.01-1.06x;
//   AVX2:    64 rows 1.23-1.25x, 128 rows 1.08-1.16x, 192 rows level.
// Single products of 384-1000 rows ran level or slower, and 0.95x where the weights fit the L2.
// A contraction of one K block or less loses transposed, as the `small` model's experts do
// (256 × 320 weights): on AVX2, cold, two threads, with the A rows prefetched either way,
// transposed against not: 231 × 256 × 320 0.75x, 231 × 320 × 256 0.76x, 128 × 704 × 320 0.94x,
// against 1.03-1.06x for K = 704 and 1024 (docs/PERF.md, session 38). Each output then costs
// its transposition out of cbuf for only kKc multiply-adds or fewer.
// Each C(i, j) is the same chain, since fma(a, b, c) = fma(b, a, c) bit for bit.
// Below a panel's width of rows, a transposed product's packed A would be mostly padding (and up
// to kNr rows run_few_rows reads W in place: at kNr rows 1.5-2.0x the transposed product).
constexpr int64_t kTransposedMinRows = kNr + 1;
constexpr int64_t kTransposedMaxRows = 256;

bool transposed_pays(Layout layout, int64_t M, int64_t N, int64_t K, int64_t max_packed_b) {
  return layout == Layout::NT && M >= kTransposedMinRows && M <= kTransposedMaxRows && M < N &&
         K > kKc &&
         overflows_half_l2(blocking(N, std::min(K, slice_k(max_packed_b)), max_packed_b));
}

Problem transposed(const Problem& p) {
  return {p.layout, p.N, p.M, p.K, p.B, p.ldb, p.A, p.lda, p.C, p.ldc, p.accumulate, true};
}

void run_any(const Problem& p, int threads, int64_t max_packed_b) {
  if (runs_few_rows(p.layout, p.M))
    return p.M <= kN ? run_few_rows<1>(p, threads) : run_few_rows<2>(p, threads);
  if (runs_few_rows_nn(p.layout, p.M, p.N, p.K)) return run_few_rows_nn(p, threads);
  if (transposed_pays(p.layout, p.M, p.N, p.K, max_packed_b))
    return run_sliced(transposed(p), threads, max_packed_b);
  if (p.layout == Layout::NT && p.M <= kSkinnyRows) {
    switch (p.M) {
      case 1: return run_skinny<1>(p, threads);
      case 2: return run_skinny<2>(p, threads);
      case 3: return run_skinny<3>(p, threads);
      default: return run_skinny<4>(p, threads);
    }
  }
  run_sliced(p, threads, max_packed_b);
}

// What run_any asks of the scratch slots: the largest slice's packed B (and shared A), and the A
// panels of a task.
ScratchFloats scratch_floats(Layout layout, int64_t M, int64_t N, int64_t K,
                             int64_t max_packed_b) {
  if (runs_few_rows(layout, M)) return {std::min(few_slice_k(M), K) * few_lanes(M), 0};
  if (runs_few_rows_nn(layout, M, N, K)) return {};
  const bool c_transposed = transposed_pays(layout, M, N, K, max_packed_b);
  if (c_transposed) std::swap(M, N);
  else if (layout == Layout::NT && M <= kSkinnyRows) return {};
  const int64_t max_k = slice_k(max_packed_b);
  auto slots = [&](int64_t k) {
    const Blocking b = blocking(N, k, max_packed_b);
    return ScratchFloats{
        b.k_blocks * b.block_floats + shared_a_floats(layout, M, b, max_packed_b),
        kAPanelsFloats + (c_transposed ? c_block_floats(b, N) : 0)};
  };
  ScratchFloats s = slots(std::min(K, max_k));
  if (K > max_k && K % max_k != 0) {
    const ScratchFloats rest = slots(K % max_k);
    s = {std::max(s.slot0, rest.slot0), std::max(s.slot1, rest.slot1)};
  }
  return s;
}

#else  // no hardware FMA: the contract spelled out

void run_sliced(const Problem& p, int threads, int64_t /*max_packed_b*/) {
  if (threads <= 1) return exact_scalar(p, {0, p.M, 0, p.N});
  parallel_for_dynamic(0, p.M, [&](int64_t i) { exact_scalar(p, {i, i + 1, 0, p.N}); });
}

void run_any(const Problem& p, int threads, int64_t max_packed_b) {
  run_sliced(p, threads, max_packed_b);
}

ScratchFloats scratch_floats(Layout, int64_t, int64_t, int64_t, int64_t) { return {}; }

#endif

void Gemm(const Problem& p, int threads, bool per_thread) {
  run_any(p, threads, per_thread ? kGemmPackedBFloatsPerThread : kGemmPackedBFloatsShared);
}

ScratchFloats GemmScratch(Layout layout, int64_t M, int64_t N, int64_t K, bool per_thread) {
  if (M <= 0 || N <= 0 || K <= 0) return {};
  return scratch_floats(layout, M, N, K,
                        per_thread ? kGemmPackedBFloatsPerThread : kGemmPackedBFloatsShared);
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe {

HWY_EXPORT(Gemm);
HWY_EXPORT(GemmScratch);

namespace {

using gemm_detail::Layout;
using gemm_detail::Problem;

void gemm(Layout layout, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate, bool parallel) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    // An empty contraction (an expert with no tokens) leaves C, or clears it.
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * static_cast<size_t>(N));
    return;
  }
  const Problem p{layout, M, N, K, A, lda, B, ldb, C, ldc, accumulate};
  const bool wide = gemm_detail::runs_wide(parallel, M, N, K);
  MOE_DISPATCH(Gemm)(p, wide ? num_threads() : 1, !parallel);
}

}  // namespace

void gemm_nn_serial_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                         const GemmRows& B, float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) return gemm(Layout::NN, M, N, K, A, lda, nullptr, 0, C, ldc, accumulate, false);
  Problem p{Layout::NN, M, N, K, A, lda, nullptr, 0, C, ldc, accumulate};
  p.rows = &B;
  MOE_DISPATCH(Gemm)(p, 1, /*per_thread=*/true);
}

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(Layout::NT, M, N, K, A, lda, B, ldb, C, ldc, accumulate, true);
}
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(Layout::NN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, true);
}
void gemm_tn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(Layout::TN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, true);
}
void gemm_nt_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(Layout::NT, M, N, K, A, lda, B, ldb, C, ldc, accumulate, false);
}
void gemm_nn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(Layout::NN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, false);
}
void gemm_tn_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(Layout::TN, M, N, K, A, lda, B, ldb, C, ldc, accumulate, false);
}

ScratchFloats gemm_scratch_floats(GemmLayout layout, int64_t M, int64_t N, int64_t K, bool serial) {
  return MOE_DISPATCH(GemmScratch)(layout, M, N, K, serial);
}

}  // namespace moe
#endif  // HWY_ONCE
