#include "kernels/mxfp4_gemm.h"

// Fused MXFP4 matmuls. Design in one place:
//
// * Decode. A 32-element block is 16 bytes + 1 scale byte. One vector load + widening of N bytes
//   to N u32 lanes gives byte j in lane j; its low nibble is element 2j, its high nibble element
//   2j+1. A table lookup of the nibble in a 16-entry "E2M1 value × block scale" vector
//   (TableLookupLanes, vpermps on AVX-512) decodes N elements in one instruction, with no
//   branches and the scale already applied. AVX2's 8-lane vpermps cannot hold the 16 entries;
//   there each decoded float's two nonzero bytes are looked up with in-lane byte shuffles and
//   unpacked into place (BlockDecoder::block). Decoded values are bit-identical to
//   mxfp4::dequantize_row (the product value·2^k is exact).
//
// * Split order. That decode yields even elements in one vector (E) and odd elements in the
//   next (O), for each group of N bytes. The contraction never needs the natural order: in
//   y = x·Wᵀ we permute x the same way once per call (LoadInterleaved2), and in dx = dy·W the
//   outputs come out split and are re-interleaved once per stored tile (StoreInterleaved2).
//
// * One arithmetic for every m and every SIMD target. Each output element is computed by the
//   same sequence of fp32 operations whatever m, the blocking, the path (fused or buffered) or
//   the vector width:
//     nt: per contraction chunk of kKc columns, 16 virtual lanes per (x row, W row); lane l
//         adds, block by block, x·w of the block's elements 2l and 2l+1 (fused multiply-adds);
//         the lanes are summed by the adjacent-pair tree; y = sum (first chunk without
//         accumulate) or y += sum. The 16 lanes are one AVX-512 vector, two AVX2 vectors (one
//         per 8-byte group of the block) or 16 scalars;
//     nn: the fp32 gemm_nn's arithmetic on the decoded weights: each dx element is one FMA chain
//         over W's rows in order, from +0 or from dx when accumulating (chunks of kKr rows hand
//         the running value on through dx).
//   So results depend on the shapes only, equal on AVX-512, AVX2 and scalar, and a call on a
//   subset of the x / dy rows or of the W rows (nt) / column blocks (nn) reproduces the bits of
//   those outputs in the full call. tests/test_mxfp4.cpp spells both out and compares bitwise.
//
// * Three paths with that arithmetic. Small m (<= 8 rows): "fused" tiles decode each W block
//   in registers and use it at once against all m rows — one pass over the packed bytes, which
//   is what the memory-bound regime needs. Larger m: "buffered" tiles decode a few W rows (nt)
//   or a W panel (nn) into scratch once and reuse them across all x / dy row blocks from L1/L2,
//   so the decode cost is amortised over the rows and the inner loop is pure FMAs. On AVX2, from
//   32 rows on, nt runs each virtual lane as its own GEMM (vectors across W rows, see
//   run_nt_lanes), which fills the FMA pipes where 16-lane accumulators do not fit the registers;
//   and from 512 rows on, nn is the fp32 GEMM itself, fed W's rows decoded as it packs them
//   (kNnGemmFromRows). Never a decoded copy of the whole matrix: at most a column block of it.
//
// * Scratch, per thread (kernels/kernel_scratch.h: kept between calls, counted as workspace),
//   bounded independently of the matrix — larger operands are walked chunk by chunk:
//     nt: the split-order x panel, kMc (kFusedRows on the fused path) rows of kKc floats,
//         rounded up to whole tiles (at most 516 KiB), plus on the buffered
//         path B decoded W rows of kKc floats (B = 6 on AVX-512: 24 KiB); the per-lane path
//         (AVX2) holds 516 x rows (2 MiB), then two panels of 16 decoded W rows (this one and
//         the next: 128 KiB) and a tile's partial lane sums, one per tree level (2 KiB);
//     nn: on the buffered path a decoded W panel of kKr rows × 64 columns (64 KiB); the fused
//         path needs none; the fp32 GEMM (AVX2, 512 rows and more) what gemm_scratch_floats
//         says for the shape: a column block of decoded W (at most 4 MiB) and A panels.
//   The memory plan asks the kernels (mxfp4_gemm_*_scratch_floats) rather than restating this:
//   the tile a call of m rows runs comes from one table (with_nt_kernel, with_nn_kernel).

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "core/error.h"
#include "core/simd.h"
#include "kernels/kernel_scratch.h"
#include "kernels/gemm.h"
#include "kernels/mxfp4.h"

#ifndef MOE_KERNELS_MXFP4_GEMM_SHARED
#define MOE_KERNELS_MXFP4_GEMM_SHARED
namespace moe::mxfp4_detail {

using mxfp4::kBlock;
// nt contraction chunk (columns of W) and x panel height: the panel (512 KiB) stays in L2 while
// every W row of the chunk passes over it; 1024 columns keep the per-output lane reduction
// (a few shuffles) small next to its 64 FMAs. The buffered path decodes each W row once per
// panel, so the height sets the decode's share: 128 rows instead of 64 measured 1.02-1.03x at
// 128-512 rows and 192 or 256 rows were slower again (one core, Zen 5, 32 experts in turn); on
// AVX2 calls of 32 rows or more take the per-lane path, whose panel is kLaneMc.
inline constexpr int64_t kKc = 1024;
inline constexpr int64_t kMc = 128;
// nn contraction chunk (rows of W): accumulators are stored into dx once per chunk.
inline constexpr int64_t kKr = 256;

alignas(64) inline constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                                4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                                -2.0f, -3.0f, -4.0f, -6.0f};

// The 16-entry table times each of the 256 scales: a decoder's table is one load instead of a
// broadcast and a multiply on the FMA pipes, per block and W row. Built at start-up with the
// same fp32 multiply (not folded at compile time: scale 255 is NaN and 6·2^127 overflows).
// Every entry's low 16 bits are zero (E2M1 has one mantissa bit, and the smallest value,
// 0.5·2^-127, is 2^21 times the smallest subnormal): lo / hi are its bytes 2 and 3, the
// 16-byte tables (twice, one per 128-bit lane) of the AVX2 byte-shuffle decode.
struct ScaledE2M1 {
  alignas(64) float v[256][16];
  alignas(64) uint8_t lo[256][32];
  alignas(64) uint8_t hi[256][32];
  ScaledE2M1() {
    for (int e = 0; e < 256; ++e)
      for (int i = 0; i < 16; ++i) {
        volatile float s = mxfp4::kE8m0Floats[e];
        v[e][i] = kE2M1[i] * s;
        const uint32_t bits = std::bit_cast<uint32_t>(v[e][i]);
        lo[e][i] = lo[e][i + 16] = static_cast<uint8_t>(bits >> 16);
        hi[e][i] = hi[e][i + 16] = static_cast<uint8_t>(bits >> 24);
      }
  }
};
inline const ScaledE2M1 kScaledE2M1;

// Stand-ins for rows / blocks past the end of a tile, so the unrolled kernels never branch:
// packed zeros decode to +0 and zero dy rows add nothing. The stand-in scale is 2^0, not byte 0:
// 2^-127 would make the scaled decode table subnormal, and subnormal results cost a microcode
// assist each on x86 (measured: a 1024 × 704 nn call at m = 1, whose last column tile has two
// stand-in blocks, ran about 3.5× slower).
alignas(64) inline constexpr uint8_t kZeroBytes[kKc / 2] = {};
alignas(64) inline constexpr auto kUnitScales = [] {
  std::array<uint8_t, kKc / kBlock> t{};
  t.fill(127);
  return t;
}();
alignas(64) inline constexpr float kZeroFloats[std::max(kKc, kKr)] = {};

constexpr int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

}  // namespace moe::mxfp4_detail
#endif  // MOE_KERNELS_MXFP4_GEMM_SHARED

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/mxfp4_gemm.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "kernels/exact_fma-inl.h"
#include "kernels/transpose-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace moe::mxfp4_detail;

// At most 16 lanes: a whole E2M1 table then fits one vector.
using D = hn::CappedTag<float, 16>;
using V = hn::Vec<D>;
constexpr int64_t kN = static_cast<int64_t>(hn::MaxLanes(D()));
constexpr int64_t kGroups = 16 / kN;  // groups of kN bytes per block
constexpr int64_t kVecsPerBlock = 32 / kN;

// Decodes the groups of one block (see the top of the file): group q (kN bytes at bytes +
// q·kN) gives E = its low nibbles (even elements), O = its high nibbles (odd elements).
template <int64_t N>
class BlockDecoder {
 public:
  explicit BlockDecoder(uint8_t scale_byte) : scale_(scale_byte) {
    if constexpr (N >= 16) table_ = hn::Load(D(), kScaledE2M1.v[scale_byte]);
  }

  HWY_INLINE void group(const uint8_t* bytes, V& e, V& o) const {
    const D d;
    const hn::RebindToUnsigned<D> du;
    const hn::Rebind<uint8_t, D> d8;
    if constexpr (N >= 16) {
      const auto b = hn::PromoteTo(du, hn::LoadU(d8, bytes));
      e = lookup(b);
      o = lookup(hn::ShiftRight<4>(b));
    } else {
      // Narrower vectors: no 16-entry table fits one; decode via memory (AVX2 uses block()).
      const float* lut = kScaledE2M1.v[scale_];
      alignas(64) float te[16], to[16];
      for (int64_t j = 0; j < N; ++j) {
        te[j] = lut[bytes[j] & 15];
        to[j] = lut[bytes[j] >> 4];
      }
      e = hn::Load(d, te);
      o = hn::Load(d, to);
    }
  }

  // Both groups of the block: e[q], o[q] equal group(bytes + q·kN)'s, bit for bit.
  HWY_INLINE void block(const uint8_t* bytes, V* e, V* o) const {
#if HWY_TARGET == HWY_AVX2
    if constexpr (N == 8) {
      // In-lane byte shuffles instead of group()'s cross-lane vpermps and sign arithmetic:
      // 11 instructions per block instead of 20, 5 of them shuffles. An older form used 9
      // shuffles, which bind cores with two shuffle pipes: on Zen 3 this one is 8-9% faster at
      // one x row (docs/PERF.md, session 24); Zen 5 runs unpacks on four pipes and both forms at
      // the same speed (session 23).
      // 1. The 32 nibbles as bytes. Each 128-bit lane holds 8 packed bytes twice: lane 0 bytes
      //    0, 8, 1, 9, 2, 10, 3, 11, lane 1 bytes 4, 12, ..., 7, 15. Their first copy keeps its
      //    low nibbles and the second its high ones (the shift is per 32-bit lane), so after
      //    the unpacks in 3. each float's even and odd 16-bit halves come out as group()'s
      //    vectors: even halves of the first unpack are e[0], odd halves e[1], and the second
      //    unpack gives the high nibbles of the same bytes, o[0] and o[1].
      const __m256i src =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m256i order = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 0, 8, 1, 9, 2, 10, 3, 11,
                                             4, 12, 5, 13, 6, 14, 7, 15, 4, 12, 5, 13, 6, 14, 7, 15);
      const __m256i shifts = _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4);
      const __m256i nibbles = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_shuffle_epi8(src, order), shifts), _mm256_set1_epi8(0x0F));
      // 2. Bytes 2 and 3 of each decoded float.
      const __m256i lo = _mm256_shuffle_epi8(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(kScaledE2M1.lo[scale_])), nibbles);
      const __m256i hi = _mm256_shuffle_epi8(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(kScaledE2M1.hi[scale_])), nibbles);
      // 3. 16-bit halves of floats; a shift or a mask moves each into the top of its 32-bit
      //    lane (shift and logic pipes instead of four more shuffles).
      const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
      const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
      e[0] = V{_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16))};
      e[1] = V{_mm256_castsi256_ps(_mm256_and_si256(w0, top))};
      o[0] = V{_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
      o[1] = V{_mm256_castsi256_ps(_mm256_and_si256(w1, top))};
      return;
    }
#endif
    for (int64_t q = 0; q < kGroups; ++q) group(bytes + q * N, e[q], o[q]);
  }

 private:
  // table_[index mod 16]. vpermps reads only the low 4 bits of each index lane, so on AVX-512
  // the nibble needs no masking first (one instruction fewer per 16 weights: about 10% at
  // decode); other targets mask.
  template <class VU>
  HWY_INLINE V lookup(VU idx) const {
#if HWY_TARGET == HWY_AVX3
    if constexpr (N == 16) return V{_mm512_permutexvar_ps(idx.raw, table_.raw)};
#endif
    const hn::RebindToUnsigned<D> du;
    return hn::TableLookupLanes(
        table_, hn::IndicesFromVec(D(), hn::And(idx, hn::Set(du, static_cast<uint32_t>(N - 1)))));
  }

  uint8_t scale_;
  V table_;  // AVX-512 only
};
using Decoder = BlockDecoder<kN>;

// Decodes `blocks` consecutive blocks of one W row into dst in split order. ahead /
// ahead_scales (optional): the same blocks of a row decoded later, prefetched a line per 4 blocks.
HWY_INLINE void decode_blocks(const uint8_t* packed, const uint8_t* scales, int64_t blocks,
                              float* dst, const uint8_t* ahead = nullptr,
                              const uint8_t* ahead_scales = nullptr) {
  const D d;
  if (ahead_scales) hwy::Prefetch(ahead_scales);
  for (int64_t k = 0; k < blocks; ++k) {
    if (ahead && k % 4 == 0) hwy::Prefetch(ahead + k * 16);
    V e[kGroups], o[kGroups];
    Decoder(scales[k]).block(packed + k * 16, e, o);
    for (int64_t q = 0; q < kGroups; ++q) {
      hn::Store(e[q], d, dst + k * kBlock + 2 * q * kN);
      hn::Store(o[q], d, dst + k * kBlock + 2 * q * kN + kN);
    }
  }
}

// Sums the lanes of each of the Count accumulators v[0..Count) into out[0..Count). Batches of
// kN vectors are folded together (ConcatEven + ConcatOdd add adjacent lanes of two vectors at
// once), so a whole batch costs about 3 operations per output; each output still sees the one
// fixed tree (lane pairs (2l, 2l+1), then pairs of those, ...) whatever its batch partners.
template <int Count>
HWY_INLINE void reduce_lanes(const V* v, float* out) {
  const D d;
  for (int base = 0; base < Count; base += static_cast<int>(kN)) {
    const int live_in = std::min(static_cast<int>(kN), Count - base);
    V t[kN];
#pragma GCC unroll 16
    for (int j = 0; j < static_cast<int>(kN); ++j) t[j] = j < live_in ? v[base + j] : hn::Zero(d);
#if HWY_TARGET != HWY_SCALAR  // one lane: nothing to fold
    int live = live_in;
#pragma GCC unroll 4
    for (int64_t width = kN; width > 1; width /= 2) {
#pragma GCC unroll 16
      for (int j = 0; j < width / 2; ++j) {
        if (2 * j >= live) {
          t[j] = hn::Zero(d);
          continue;
        }
        const V lo = t[2 * j], hi = t[2 * j + 1];
        t[j] = hn::Add(hn::ConcatEven(d, hi, lo), hn::ConcatOdd(d, hi, lo));
      }
      live = (live + 1) / 2;
    }
#endif
    alignas(64) float lanes[kN];
    hn::Store(t[0], d, lanes);
    for (int j = 0; j < live_in; ++j) out[base + j] = lanes[j];
  }
}

// ------------------------------------------------------------------------------------------
// y = x·Wᵀ

// The 16 virtual lanes of an output are kGroups vectors of kN lanes (one per kN-byte group of a
// block), with independent chains. Each group's lane sums go to parts[(a·B+b)·kGroups + q];
// reduce_groups then finishes the adjacent-pair tree over the groups. The buffered tile runs
// one group at a time over the chunk (A·B accumulators in registers), the fused tile all groups
// in one pass over the packed bytes.
template <int Count>
HWY_INLINE void reduce_groups(float* parts, float* out) {
  for (int c = 0; c < Count; ++c) {
    float* p = parts + c * kGroups;
    for (int64_t width = kGroups; width > 1; width /= 2)
      for (int64_t j = 0; j < width / 2; ++j) p[j] = p[2 * j] + p[2 * j + 1];
    out[c] = p[0];
  }
}

template <int Count>
HWY_INLINE void keep_group(const V* acc, int64_t q, float* parts) {
  float sums[Count];
  reduce_lanes<Count>(acc, sums);
  for (int c = 0; c < Count; ++c) parts[c * kGroups + q] = sums[c];
}

// A x rows (split-order panel rows, stride xs) against B W rows over cc columns; the W rows are
// decoded on the fly from packed bytes / scales (fused) — out[a·B + b] = lane-summed dot.
// next_wp / next_ws: rows further on in each row stream (see TileRows), prefetched a cache line
// at a time along the way. W rows are short (a few hundred bytes), so the hardware streamers
// barely start on one before it ends; without this the small-m kernels waited on DRAM latency
// instead of bandwidth.
template <int A, int B>
HWY_INLINE void nt_fused_tile(const float* xp, int64_t xs, const uint8_t* const* wp,
                              const uint8_t* const* ws, const uint8_t* const* next_wp,
                              const uint8_t* const* next_ws, int64_t cc, float* out) {
  const D d;
  // One pass over the packed bytes (what the memory-bound regime needs), so all kGroups
  // accumulators of each output are live at once: tiles are chosen to fit them in registers.
  V acc[A * B * kGroups];
#pragma GCC unroll 32
  for (int i = 0; i < A * B * static_cast<int>(kGroups); ++i) acc[i] = hn::Zero(d);
  auto at = [](int a, int b, int64_t q) {
    return (a * B + b) * static_cast<int>(kGroups) + static_cast<int>(q);
  };
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b) hwy::Prefetch(next_ws[b]);
  // Block k of every row; a prefetch of one 64-byte line of each row stream goes with each 4th
  // block.
  auto step = [&](int64_t k) HWY_ATTR __attribute__((always_inline)) {
    const int64_t col = k * kBlock;
    if constexpr (A < B) {
      // Few x rows: keep them in registers and stream the W rows past them.
      V xe[A][kGroups], xo[A][kGroups];
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a)
#pragma GCC unroll 2
        for (int64_t q = 0; q < kGroups; ++q) {
          xe[a][q] = hn::Load(d, xp + a * xs + col + 2 * q * kN);
          xo[a][q] = hn::Load(d, xp + a * xs + col + 2 * q * kN + kN);
        }
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        V e[kGroups], o[kGroups];
        Decoder(ws[b][k]).block(wp[b] + k * 16, e, o);
#pragma GCC unroll 8
        for (int a = 0; a < A; ++a)
#pragma GCC unroll 2
          for (int64_t q = 0; q < kGroups; ++q) {
            acc[at(a, b, q)] = ExactMulAdd(xe[a][q], e[q], acc[at(a, b, q)]);
            acc[at(a, b, q)] = ExactMulAdd(xo[a][q], o[q], acc[at(a, b, q)]);
          }
      }
    } else {
      // Few W rows: decode them all, then stream the x rows.
      V we[B][kGroups], wo[B][kGroups];
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) Decoder(ws[b][k]).block(wp[b] + k * 16, we[b], wo[b]);
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a)
#pragma GCC unroll 2
        for (int64_t q = 0; q < kGroups; ++q) {
          const V xe = hn::Load(d, xp + a * xs + col + 2 * q * kN);
          const V xo = hn::Load(d, xp + a * xs + col + 2 * q * kN + kN);
#pragma GCC unroll 16
          for (int b = 0; b < B; ++b) {
            acc[at(a, b, q)] = ExactMulAdd(xe, we[b][q], acc[at(a, b, q)]);
            acc[at(a, b, q)] = ExactMulAdd(xo, wo[b][q], acc[at(a, b, q)]);
          }
        }
    }
  };
  // Inlined by force: GCC takes a function whose only effect is a prefetch for a pure one and
  // deletes the calls. As a plain lambda this one was gone from every fused tile (9bb34ed), and
  // one token's exact decode kept 0.58 of the DRAM read instead of 0.76-0.80 (docs/PERF.md,
  // session 29).
  auto prefetch = [&](int64_t k) HWY_ATTR __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) hwy::Prefetch(next_wp[b] + k * 16);
  };
  // 4 blocks per trip, the prefetches without a branch: on a 1024 × 1024 matrix in L2 (Zen 5),
  // one x row went from 2.85 to 2.72 cycles per block and W row on AVX-512, two rows on AVX2
  // from 9.2 to 8.5; 4 and 8 rows were unchanged. (`step` must be inlined: called, it cost AVX2
  // a fifth.) Except AVX2 at one x row, where one block per trip is 8-9% faster (Zen 3, 256 ×
  // 1024 in L2: 2.21-2.27 against 2.42-2.53 ns per block and W row; docs/PERF.md, session 24).
  constexpr bool kBlocksPerTrip4 = !(kN == 8 && A == 1);
  const int64_t blocks = cc / kBlock;
  int64_t k = 0;
  if constexpr (kBlocksPerTrip4) {
    for (; k + 4 <= blocks; k += 4) {
      prefetch(k);
      step(k);
      step(k + 1);
      step(k + 2);
      step(k + 3);
    }
    if (k < blocks) prefetch(k);
  }
  for (; k < blocks; ++k) {
    if (!kBlocksPerTrip4 && k % 4 == 0) prefetch(k);
    step(k);
  }
  float parts[A * B * kGroups];
  reduce_lanes<A * B * static_cast<int>(kGroups)>(acc, parts);
  reduce_groups<A * B>(parts, out);
}

// The same products with W rows already decoded (split order, stride wsd).
template <int A, int B>
HWY_INLINE void nt_tile(const float* xp, int64_t xs, const float* wd, int64_t wsd, int64_t cc,
                        float* out) {
  const D d;
  float parts[A * B * kGroups];
  for (int64_t q = 0; q < kGroups; ++q) {
    V acc[A * B];
#pragma GCC unroll 32
    for (int i = 0; i < A * B; ++i) acc[i] = hn::Zero(d);
    for (int64_t blk = 0; blk < cc; blk += kBlock)
#pragma GCC unroll 2
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t col = blk + (2 * q + half) * kN;
        V xv[A];
#pragma GCC unroll 8
        for (int a = 0; a < A; ++a) xv[a] = hn::Load(d, xp + a * xs + col);
#pragma GCC unroll 16
        for (int b = 0; b < B; ++b) {
          const V w = hn::Load(d, wd + b * wsd + col);
#pragma GCC unroll 8
          for (int a = 0; a < A; ++a) acc[a * B + b] = ExactMulAdd(xv[a], w, acc[a * B + b]);
        }
      }
    keep_group<A * B>(acc, q, parts);
  }
  reduce_groups<A * B>(parts, out);
}

// x rows [i0, i0+mi) × columns [c0, c0+cc) into the split-order panel, rows padded with zeros
// up to a multiple of `a`.
HWY_INLINE void pack_x(const float* x, int64_t ldx, int64_t mi, int64_t cc, int64_t a,
                       float* panel) {
  const D d;
  for (int64_t i = 0; i < round_up(mi, a); ++i) {
    float* dst = panel + i * cc;
    if (i >= mi) {
      std::memset(dst, 0, sizeof(float) * static_cast<size_t>(cc));
      continue;
    }
    for (int64_t c = 0; c < cc; c += 2 * kN) {
      V e, o;
      hn::LoadInterleaved2(d, x + i * ldx + c, e, o);
      hn::Store(e, d, dst + c);
      hn::Store(o, d, dst + c + kN);
    }
  }
}

// out[a·B + b] for the na × nb real outputs of a tile into y; W row b of the tile is output
// column b · row_step.
HWY_INLINE void store_nt(const float* out, int64_t B, int64_t na, int64_t nb, float* y,
                         int64_t ldy, int64_t row_step, bool first) {
  for (int64_t a = 0; a < na; ++a)
    for (int64_t b = 0; b < nb; ++b) {
      float& dst = y[a * ldy + b * row_step];
      dst = first ? out[a * B + b] : dst + out[a * B + b];
    }
}

// The W rows of the tiles. Buffered tiles take B adjacent rows. Fused tiles stream the packed
// bytes from DRAM while they compute, and one sequential stream per core then stays well below
// the DRAM bandwidth: the core holds too few misses in flight among the decode's instructions,
// and the hardware prefetchers follow one stream only so far ahead. So row b of fused tile t is
// row b·Q + t (Q = ceil(rows / B)): B streams a B-th of the matrix apart, each with its own
// prefetcher (bench_stream_overlap, 4 streams: 0.51-0.53 -> 0.77 of the DRAM read at the decode's
// instruction density). The rows of a tile never change an output's bits.
struct TileRows {
  int64_t tiles;  // Q
  int64_t step;   // distance between the rows of a tile: 1 (adjacent) or Q (spread)
  int64_t row(int64_t t, int64_t b, int64_t B) const { return step == 1 ? t * B + b : b * step + t; }
  // Rows of tile t below `rows`: a prefix of b = 0, 1, ...
  int64_t count(int64_t t, int64_t B, int64_t rows) const {
    if (step == 1) return std::min(B, rows - t * B);
    return std::min(B, (rows - t + step - 1) / step);
  }
};
HWY_INLINE TileRows tile_rows(int64_t rows, int64_t B, bool spread) {
  const int64_t tiles = (rows + B - 1) / B;
  return {tiles, spread ? tiles : 1};
}

// x rows per panel: fused tiles serve calls of at most kFusedRows rows (with_nt_kernel), so their
// panel is no larger (a decoding process then holds 32 KiB per thread, not 512 KiB).
constexpr int64_t kFusedRows = 8;
constexpr int64_t nt_panel_rows(bool fused) { return fused ? kFusedRows : kMc; }

// Scratch of run_nt: the split-order x panel, and (buffered) the decoded W rows.
constexpr ScratchFloats nt_scratch(int A, int B, bool fused) {
  return {round_up(nt_panel_rows(fused), A) * kKc, fused ? 0 : B * kKc};
}

template <int A, int B, bool kFused>
void run_nt(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y, int64_t ldy,
            bool accumulate) {
  constexpr ScratchFloats kScratch = nt_scratch(A, B, kFused);
  float* panel = kernel_scratch(0, kScratch.slot0);
  float* wdec = kFused ? nullptr : kernel_scratch(1, kScratch.slot1);
  float out[A * B];
  const TileRows tr = tile_rows(w.rows, B, kFused);
  // Fused: each row stream prefetches kAhead rows ahead in itself; buffered: the rows kAhead
  // ahead (a whole number of tiles, at least 8 rows).
  constexpr int64_t kAhead = kFused ? 2 : B * ((8 + B - 1) / B);
  for (int64_t c0 = 0; c0 < w.cols; c0 += kKc) {
    const int64_t cc = std::min(kKc, w.cols - c0);
    const bool first = c0 == 0 && !accumulate;
    for (int64_t i0 = 0; i0 < m; i0 += nt_panel_rows(kFused)) {
      const int64_t mi = std::min(nt_panel_rows(kFused), m - i0);
      pack_x(x + i0 * ldx + c0, ldx, mi, cc, A, panel);
      for (int64_t t = 0; t < tr.tiles; ++t) {
        const int64_t nb = tr.count(t, B, w.rows);
        const uint8_t *wp[B], *ws[B], *next_wp[B], *next_ws[B];
        for (int64_t b = 0; b < B; ++b) {
          const int64_t r = b < nb ? tr.row(t, b, B) : w.rows;
          const int64_t rn = kFused ? r + kAhead : tr.row(t, b, B) + kAhead;
          wp[b] = r < w.rows ? w.packed + r * w.packed_stride + c0 / 2 : kZeroBytes;
          ws[b] = r < w.rows ? w.scales + r * w.scale_stride + c0 / kBlock : kUnitScales.data();
          const bool ahead_in = rn < w.rows && (!kFused || b + 1 == B || rn < tr.row(0, b + 1, B));
          next_wp[b] = ahead_in ? w.packed + rn * w.packed_stride + c0 / 2 : kZeroBytes;
          next_ws[b] = ahead_in ? w.scales + rn * w.scale_stride + c0 / kBlock : kZeroBytes;
        }
        if constexpr (!kFused)
          for (int64_t b = 0; b < B; ++b)
            decode_blocks(wp[b], ws[b], cc / kBlock, wdec + b * cc, next_wp[b], next_ws[b]);
        for (int64_t a0 = 0; a0 < mi; a0 += A) {
          if constexpr (kFused)
            nt_fused_tile<A, B>(panel + a0 * cc, cc, wp, ws, next_wp, next_ws, cc, out);
          else
            nt_tile<A, B>(panel + a0 * cc, cc, wdec, cc, cc, out);
          store_nt(out, B, std::min<int64_t>(A, mi - a0), nb, y + (i0 + a0) * ldy + tr.row(t, 0, B),
                   ldy, tr.step, first);
        }
      }
    }
  }
}

// ---- Many x rows: one fp32 GEMM per virtual lane ----------------------------------------------
//
// Lane l of every output is itself an ordinary product: a chain of fused multiply-adds over the
// chunk's elements {32·blk + 2l, 32·blk + 2l + 1} in order, from +0. So with x and the decoded W
// regrouped by lane (x_l [rows][kl], W_l [kl][W rows], kl = cc / 16), lane l of a tile is a
// GEMM with vectors across W rows and x broadcast: kLaneMr × 2 vectors of accumulators, two W
// loads and kLaneMr broadcasts per kLaneMr × 2 FMAs, no lane reduction inside the loop. The 16
// lane results then meet in the same adjacent-pair tree, vectors across W rows. Same operations
// per output as the tiles above, in a shape the FMA pipes can fill on AVX2's 16 registers (the
// buffered tile's 16-lane outputs need two registers each there, and 3 × 3 of them already
// leave its FMA pipes waiting on latency: 0.75 of the fp32 path's speed at 512 rows).
constexpr int kLaneMr = 6;           // x rows per tile
constexpr int64_t kLaneNr = 2 * kN;  // W rows per panel
// Used on AVX2 from this many x rows on: below it the decode of the regrouped W panel costs more
// than the buffered 3 × 3 tile loses (measured 1408 × 1024, one thread: 0.72x at 8 rows, 0.93x
// at 24, 1.2x at 64 and 512). On AVX-512 the buffered 4 × 6 tile, whose 16-lane accumulators fit
// its 32 registers, stayed ahead at every size (1.0-1.5x). Each W panel is decoded once per x
// panel of kLaneMc rows. 256 rows (a 1 MiB x panel) measured 1.05x over 128 at 512 rows, and 512
// rows (2 MiB) 1.02x over 256 (Intel Xeon, 2 MiB L2): fewer decodes of each W panel, and the x
// panel is read as a sequential stream of broadcasts (4 bytes per cycle), which the prefetchers
// keep up with from L3 where it exceeds L2 (Zen 3: 512 KiB).
constexpr int64_t kLanesFromRows = 32;
constexpr int64_t kLaneMc = 512;

// x rows [0, mi) of a chunk into tiles of kLaneMr rows (zeros past mi); tile t's lane l starts
// at out + t·kLaneMr·cc + l·kl·kLaneMr, and holds per block the pairs (k' = 2·blk, 2·blk + 1) of
// its rows in row order: out[12·blk + 2a + p] = x[a][32·blk + 2l + p]. A pair is one 64-bit
// unit in x as in the panel, so packing is a transpose of 64-bit units (rows × lanes), four
// lanes per vector: about 12 vector operations per 48 values, where copying value by value
// took 2 scalar operations per value (2-3% of a call at 512 rows).
template <int64_t N>
HWY_INLINE void pack_x_lanes(const float* x, int64_t ldx, int64_t mi, int64_t cc, float* out) {
  static_assert(N == 8 && kLaneMr == 6, "the transpose below is written for 8 floats and 6 rows");
#if HWY_TARGET != HWY_SCALAR  // (instantiated on 8-lane targets only)
  const D d;
  const hn::Repartition<double, D> d64;  // a unit: one lane's two values of a block
  const hn::Half<decltype(d64)> d64h;
  const int64_t kl = cc / 16;
  for (int64_t a0 = 0; a0 < mi; a0 += kLaneMr) {
    const float* xr[kLaneMr];
    for (int a = 0; a < kLaneMr; ++a) xr[a] = a0 + a < mi ? x + (a0 + a) * ldx : kZeroFloats;
    float* tile = out + a0 * cc;
    for (int64_t blk = 0; blk < cc / kBlock; ++blk)
      for (int64_t j = 0; j < 4; ++j) {  // lanes 4j .. 4j + 3
        hn::Vec<decltype(d64)> r[kLaneMr];
#pragma GCC unroll 8
        for (int a = 0; a < kLaneMr; ++a) r[a] = hn::BitCast(d64, hn::LoadU(d, xr[a] + blk * kBlock + 8 * j));
        const auto t0 = hn::InterleaveLower(d64, r[0], r[1]), t1 = hn::InterleaveUpper(d64, r[0], r[1]);
        const auto t2 = hn::InterleaveLower(d64, r[2], r[3]), t3 = hn::InterleaveUpper(d64, r[2], r[3]);
        const auto s0 = hn::InterleaveLower(d64, r[4], r[5]), s1 = hn::InterleaveUpper(d64, r[4], r[5]);
        float* at = tile + (4 * j * kl + 2 * blk) * kLaneMr;
        const int64_t lane = kl * kLaneMr;  // floats between lanes
        auto store = [&](int64_t i, decltype(t0) rows0to3, hn::Vec<decltype(d64h)> rows4to5) {
          hn::StoreU(hn::BitCast(d, rows0to3), d, at + i * lane);
          hn::StoreU(rows4to5, d64h, reinterpret_cast<double*>(at + i * lane + 8));
        };
        store(0, hn::ConcatLowerLower(d64, t2, t0), hn::LowerHalf(d64h, s0));
        store(1, hn::ConcatLowerLower(d64, t3, t1), hn::LowerHalf(d64h, s1));
        store(2, hn::ConcatUpperUpper(d64, t2, t0), hn::UpperHalf(d64h, s0));
        store(3, hn::ConcatUpperUpper(d64, t3, t1), hn::UpperHalf(d64h, s1));
      }
  }
#else
  (void)x, (void)ldx, (void)mi, (void)cc, (void)out;
#endif
}

// kLaneNr W rows of a chunk, decoded into panel[(l·kl + k')·kLaneNr + r]: per block and group,
// kN rows decoded side by side and transposed in registers, so lane j's values of those rows
// are one contiguous store. A panel is decoded in pieces of one block of kN rows, so
// run_nt_lanes can spread the next panel's decode between this panel's FMAs.
constexpr int64_t kPiecesPerBlock = kLaneNr / kN;

template <int64_t N>
HWY_INLINE void decode_lane_piece(const uint8_t* const* wp, const uint8_t* const* ws, int64_t cc,
                                  int64_t piece, float* panel,
                                  const uint8_t* const* ahead = nullptr,
                                  const uint8_t* const* ahead_scales = nullptr) {
  const D d;
  const int64_t kl = cc / 16;
  const int64_t blk = piece / kPiecesPerBlock, r0 = piece % kPiecesPerBlock * N;
  if (ahead && blk % 4 == 0)  // a line of the same rows' blocks in the panel decoded after this
#pragma GCC unroll 16
    for (int64_t i = 0; i < N; ++i) {
      hwy::Prefetch(ahead[r0 + i] + blk * 16);
      if (blk == 0) hwy::Prefetch(ahead_scales[r0 + i]);  // a chunk's scales: 32 bytes per row
    }
  V e[kGroups][N], o[kGroups][N];
#pragma GCC unroll 16
  for (int64_t i = 0; i < N; ++i) {
    V ei[kGroups], oi[kGroups];
    Decoder(ws[r0 + i][blk]).block(wp[r0 + i] + blk * 16, ei, oi);
#pragma GCC unroll 2
    for (int64_t q = 0; q < kGroups; ++q) e[q][i] = ei[q], o[q][i] = oi[q];
  }
#pragma GCC unroll 2
  for (int64_t q = 0; q < kGroups; ++q) {
    TransposeSquare<static_cast<int>(N)>(d, e[q]);
    TransposeSquare<static_cast<int>(N)>(d, o[q]);
    float* at = panel + ((q * N) * kl + 2 * blk) * kLaneNr + r0;
#pragma GCC unroll 16
    for (int64_t j = 0; j < N; ++j) {
      hn::Store(e[q][j], d, at + j * kl * kLaneNr);
      hn::Store(o[q][j], d, at + j * kl * kLaneNr + kLaneNr);
    }
  }
}

// One lane's GEMM for a tile: chain over k' of x_l[a][k']·W_l[k'][r] for the kLaneMr × kLaneNr
// outputs, from +0. Lanes run in order 0..15 and each result joins the adjacent-pair tree as
// soon as its partner subtree exists: pending[level] holds the left operand waiting at each
// level (lane 2j at level 0, lanes 4j..4j+1 at level 1, ...), and lane l adds into it once per
// trailing one bit of l. So the tree's additions happen in the tree's order and operands, with
// no pass over 16 stored lane results; after lane 15 the tile's sums are in `sums`.
constexpr int64_t kLaneTile = kLaneMr * kLaneNr;
constexpr int64_t kTreeLevels = 4;  // of the 16-lane tree
HWY_INLINE void lane_tile(const float* HWY_RESTRICT xl, const float* HWY_RESTRICT wl, int64_t kl,
                          int64_t l, float* HWY_RESTRICT pending, float* HWY_RESTRICT sums) {
  const D d;
  V acc[kLaneMr][2];
#pragma GCC unroll 8
  for (int a = 0; a < kLaneMr; ++a) acc[a][0] = acc[a][1] = hn::Zero(d);
  for (int64_t k = 0; k < kl; k += 2) {  // one block: k' = 2·blk and 2·blk + 1 (pack_x_lanes)
#pragma GCC unroll 2
    for (int64_t p = 0; p < 2; ++p) {
      const V w0 = hn::Load(d, wl + (k + p) * kLaneNr), w1 = hn::Load(d, wl + (k + p) * kLaneNr + kN);
#pragma GCC unroll 8
      for (int a = 0; a < kLaneMr; ++a) {
        const V xa = hn::Set(d, xl[k * kLaneMr + 2 * a + p]);
        acc[a][0] = ExactMulAdd(xa, w0, acc[a][0]);
        acc[a][1] = ExactMulAdd(xa, w1, acc[a][1]);
      }
    }
  }
  int64_t level = 0;
  for (int64_t i = l; i & 1; i >>= 1, ++level) {
    const float* left = pending + level * kLaneTile;
#pragma GCC unroll 8
    for (int a = 0; a < kLaneMr; ++a) {
      acc[a][0] = hn::Add(hn::Load(d, left + a * kLaneNr), acc[a][0]);
      acc[a][1] = hn::Add(hn::Load(d, left + a * kLaneNr + kN), acc[a][1]);
    }
  }
  float* t = level == kTreeLevels ? sums : pending + level * kLaneTile;
#pragma GCC unroll 8
  for (int a = 0; a < kLaneMr; ++a) {
    hn::Store(acc[a][0], d, t + a * kLaneNr);
    hn::Store(acc[a][1], d, t + a * kLaneNr + kN);
  }
}

// W row pointers of the panel at r0 (stand-ins past the last row).
HWY_INLINE void lane_panel_rows(const Mxfp4Matrix& w, int64_t r0, int64_t c0, const uint8_t** wp,
                                const uint8_t** ws) {
  for (int64_t b = 0; b < kLaneNr; ++b) {
    const int64_t r = r0 + b;
    wp[b] = r < w.rows ? w.packed + r * w.packed_stride + c0 / 2 : kZeroBytes;
    ws[b] = r < w.rows ? w.scales + r * w.scale_stride + c0 / kBlock : kUnitScales.data();
  }
}

// Scratch of run_nt_lanes: slot 0 the regrouped x panel; slot 1 two decoded W panels (this one
// and the next), then a tile's partial lane sums, one per tree level, and its sums.
constexpr ScratchFloats kNtLanesScratch = {round_up(kLaneMc, kLaneMr) * kKc,
                                           2 * kLaneNr * kKc + (kTreeLevels + 1) * kLaneTile};

template <int64_t N>
void run_nt_lanes(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y,
                  int64_t ldy, bool accumulate) {
  const D d;
  float* xpanel = kernel_scratch(0, kNtLanesScratch.slot0);
  float* wpanels = kernel_scratch(1, kNtLanesScratch.slot1);
  float* pending = wpanels + 2 * kLaneNr * kKc;
  float* sums = pending + kTreeLevels * kLaneTile;
  for (int64_t c0 = 0; c0 < w.cols; c0 += kKc) {
    const int64_t cc = std::min(kKc, w.cols - c0), kl = cc / 16;
    const int64_t pieces = cc / kBlock * kPiecesPerBlock;
    const bool first = c0 == 0 && !accumulate;
    for (int64_t i0 = 0; i0 < m; i0 += kLaneMc) {
      const int64_t mi = std::min(kLaneMc, m - i0);
      const int64_t tiles = (mi + kLaneMr - 1) / kLaneMr;
      pack_x_lanes<N>(x + i0 * ldx + c0, ldx, mi, cc, xpanel);
      const uint8_t *wp[kLaneNr], *ws[kLaneNr];
      lane_panel_rows(w, 0, c0, wp, ws);
      for (int64_t p = 0; p < pieces; ++p) decode_lane_piece<N>(wp, ws, cc, p, wpanels);
      for (int64_t r0 = 0, cur = 0; r0 < w.rows; r0 += kLaneNr, cur ^= 1) {
        const int64_t nb = std::min(kLaneNr, w.rows - r0);
        const float* wpanel = wpanels + cur * kLaneNr * kKc;
        float* next = wpanels + (cur ^ 1) * kLaneNr * kKc;
        // The next panel is decoded a piece at a time between this panel's lane GEMMs: the
        // decode runs on the shuffle pipes while the FMA pipes are busy with the lanes
        // (measured 1.04-1.07x at 32-64 rows over decoding it in one go; the transposes share a
        // pipe with the FMAs, so the overlap is partial).
        const bool more = r0 + kLaneNr < w.rows;
        if (more) lane_panel_rows(w, r0 + kLaneNr, c0, wp, ws);
        // W is streamed from memory once per x panel: the panel after the next one is
        // prefetched as the next one is decoded.
        const uint8_t *ahead_wp[kLaneNr], *ahead_ws[kLaneNr];
        const bool prefetch = r0 + 2 * kLaneNr < w.rows;
        if (prefetch) lane_panel_rows(w, r0 + 2 * kLaneNr, c0, ahead_wp, ahead_ws);
        // After lane GEMM s of the panel's tiles·16, floor(s·pieces / (tiles·16)) pieces of the
        // next panel are decoded; `credit` counts that without a division per lane (the idiv
        // drew 2% of this function's samples at 512 rows).
        int64_t decoded = 0, credit = 0;
        const int64_t steps = tiles * 16;
        for (int64_t a0 = 0; a0 < mi; a0 += kLaneMr) {
          const float* xt = xpanel + a0 * cc;
          for (int64_t l = 0; l < 16; ++l) {
            lane_tile(xt + l * kl * kLaneMr, wpanel + l * kl * kLaneNr, kl, l, pending, sums);
            if (more)
              for (credit += pieces; credit >= steps; credit -= steps)
                decode_lane_piece<N>(wp, ws, cc, decoded++, next, prefetch ? ahead_wp : nullptr,
                                     prefetch ? ahead_ws : nullptr);
          }
          const int64_t na = std::min<int64_t>(kLaneMr, mi - a0);
          for (int64_t a = 0; a < na; ++a)
            for (int64_t v = 0; v < 2; ++v) {
              const float* sum = sums + a * kLaneNr + v * kN;
              float* dst = y + (i0 + a0 + a) * ldy + r0 + v * kN;
              const int64_t live = std::min<int64_t>(kN, nb - v * kN);
              if (live <= 0) continue;
              if (live == kN) {
                const V t = hn::Load(d, sum);
                hn::StoreU(first ? t : hn::Add(hn::LoadU(d, dst), t), d, dst);
              } else {
                for (int64_t j = 0; j < live; ++j) dst[j] = first ? sum[j] : dst[j] + sum[j];
              }
            }
        }
      }
    }
  }
}

// Tile shapes (A x rows × B W rows) by target width: 16 lanes means AVX-512's 32 registers
// (A·B·kGroups accumulators plus operands must fit), 8 lanes AVX2's 16. Up to kFusedRows rows,
// fused tiles decode each W block once per tile of x rows; at one row the kernel is bound by its
// decode, and 4 W rows per tile stream best (16 rows: 0.37 of DRAM read, 2–4 rows: 0.50–0.55;
// bench_mxfp4_decode). Beyond that the buffered 4 × 6 tile (24 accumulators, 10 loads per 24
// FMAs). The shapes were picked by measurement (bench_mxfp4, bench_frozen_experts); none
// changes the arithmetic.
// The kernel a call of m rows runs, handed to `k` as k.template tile<A, B, kFused>() or
// k.lanes(): one table for the call itself and for the scratch it reports.
template <int64_t N, class Kernel>
auto with_nt_kernel(int64_t m, const Kernel& k) {
  if constexpr (N >= 16) {
    switch (m) {
      case 1: return k.template tile<1, 4, true>();
      case 2: return k.template tile<2, 8, true>();
      case 3: return k.template tile<3, 5, true>();
      case 4: return k.template tile<4, 4, true>();
      // 5-8 rows: two tiles of 4 x rows, each W row decoded twice; a single tile of all rows
      // rereads the x panel (up to 32 KiB) from L2 for every 2-3 W rows (measured 0.9x).
      case 5:
      case 6:
      case 7:
      case 8: return k.template tile<4, 4, true>();
      default: return k.template tile<4, 6, false>();
    }
  } else if constexpr (N == 8) {
    // The fused tiles hold two accumulators per output (its 16 virtual lanes); the buffered one
    // runs a group at a time, 3 × 3 giving 9 independent FMA chains (2 × 4 left the two FMA
    // pipes waiting on 4-cycle latencies: 0.56 vs 0.6 of peak). From 3 to 8 rows, fused tiles
    // of one W row against all (or half) of the x rows: each block is decoded once (twice) and
    // feeds 4 FMAs per x row from registers, where the buffered tile stores the decoded rows
    // and pads m to a multiple of 3 (4 rows: 54 -> 99 GFLOP/s, 8 rows: 78 -> 95-100, one core,
    // Zen 5, cold 704 x 1024 experts; 9 rows and more stay buffered, 12-31 rows measured
    // 0.7-0.9x fused). Each output's two accumulators take 2 chained FMAs per block, so a
    // tile of A x rows keeps 2A chains in flight: 6 or 7 rows in one tile (12 or 14 chains,
    // some accumulators spilled) beat 3 + 3 (6 chains, at the FMA latency) and 4 + 4 padded
    // (1.11-1.21x and 1.08-1.09x, Zen 3, one core, 704 x 1024, alternated in one process);
    // 8 rows in one tile spill too much (0.84-0.91x against 4 + 4).
    switch (m) {
      case 1: return k.template tile<1, 4, true>();
      case 2: return k.template tile<2, 2, true>();
      case 3: return k.template tile<3, 1, true>();
      case 4:
      case 8: return k.template tile<4, 1, true>();
      case 5: return k.template tile<5, 1, true>();
      case 6: return k.template tile<6, 1, true>();
      case 7: return k.template tile<7, 1, true>();
      default:
        if (m >= kLanesFromRows) return k.lanes();
        return k.template tile<3, 3, false>();
    }
  } else {
    return k.template tile<1, 1, false>();
  }
}

// A call's operands: m rows of `in` (x or dy) against w into `out` (y or dx).
struct CallArgs {
  int64_t m;
  const float* in;
  int64_t ldin;
  const Mxfp4Matrix& w;
  float* out;
  int64_t ldout;
  bool accumulate;
};

struct NtCall : CallArgs {
  template <int A, int B, bool kFused>
  void tile() const { run_nt<A, B, kFused>(m, in, ldin, w, out, ldout, accumulate); }
  void lanes() const {
    if constexpr (kN == 8) run_nt_lanes<kN>(m, in, ldin, w, out, ldout, accumulate);
  }
};

struct NtScratch {
  template <int A, int B, bool kFused>
  ScratchFloats tile() const { return nt_scratch(A, B, kFused); }
  ScratchFloats lanes() const { return kNtLanesScratch; }
};

void GemmNT(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y, int64_t ldy,
            bool accumulate) {
  with_nt_kernel<kN>(m, NtCall{{m, x, ldx, w, y, ldy, accumulate}});
}

ScratchFloats GemmNTScratch(int64_t m) {
  return m <= 0 ? ScratchFloats{} : with_nt_kernel<kN>(m, NtScratch{});
}

// ------------------------------------------------------------------------------------------
// dx = dy·W

// Moves the A × NB-block accumulators of a tile (split order) from or to dx (row a, block j at
// dxr[a] + 32j). kLoad: the running chains stored in dx, or +0 to start them (and for blocks past
// the real na × nbv); else the real blocks are written back in natural order. Loops run over the
// constant tile shape so every index is a constant and the accumulators stay in registers.
template <int A, int NB, bool kLoad>
HWY_INLINE void nn_tile_io(V* acc, float* const* dxr, int64_t na, int64_t nbv, bool start) {
  const D d;
  constexpr int B = NB * static_cast<int>(kVecsPerBlock);
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
      for (int q = 0; q < static_cast<int>(kGroups); ++q) {
        V& e = acc[a * B + j * static_cast<int>(kVecsPerBlock) + 2 * q];
        V& o = acc[a * B + j * static_cast<int>(kVecsPerBlock) + 2 * q + 1];
        const bool real = a < na && j < nbv;
        float* p = real ? dxr[a] + j * kBlock + 2 * q * kN : nullptr;
        if constexpr (kLoad) {
          if (start || !real) e = o = hn::Zero(d);
          else hn::LoadInterleaved2(d, p, e, o);
        } else if (real) {
          hn::StoreInterleaved2(e, o, d, p);
        }
      }
}

// A dy rows against NB 32-column blocks of W over rc rows of W, decoding each W block on the
// fly. wp/ws: per block, its bytes / scale at the chunk's first row; wstride/sstride: per
// block, the step to the next row (0 for stand-in blocks).
template <int A, int NB>
HWY_INLINE void nn_fused_tile(const float* const* dyr, const uint8_t* const* wp,
                              const uint8_t* const* ws, const int64_t* wstride,
                              const int64_t* sstride, int64_t rc, int64_t rows_left,
                              float* const* dxr, int64_t nbv, int64_t na, bool start) {
  const D d;
  constexpr int B = NB * static_cast<int>(kVecsPerBlock);
  V acc[A * B];
  nn_tile_io<A, NB, true>(acc, dxr, na, nbv, start);
  for (int64_t r = 0; r < rc; ++r) {
    // W is walked down a column strip, a short piece of each row: prefetch the strip about
    // 2 KiB ahead (see nt_fused_tile), within this call's rows.
    constexpr int64_t kAhead = 128 / NB;
    if (r + kAhead < rows_left) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) hwy::Prefetch(wp[j] + (r + kAhead) * wstride[j]);
      hwy::Prefetch(ws[0] + (r + kAhead) * sstride[0]);
    }
    V bc[A];
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a) bc[a] = hn::Set(d, dyr[a][r]);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      V e[kGroups], o[kGroups];
      Decoder(ws[j][r * sstride[j]]).block(wp[j] + r * wstride[j], e, o);
#pragma GCC unroll 4
      for (int q = 0; q < static_cast<int>(kGroups); ++q) {
        const int v = j * static_cast<int>(kVecsPerBlock) + 2 * q;
#pragma GCC unroll 8
        for (int a = 0; a < A; ++a) {
          acc[a * B + v] = ExactMulAdd(bc[a], e[q], acc[a * B + v]);
          acc[a * B + v + 1] = ExactMulAdd(bc[a], o[q], acc[a * B + v + 1]);
        }
      }
    }
  }
  nn_tile_io<A, NB, false>(acc, dxr, na, nbv, false);
}

// The same products with the W panel already decoded (rc rows × NB blocks, split order).
template <int A, int NB>
HWY_INLINE void nn_tile(const float* const* dyr, const float* panel, int64_t rc,
                        float* const* dxr, int64_t nbv, int64_t na, bool start) {
  const D d;
  constexpr int B = NB * static_cast<int>(kVecsPerBlock);
  V acc[A * B];
  nn_tile_io<A, NB, true>(acc, dxr, na, nbv, start);
  for (int64_t r = 0; r < rc; ++r) {
    V bc[A];
#pragma GCC unroll 16
    for (int a = 0; a < A; ++a) bc[a] = hn::Set(d, dyr[a][r]);
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) {
      const V w = hn::Load(d, panel + (r * B + b) * kN);
#pragma GCC unroll 16
      for (int a = 0; a < A; ++a) acc[a * B + b] = ExactMulAdd(bc[a], w, acc[a * B + b]);
    }
  }
  nn_tile_io<A, NB, false>(acc, dxr, na, nbv, false);
}

// Scratch of run_nn: (buffered) a decoded W panel.
constexpr ScratchFloats nn_scratch(int NB, bool fused) {
  return {fused ? 0 : kKr * NB * kBlock, 0};
}

template <int A, int NB, bool kFused>
void run_nn(int64_t m, const float* dy, int64_t lddy, const Mxfp4Matrix& w, float* dx,
            int64_t lddx, bool accumulate) {
  float* panel = kFused ? nullptr : kernel_scratch(0, nn_scratch(NB, kFused).slot0);
  for (int64_t r0 = 0; r0 < w.rows; r0 += kKr) {
    const int64_t rc = std::min(kKr, w.rows - r0);
    const bool start = r0 == 0 && !accumulate;  // else continue the chains stored in dx
    for (int64_t c0 = 0; c0 < w.cols; c0 += NB * kBlock) {
      const int64_t nbv = std::min<int64_t>(NB, (w.cols - c0) / kBlock);
      const uint8_t* wp[NB];
      const uint8_t* ws[NB];
      int64_t wstride[NB], sstride[NB];
      for (int64_t j = 0; j < NB; ++j) {
        const bool real = j < nbv;
        wp[j] = real ? w.packed + r0 * w.packed_stride + (c0 + j * kBlock) / 2 : kZeroBytes;
        ws[j] = real ? w.scales + r0 * w.scale_stride + (c0 + j * kBlock) / kBlock
                     : kUnitScales.data();
        wstride[j] = real ? w.packed_stride : 0;
        sstride[j] = real ? w.scale_stride : 0;
      }
      if constexpr (!kFused) {
        // The panel reads NB · 16 bytes of each of rc rows, a row apart, and the hardware
        // prefetchers leave most of those lines to wait on DRAM. Each row prefetches its next
        // 64 bytes (128 columns on), which the panel reads 2 (NB = 2) or 4 (NB = 1) strips
        // later. Cold 1024 × 704 experts, 64 rows, two threads (Zen 5): AVX-512 364-397 ->
        // 404-420 GFLOP/s, AVX2 unchanged.
        const int64_t c_ahead = c0 + 128;
        for (int64_t r = 0; r < rc; ++r) {
          const uint8_t* ahead =
              c_ahead < w.cols ? w.packed + (r0 + r) * w.packed_stride + c_ahead / 2 : nullptr;
          for (int64_t j = 0; j < NB; ++j)
            decode_blocks(wp[j] + r * wstride[j], ws[j] + r * sstride[j], 1,
                          panel + (r * NB + j) * kBlock, j == 0 ? ahead : nullptr);
        }
      }
      for (int64_t i0 = 0; i0 < m; i0 += A) {
        const int64_t na = std::min<int64_t>(A, m - i0);
        const float* dyr[A];
        float* dxr[A];
        for (int64_t a = 0; a < A; ++a) {
          dyr[a] = a < na ? dy + (i0 + a) * lddy + r0 : kZeroFloats;
          dxr[a] = a < na ? dx + (i0 + a) * lddx + c0 : nullptr;
        }
        if constexpr (kFused)
          nn_fused_tile<A, NB>(dyr, wp, ws, wstride, sstride, rc, w.rows - r0, dxr, nbv, na, start);
        else
          nn_tile<A, NB>(dyr, panel, rc, dxr, nbv, na, start);
      }
    }
  }
}

// From this many dy rows on, AVX2 runs dx = dy·W as the fp32 GEMM itself (the same arithmetic,
// gemm_nn_serial_rows), packing W's rows as it decodes them. The 3-row buffered tile reads its
// dy rows again for every 32-column strip of W, and there the GEMM's 6 × 16 tile and packed A
// win: 704 × 1024 and 1024 × 704 experts, 512 rows, two threads, cold (`bench_frozen_experts`)
// 0.91-0.94 -> 1.04-1.06 of the fp32 path; the crossover is at 384-512 rows (256 rows:
// 0.91-1.01x, 64 rows: 0.81-0.85x, alternated in one process; docs/PERF.md, session 39).
constexpr int64_t kNnGemmFromRows = 512;

// The kernel a call of m rows runs (see with_nt_kernel).
template <int64_t N, class Kernel>
auto with_nn_kernel(int64_t m, const Kernel& k) {
  if constexpr (N >= 16) {
    switch (m) {
      case 1: return k.template tile<1, 8, true>();
      case 2: return k.template tile<2, 4, true>();
      case 3: return k.template tile<3, 2, true>();
      case 4: return k.template tile<4, 2, true>();
      case 5: return k.template tile<5, 2, true>();
      case 6: return k.template tile<6, 1, true>();
      case 7: return k.template tile<7, 1, true>();
      case 8: return k.template tile<8, 1, true>();
      default: return k.template tile<6, 2, false>();
    }
  } else if constexpr (N == 8) {
    // 4 rows: the buffered 3-row tile would pad to 6; two fused passes of 2 rows measured
    // 61 -> 72-76 GFLOP/s (one core, cold 704 x 1024 experts); fused 3- or 4-row tiles spill.
    if (m >= kNnGemmFromRows) return k.gemm();
    switch (m) {
      case 1: return k.template tile<1, 2, true>();
      case 2:
      case 4: return k.template tile<2, 1, true>();
      default: return k.template tile<3, 1, false>();
    }
  } else {
    return k.template tile<1, 1, false>();
  }
}

// W's row k, columns [j0, j0 + n), decoded in natural order: the rows the fp32 GEMM packs
// (GemmRows) when it runs the input gradient itself.
void decode_row_span(const void* ctx, int64_t k, int64_t j0, int64_t n, float* out) {
  const Mxfp4Matrix& w = *static_cast<const Mxfp4Matrix*>(ctx);
  const D d;
  const uint8_t* packed = w.packed + k * w.packed_stride;
  const uint8_t* scales = w.scales + k * w.scale_stride;
  for (int64_t blk = j0 / kBlock; blk * kBlock < j0 + n; ++blk) {
    const int64_t c0 = blk * kBlock, from = std::max(j0, c0), to = std::min(j0 + n, c0 + kBlock);
    alignas(64) float part[kBlock];
    float* dst = from == c0 && to == c0 + kBlock ? out + (c0 - j0) : part;
    V e[kGroups], o[kGroups];
    Decoder(scales[blk]).block(packed + blk * 16, e, o);
    for (int64_t q = 0; q < kGroups; ++q) hn::StoreInterleaved2(e[q], o[q], d, dst + 2 * q * kN);
    if (dst == part)
      std::memcpy(out + (from - j0), part + (from - c0), sizeof(float) * static_cast<size_t>(to - from));
  }
}

struct NnCall : CallArgs {
  template <int A, int NB, bool kFused>
  void tile() const { run_nn<A, NB, kFused>(m, in, ldin, w, out, ldout, accumulate); }
  void gemm() const {
    const GemmRows rows{&decode_row_span, &w};
    gemm_nn_serial_rows(m, w.cols, w.rows, in, ldin, rows, out, ldout, accumulate);
  }
};

struct NnScratch {
  int64_t m, rows, cols;
  template <int A, int NB, bool kFused>
  ScratchFloats tile() const { return nn_scratch(NB, kFused); }
  ScratchFloats gemm() const { return gemm_scratch_floats(GemmLayout::NN, m, cols, rows, true); }
};

void GemmNN(int64_t m, const float* dy, int64_t lddy, const Mxfp4Matrix& w, float* dx,
            int64_t lddx, bool accumulate) {
  with_nn_kernel<kN>(m, NnCall{{m, dy, lddy, w, dx, lddx, accumulate}});
}

ScratchFloats GemmNNScratch(int64_t m, int64_t rows, int64_t cols) {
  return m <= 0 ? ScratchFloats{} : with_nn_kernel<kN>(m, NnScratch{m, rows, cols});
}

}  // namespace HWY_NAMESPACE
}  // namespace moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe {

HWY_EXPORT(GemmNT);
HWY_EXPORT(GemmNN);
HWY_EXPORT(GemmNTScratch);
HWY_EXPORT(GemmNNScratch);

ScratchFloats mxfp4_gemm_nt_scratch_floats(int64_t m) { return MOE_DISPATCH(GemmNTScratch)(m); }
ScratchFloats mxfp4_gemm_nn_scratch_floats(int64_t m, int64_t rows, int64_t cols) {
  return MOE_DISPATCH(GemmNNScratch)(m, rows, cols);
}

void mxfp4_gemm_nt(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y,
                   int64_t ldy, bool accumulate) {
  MOE_CHECK(w.cols % mxfp4::kBlock == 0, "mxfp4_gemm_nt: cols {} is not a multiple of {}",
            w.cols, mxfp4::kBlock);
  if (m <= 0 || w.rows <= 0) return;
  if (w.cols == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::memset(y + i * ldy, 0, sizeof(float) * w.rows);
    return;
  }
  MOE_DISPATCH(GemmNT)(m, x, ldx, w, y, ldy, accumulate);
}

void mxfp4_gemm_nn(int64_t m, const float* dy, int64_t lddy, const Mxfp4Matrix& w, float* dx,
                   int64_t lddx, bool accumulate) {
  MOE_CHECK(w.cols % mxfp4::kBlock == 0, "mxfp4_gemm_nn: cols {} is not a multiple of {}",
            w.cols, mxfp4::kBlock);
  if (m <= 0 || w.cols <= 0) return;
  if (w.rows == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::memset(dx + i * lddx, 0, sizeof(float) * w.cols);
    return;
  }
  MOE_DISPATCH(GemmNN)(m, dy, lddy, w, dx, lddx, accumulate);
}

}  // namespace moe
#endif  // HWY_ONCE
