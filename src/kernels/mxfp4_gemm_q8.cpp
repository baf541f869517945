#include "kernels/mxfp4_gemm_q8.h"

// y = x·Wᵀ for inference with x quantized to int8 per 32-element block. Design in one place:
//
// * Why. A weight nibble becomes an integer by one byte lookup (AVX-512 VBMI vpermb, which reads
//   the index's low 6 bits, so neither nibble needs a mask; AVX2 vpshufb after a mask: 32 or 64
//   codes per instruction) and 2·E2M1 × int8 products are summed exactly by integer multiply-adds
//   (vpdpbusd with AVX-512 VNNI: 64 products per instruction; else AVX2 vpmaddubsw + vpmaddwd), so
//   a 32-weight block costs about 3 vector instructions instead of the exact path's 8 (16-lane
//   table lookups and one fused multiply-add per 16 weights). docs/PERF.md has what that buys
//   on each target: cache-resident it is up to 1.4× (AVX-512) and 2× (AVX2) the exact path;
//   streaming from DRAM both are limited by how fast one core pulls lines in while computing.
//
// * Quantization of x (shared scalar code, so every target gets the same bytes): per block of 32,
//   amax = max|x|, q = round-to-nearest-even(x · (127 / amax)) in [-127, 127], and the block's
//   half-scale sxh = amax / 254 (the factor 2 undoes the doubled weights below). amax = 0 gives
//   q = 0, sxh = 0; a NaN or ±Inf in the block gives q = 0 and sxh = NaN, so the outputs that
//   read the block are NaN.
//
// * Weights. vpmaddubsw multiplies unsigned by signed bytes, so a code is looked up as
//   w' = 2·E2M1 + 12 in [0, 24] (doubled: integers) and the offset is removed with a per-lane
//   correction 12·Σq computed once with the quantization: Σ w'·q − 12·Σq = Σ 2·E2M1·q, exact in
//   int32 (|sum| <= 8·12·127 per lane).
//
// * Arithmetic (the contract every target follows; tests/test_mxfp4.cpp spells it out): the
//   contraction is cut into spans of 128 elements (4 blocks; a short last span is padded with
//   zero x and weights). Per (x row, W row), 16 lanes: lane l covers the 8 elements
//   8l..8l+7 of each span (block l/4), and adds, span by span,
//       acc_l = fma(float(Σ 2·E2M1·q over its 8 elements), sxh_{block} · 2^(e_block − 127), acc_l)
//   starting from +0; y = the adjacent-pair tree of the 16 lanes (y + that sum when
//   accumulating). The integer sums are exact whatever the instruction grouping, and the fp32
//   operations are the same on AVX-512 (one 16-lane vector), AVX2 (two 8-lane vectors) and
//   scalar, so the bits depend on the shapes only: not on m, the tile, threads or the target.
//
// * Layout of a quantized x row, per span (QSpan, 256 bytes): the even elements (low nibbles'
//   partners) and odd elements as two 64-byte arrays, matching byte i of the span's 64 packed
//   bytes; then the 16 lane corrections and the 16 lane half-scales.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOE_Q8_X86 1
#endif

#include "core/error.h"
#include "core/simd.h"
#include "kernels/kernel_scratch.h"
#include "kernels/mxfp4.h"

namespace moe {

namespace {

constexpr int64_t kSpan = 128;        // elements per span
constexpr int64_t kSpanBytes = 64;    // packed bytes per span
constexpr int64_t kSpanScales = 4;    // blocks per span
constexpr int64_t kLanes = 16;
constexpr int32_t kOffset = 12;
constexpr int64_t kRowsPerPanel = 64;  // x rows quantized at a time (bounded scratch)

// W rows prefetched ahead of the tile, over its B streams. The best distance differs by core
// (the Xeon's figures are at the tiles below): a Zen 5 EPYC streamed 49-54 GB/s packed with 4
// rows per stream against 45-48 with 2, in alternating runs of bench_mxfp4_decode while its DRAM
// read 75-83 GB/s (39-41 against 37-39 while it read 46-50). Prefetching never changes a bit.
int64_t rows_ahead() {
#ifdef MOE_Q8_X86
  static const int64_t rows = __builtin_cpu_is("amd") ? 16 : 8;
  return rows;
#else
  return 8;
#endif
}

// 2·E2M1 + kOffset per code (codes 8..15 negative; 8 is -0).
alignas(16) constexpr int8_t kWeightTable[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                 12, 11, 10, 9,  8,  6,  4,  0};

struct alignas(64) QSpan {
  int8_t even[kSpanBytes];  // element 2i of the span, for packed byte i
  int8_t odd[kSpanBytes];   // element 2i+1
  int32_t corr[kLanes];     // −kOffset · Σ q over lane l's 8 elements
  float sxh[kLanes];        // half-scale of lane l's block
};
static_assert(sizeof(QSpan) == 256);

// Round to nearest even for |v| < 2^22 (the default rounding of the add), branch-free.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 · 2^23
  return std::copysign((std::fabs(v) + kMagic) - kMagic, v);
}

// One block of 32: q in natural order and the half-scale. Written as flat loops of fixed trip
// count so the compiler vectorises them; every operation is exact IEEE arithmetic, so any
// vectorisation gives the same bytes.
inline void quantize_block(const float* xb, int8_t* qb, float& sxh) {
  float amax = 0;
  int bad = 0;  // NaN or ±Inf
  for (int64_t i = 0; i < mxfp4::kBlock; ++i) {
    const float a = std::fabs(xb[i]);
    amax = a > amax ? a : amax;
    bad |= !(a <= std::numeric_limits<float>::max());
  }
  if (bad || amax == 0) {
    std::memset(qb, 0, mxfp4::kBlock);
    sxh = bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    return;
  }
  sxh = amax / 254.0f;
  const float inv = 127.0f / amax;
  int32_t t[mxfp4::kBlock];
  for (int64_t i = 0; i < mxfp4::kBlock; ++i)
    t[i] = static_cast<int32_t>(std::clamp(round_even(xb[i] * inv), -127.0f, 127.0f));
  for (int64_t i = 0; i < mxfp4::kBlock; ++i) qb[i] = static_cast<int8_t>(t[i]);
}

// A span's natural-order int8 values into the QSpan layout (even / odd elements, lane sums).
inline void finish_span(const int8_t* v, const float* sxh, QSpan& q) {
  for (int64_t i = 0; i < kSpanBytes; ++i) {
    q.even[i] = v[2 * i];
    q.odd[i] = v[2 * i + 1];
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    int32_t sum = 0;
    for (int64_t i = 8 * l; i < 8 * l + 8; ++i) sum += v[i];
    q.corr[l] = -kOffset * sum;
    q.sxh[l] = sxh[l / 4];
  }
}

#ifdef MOE_Q8_X86
// The same quantization with AVX2 (used on the AVX2 and AVX-512 targets): the operations are
// the scalar ones lane by lane (max, compare, multiply, round to nearest even, clamp), so the
// bytes are identical.
__attribute__((target("avx2,fma"))) void quantize_block_avx2(const float* xb, int8_t* qb,
                                                            float& sxh) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 fmax = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 a[4], vmax = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int k = 0; k < 4; ++k) {
    a[k] = _mm256_loadu_ps(xb + 8 * k);
    const __m256 ab = _mm256_and_ps(a[k], abs_mask);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(ab, fmax, _CMP_LE_OQ));
    vmax = _mm256_max_ps(vmax, ab);
  }
  alignas(32) float m8[8];
  _mm256_store_ps(m8, vmax);
  float amax = 0;
  for (float v : m8) amax = v > amax ? v : amax;
  if (finite != 0xFF || amax == 0) {
    std::memset(qb, 0, mxfp4::kBlock);
    sxh = finite != 0xFF ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    return;
  }
  sxh = amax / 254.0f;
  const __m256 inv = _mm256_set1_ps(127.0f / amax), lo = _mm256_set1_ps(-127.0f),
               hi = _mm256_set1_ps(127.0f);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(a[k], inv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
  }
  // packs interleave 128-bit halves: dwords come out as q0[0..3] q1[0..3] q2[0..3] q3[0..3]
  // q0[4..7] ...; the permutation restores natural order.
  const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// finish_span with AVX2: the same bytes and integers (a deinterleave and exact sums).
__attribute__((target("avx2,fma"))) void finish_span_avx2(const int8_t* v, const float* sxh,
                                                         QSpan& q) {
  // Per 128-bit lane: its 8 even bytes, then its 8 odd ones; then the 64-bit quarters reordered
  // to the 16 evens and the 16 odds of 32 elements.
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < kSpanScales; ++j) {
    const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(v + 32 * j));
    const __m256i eo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, split), 0xD8);
    _mm_store_si128(reinterpret_cast<__m128i*>(q.even + 16 * j), _mm256_castsi256_si128(eo));
    _mm_store_si128(reinterpret_cast<__m128i*>(q.odd + 16 * j), _mm256_extracti128_si256(eo, 1));
    // Sums of 8 consecutive bytes, biased to unsigned for vpsadbw: Σ(v + 128) − 1024.
    const __m256i sums = _mm256_sub_epi64(_mm256_sad_epu8(_mm256_xor_si256(b, bias), _mm256_setzero_si256()),
                                          _mm256_set1_epi64x(8 * 128));
    const __m256i corr = _mm256_mullo_epi32(
        _mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)),
        _mm256_set1_epi32(-kOffset));
    _mm_store_si128(reinterpret_cast<__m128i*>(q.corr + 4 * j), _mm256_castsi256_si128(corr));
    _mm_store_ps(q.sxh + 4 * j, _mm_set1_ps(sxh[j]));
  }
}
#endif

void quantize_row(const float* x, int64_t cols, int64_t spans, QSpan* out, bool vector) {
  for (int64_t s = 0; s < spans; ++s) {
    alignas(32) int8_t v[kSpan];
    float sxh[kSpanScales];
    for (int64_t j = 0; j < kSpanScales; ++j) {
      const int64_t k0 = s * kSpan + j * mxfp4::kBlock;
      int8_t* qb = v + j * mxfp4::kBlock;
      if (k0 >= cols) {
        std::memset(qb, 0, mxfp4::kBlock);
        sxh[j] = 0;
        continue;
      }
#ifdef MOE_Q8_X86
      if (vector) {
        quantize_block_avx2(x + k0, qb, sxh[j]);
        continue;
      }
#endif
      quantize_block(x + k0, qb, sxh[j]);
    }
#ifdef MOE_Q8_X86
    if (vector) {
      finish_span_avx2(v, sxh, out[s]);
      continue;
    }
#endif
    finish_span(v, sxh, out[s]);
  }
}

// A W row: its whole spans are read in place; a short last span (rest > 0 columns) is read as
// if padded with zero codes and unit scales (scale byte 127). The padded elements meet q = 0, so
// whatever codes a vector tile loads there add nothing to the exact integer sums.
struct RowSpans {
  const uint8_t* packed;
  const uint8_t* scales;
  const uint8_t* ahead;  // the packed row prefetched, further on in the row stream (run())
  int64_t full;          // whole spans
  int64_t rest;          // columns of the short last span, 0 if none

  void set(const uint8_t* p, const uint8_t* sc, int64_t cols, const uint8_t* next) {
    packed = p;
    scales = sc;
    ahead = next;
    full = cols / kSpan;
    rest = cols - full * kSpan;
  }
  // The short last span's scale bytes, padded with 127, as the dword the vector tiles broadcast
  // (byte j in bits 8j..8j+7: x86 is little-endian).
  int32_t tail_scales() const {
    uint32_t e4 = 0x7F7F7F7F;
    for (int64_t j = 0; j < kSpanScales - 1; ++j)  // rest < kSpan: at most 3 blocks
      if (j < rest / mxfp4::kBlock)
        e4 = (e4 & ~(0xFFu << (8 * j))) | uint32_t{scales[full * kSpanScales + j]} << (8 * j);
    return static_cast<int32_t>(e4);
  }
};

// The adjacent-pair tree of 16 lanes.
inline float tree16(const float* t) {
  const float a0 = t[0] + t[1], a1 = t[2] + t[3], a2 = t[4] + t[5], a3 = t[6] + t[7];
  const float a4 = t[8] + t[9], a5 = t[10] + t[11], a6 = t[12] + t[13], a7 = t[14] + t[15];
  return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}

// ---- scalar: the contract, spelled out ----------------------------------------------------

template <int A, int B>
bool tile_scalar(const QSpan* const* xq, int64_t spans, const RowSpans* rows, float* out) {
  for (int a = 0; a < A; ++a)
    for (int b = 0; b < B; ++b) {
      float acc[kLanes] = {};
      uint8_t tail_packed[kSpanBytes] = {}, tail_scales[kSpanScales] = {127, 127, 127, 127};
      if (rows[b].rest > 0) {
        std::memcpy(tail_packed, rows[b].packed + rows[b].full * kSpanBytes, static_cast<size_t>(rows[b].rest / 2));
        std::memcpy(tail_scales, rows[b].scales + rows[b].full * kSpanScales,
                    static_cast<size_t>(rows[b].rest / mxfp4::kBlock));
      }
      for (int64_t s = 0; s < spans; ++s) {
        const QSpan& q = xq[a][s];
        const bool whole = s < rows[b].full;
        const uint8_t* p = whole ? rows[b].packed + s * kSpanBytes : tail_packed;
        const uint8_t* e = whole ? rows[b].scales + s * kSpanScales : tail_scales;
        for (int64_t l = 0; l < kLanes; ++l) {
          int32_t sum = 0;
          for (int64_t i = 4 * l; i < 4 * l + 4; ++i)
            sum += kWeightTable[p[i] & 15] * q.even[i] + kWeightTable[p[i] >> 4] * q.odd[i];
          const float c = q.sxh[l] * mxfp4::e8m0_value(e[l / 4]);
          acc[l] = std::fma(static_cast<float>(sum + q.corr[l]), c, acc[l]);
        }
      }
      out[a * B + b] = tree16(acc);
    }
  return true;
}

#ifdef MOE_Q8_X86

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*, which -Wuninitialized flags in
// every caller (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define MOE_Q8_AVX512_BASE __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

// The adjacent-pair tree of each of 4 vectors at once: every step adds lanes (2j, 2j+1) of two
// inputs into lane j (first input) and 8 + j (second), so after 4 steps lane i holds the tree
// of vector i — the same additions as tree16, in a quarter of the instructions.
MOE_Q8_AVX512_BASE inline __m512 pair_step(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

MOE_Q8_AVX512_BASE inline void tree16_x4(const __m512* v, float* out) {
  // lanes 0-7: v0's pairs, 8-15: v1's; then v0 0-3, v1 4-7, v2 8-11, v3 12-15; ...
  const __m512 d = pair_step(pair_step(v[0], v[1]), pair_step(v[2], v[3]));
  const __m512 e = pair_step(d, _mm512_setzero_ps());  // v0 0-1, v1 2-3, v2 4-5, v3 6-7
  const __m512 f = pair_step(e, _mm512_setzero_ps());  // v_i in lane i
  _mm_storeu_ps(out, _mm512_castps512_ps128(f));
}

#define MOE_Q8_AVX512_VNNI                                                                        \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma")))

// The tiles read a W row's whole spans in place and its padded last span (if any) after them;
// every span prefetches one cache line, into L2, of the row rows_ahead() / B rows on in the same
// row stream (run() spreads a tile's rows over B streams). With adjacent rows and one stream, the
// hardware prefetchers alone left a Zen 4 core streaming about 9 GB/s while the decode loop ran,
// and 64 rows ahead into L2 gave 13-15 GB/s. With B = 4 streams on an Emerald Rapids Xeon, 2
// rows ahead in each gave the most: 0.81-0.87 of the DRAM read, against 0.66-0.72 with adjacent
// rows; 1, 4, 16 and 64 rows ahead per stream gave 0.78-0.80, 0.74-0.83, 0.70-0.83, 0.63-0.69.
//
// The AVX-512 tile builds 2^(e-127) as the float with exponent field e, right for scale bytes
// 1..254 only; it notes a byte 0 (2^-127, a subnormal) or 255 (NaN) and says so, and the caller
// redoes the tile with the scalar code. The test runs on the integer units, which the
// vector-bound loop leaves idle (the same test in vector registers cost 7% on AVX-512).
struct ScaleRange {
  uint32_t seen = 0;  // bit 7 of a byte: some scale byte there was 0 or 255
  void add(int32_t e) {
    const auto v = static_cast<uint32_t>(e);
    seen |= ((v - 0x01010101u) & ~v) | ((~v - 0x01010101u) & v);
  }
  bool ordinary() const { return (seen & 0x80808080u) == 0; }
};

// ---- AVX-512 VNNI + VBMI: one 16-lane vector per output; vpdpbusd sums 4 products per lane in
// one instruction. (AVX-512 CPUs without both run the AVX2 tile: same bits.) -----------------

template <int A, int B>
MOE_Q8_AVX512_VNNI __attribute__((always_inline)) inline void span_avx512(
    const QSpan* const* xq, int64_t s, int b, __m512i v, int32_t e4, __m512i table, __m512i spread,
    ScaleRange& range, __m512* acc) {
  // The table repeats the 16 codes 4 times: vpermb's index bits 4-5 (and 6-7) do not matter.
  const __m512i w_even = _mm512_permutexvar_epi8(v, table);
  const __m512i w_odd = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), table);
  range.add(e4);
  // Lane l takes scale byte l/4 as its exponent field.
  const __m512 ws = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32(e4), spread), 23));
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a) {
    const QSpan& q = xq[a][s];
    const __m512i sums = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(_mm512_load_si512(q.corr), w_even, _mm512_load_si512(q.even)), w_odd,
        _mm512_load_si512(q.odd));
    const __m512 c = _mm512_mul_ps(_mm512_load_ps(q.sxh), ws);
    acc[a * B + b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), c, acc[a * B + b]);
  }
}

template <int A, int B>
MOE_Q8_AVX512_VNNI bool tile_avx512_vnni(const QSpan* const* xq, int64_t spans,
                                         const RowSpans* rows, float* out) {
  const __m512i table =
      _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kWeightTable)));
  const __m512i spread = _mm512_set_epi32(
      0x80808003, 0x80808003, 0x80808003, 0x80808003, 0x80808002, 0x80808002, 0x80808002,
      0x80808002, 0x80808001, 0x80808001, 0x80808001, 0x80808001, 0x80808000, 0x80808000,
      0x80808000, 0x80808000);
  ScaleRange range;
  __m512 acc[A * B];
#pragma GCC unroll 16
  for (int i = 0; i < A * B; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full = rows[0].full;
  for (int64_t s = 0; s < full; ++s) {
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[b].ahead + s * kSpanBytes), _MM_HINT_T1);
      int32_t e4;
      std::memcpy(&e4, rows[b].scales + s * kSpanScales, 4);
      span_avx512<A, B>(xq, s, b, _mm512_loadu_si512(rows[b].packed + s * kSpanBytes), e4, table,
                        spread, range, acc);
    }
  }
  if (spans > full) {
    const __mmask64 bytes = (uint64_t{1} << (rows[0].rest / 2)) - 1;
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b)
      span_avx512<A, B>(xq, full, b, _mm512_maskz_loadu_epi8(bytes, rows[b].packed + full * kSpanBytes),
                        rows[b].tail_scales(), table, spread, range, acc);
  }
  static_assert(A * B % 4 == 0);
#pragma GCC unroll 4
  for (int i = 0; i < A * B; i += 4) tree16_x4(acc + i, out + i);
  return range.ordinary();
}

// ---- AVX2: lanes 0-7 and 8-15 as two 8-lane vectors (halves of a span) ----------------------

#define MOE_Q8_AVX2 __attribute__((target("avx2,fma")))

// The tile's constants, read as memory operands: AVX2 has 16 vector registers, and with the
// constants and one span of x held in registers GCC kept the tile's accumulators on the stack
// (a load and a store around every FMA).
struct alignas(32) Avx2Constants {
  int8_t low4[32];
  int16_t ones[16];
};
constexpr Avx2Constants kAvx2Constants = [] {
  Avx2Constants c{};
  for (int8_t& v : c.low4) v = 0x0F;
  for (int16_t& v : c.ones) v = 1;
  return c;
}();

// 2^(e-127) for every scale byte e (mxfp4::kE8m0Floats: 0 gives the subnormal 2^-127, 255
// NaN), four times, so that the 8 lanes of a half (lanes 0-3 under one block's scale, 4-7 under
// the next) are two 16-byte loads and an insert: one vector operation where building the floats
// from the bytes took two, and every byte is exact, so this tile needs no edge-byte fallback.
struct alignas(16) ScaleQuad {
  float v[4];
};
constexpr auto kScaleQuads = [] {
  std::array<ScaleQuad, 256> t{};
  for (size_t e = 0; e < 256; ++e)
    for (float& f : t[e].v) f = mxfp4::kE8m0Floats[e];
  return t;
}();

// Hides where p points from the optimizer, so that what is read through it is read where it is
// used (a memory operand) rather than kept in a register from an earlier read.
template <typename T>
inline const T* opaque(const T* p) {
  asm("" : "+r"(p));
  return p;
}

template <int A, int B>
MOE_Q8_AVX2 __attribute__((always_inline)) inline void span_avx2(
    const QSpan* const* xq, int64_t s, int b, const __m256i* halves, const uint8_t* scales,
    __m256i table, __m256 (*acc)[2]) {
  const Avx2Constants* k = opaque(&kAvx2Constants);
  const auto* low4 = reinterpret_cast<const __m256i*>(k->low4);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i v = halves[h];
    const __m256i w_even = _mm256_shuffle_epi8(table, _mm256_and_si256(v, _mm256_load_si256(low4)));
    const __m256i w_odd = _mm256_shuffle_epi8(
        table, _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_load_si256(low4)));
    const __m256 ws = _mm256_insertf128_ps(
        _mm256_castps128_ps256(_mm_load_ps(kScaleQuads[scales[2 * h]].v)),
        _mm_load_ps(kScaleQuads[scales[2 * h + 1]].v), 1);
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a) {
      const QSpan& q = *opaque(&xq[a][s]);
      const __m256i pairs = _mm256_add_epi16(
          _mm256_maddubs_epi16(w_even, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.even + 32 * h))),
          _mm256_maddubs_epi16(w_odd, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.odd + 32 * h))));
      const __m256i sums = _mm256_add_epi32(
          _mm256_madd_epi16(pairs, _mm256_load_si256(reinterpret_cast<const __m256i*>(k->ones))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(q.corr + 8 * h)));
      const __m256 c = _mm256_mul_ps(_mm256_load_ps(q.sxh + 8 * h), ws);
      acc[a * B + b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), c, acc[a * B + b][h]);
    }
  }
}

// tree16 of 4 outputs at once (lanes 0-7 in v[i][0], 8-15 in v[i][1]): vhaddps adds adjacent
// lanes within each 128-bit half, so every addition is one of tree16's. Stored and summed one
// float at a time, the trees cost a one-token tile 3-5% of its speed at K = 1,024 (docs/PERF.md).
MOE_Q8_AVX2 inline void tree16_x4_avx2(const __m256 (*v)[2], float* out) {
  // Per output: [p0 p1 p4 p5 | p2 p3 p6 p7], p_j = lanes 2j + 2j+1.
  const __m256 p0 = _mm256_hadd_ps(v[0][0], v[0][1]), p1 = _mm256_hadd_ps(v[1][0], v[1][1]);
  const __m256 p2 = _mm256_hadd_ps(v[2][0], v[2][1]), p3 = _mm256_hadd_ps(v[3][0], v[3][1]);
  // [q0 q2 of output 0, q0 q2 of 1 | q1 q3 of 0, q1 q3 of 1], q_j = p_2j + p_2j+1 (and 2, 3).
  const __m256 q01 = _mm256_hadd_ps(p0, p1), q23 = _mm256_hadd_ps(p2, p3);
  // r0 = q0 + q1, r1 = q2 + q3: [r0 r1 of outputs 0, 1 | of outputs 2, 3].
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(q01, q23, 0x20),
                                 _mm256_permute2f128_ps(q01, q23, 0x31));
  const __m256 y = _mm256_hadd_ps(r, r);  // r0 + r1 in lanes 0, 1, 4, 5
  _mm_storel_pi(reinterpret_cast<__m64*>(out), _mm256_castps256_ps128(y));
  _mm_storel_pi(reinterpret_cast<__m64*>(out + 2), _mm256_extractf128_ps(y, 1));
}

template <int A, int B>
MOE_Q8_AVX2 bool tile_avx2(const QSpan* const* xq, int64_t spans, const RowSpans* rows,
                           float* out) {
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kWeightTable)));
  __m256 acc[A * B][2];
#pragma GCC unroll 16
  for (int i = 0; i < A * B; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const int64_t full = rows[0].full;
  for (int64_t s = 0; s < full; ++s) {
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[b].ahead + s * kSpanBytes), _MM_HINT_T1);
      const auto* p = reinterpret_cast<const __m256i*>(rows[b].packed + s * kSpanBytes);
      const __m256i halves[2] = {_mm256_loadu_si256(p), _mm256_loadu_si256(p + 1)};
      span_avx2<A, B>(xq, s, b, halves, rows[b].scales + s * kSpanScales, table, acc);
    }
  }
  if (spans > full) {
    // 16, 32 or 48 bytes: whole dwords, loaded without touching the bytes after the row.
    const int bytes = static_cast<int>(rows[0].rest / 2);
    const __m256i lane = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(bytes), lane),
                             _mm256_cmpgt_epi32(_mm256_set1_epi32(bytes - 32), lane)};
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const auto* p = reinterpret_cast<const int*>(rows[b].packed + full * kSpanBytes);
      // (p + 8 is not formed unless the second half has bytes: it may lie past the buffer.)
      const __m256i halves[2] = {_mm256_maskload_epi32(p, mask[0]),
                                 bytes > 32 ? _mm256_maskload_epi32(p + 8, mask[1]) : _mm256_setzero_si256()};
      const int32_t e4 = rows[b].tail_scales();
      uint8_t scales[kSpanScales];
      std::memcpy(scales, &e4, sizeof scales);
      span_avx2<A, B>(xq, full, b, halves, scales, table, acc);
    }
  }
  static_assert(A * B % 4 == 0);
#pragma GCC unroll 4
  for (int i = 0; i < A * B; i += 4) tree16_x4_avx2(acc + i, out + i);
  return true;
}

#pragma GCC diagnostic pop

#endif  // MOE_Q8_X86

using TileFn = bool (*)(const QSpan* const*, int64_t, const RowSpans*, float*);

// Tiles of A x rows × B W rows. The AVX-512 tile says when it met an edge scale byte (its result
// is then wrong), and the scalar tile, which gives the contract's bits for every byte, redoes it.
template <int A, int B>
void run(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y, int64_t ldy,
         bool accumulate, TileFn tile) {
  const int64_t spans = (w.cols + kSpan - 1) / kSpan;
  const int64_t panel_rows = std::min(m, kRowsPerPanel);
  // QSpan is 256 bytes = 64 floats; the panel holds panel_rows (rounded up to A) rows.
  auto* panel = reinterpret_cast<QSpan*>(
      kernel_scratch(0, (panel_rows + A) * spans * static_cast<int64_t>(sizeof(QSpan) / 4)));
  QSpan* zero_row = panel + (panel_rows + A - 1) / A * A * spans;
  const bool vector = simd::current() != simd::Target::Scalar;
  if (m % A != 0) quantize_row(nullptr, 0, spans, zero_row, vector);  // stands in for rows past m
  RowSpans rows[B];
  float out[A * B];
  const int64_t ahead = rows_ahead() / B;
  for (int64_t i0 = 0; i0 < m; i0 += kRowsPerPanel) {
    const int64_t mi = std::min(kRowsPerPanel, m - i0);
    for (int64_t i = 0; i < mi; ++i) quantize_row(x + (i0 + i) * ldx, w.cols, spans, panel + i * spans, vector);
    // Row b of tile t is row b·Q + t: B streams a B-th of the matrix apart, each followed by
    // its own hardware prefetcher (the reason is at mxfp4_gemm.cpp's TileRows), each
    // prefetching rows_ahead() / B rows ahead in itself.
    const int64_t tiles = (w.rows + B - 1) / B;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t nb = std::min<int64_t>(B, (w.rows - t + tiles - 1) / tiles);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t r = std::min<int64_t>(b, nb - 1) * tiles + t;  // repeats the last real row
        const int64_t rn = std::min({r + ahead, (b + 1) * tiles - 1, w.rows - 1});
        rows[b].set(w.packed + r * w.packed_stride, w.scales + r * w.scale_stride, w.cols,
                    w.packed + rn * w.packed_stride);
#ifdef MOE_Q8_X86
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + rn * w.scale_stride), _MM_HINT_T0);
#endif
      }
      for (int64_t a0 = 0; a0 < mi; a0 += A) {
        const int64_t na = std::min<int64_t>(A, mi - a0);
        const QSpan* xq[A];
        for (int64_t a = 0; a < A; ++a) xq[a] = a < na ? panel + (a0 + a) * spans : zero_row;
        if (!tile(xq, spans, rows, out)) tile_scalar<A, B>(xq, spans, rows, out);
        for (int64_t a = 0; a < na; ++a)
          for (int64_t b = 0; b < nb; ++b) {
            float& dst = y[(i0 + a0 + a) * ldy + b * tiles + t];
            dst = accumulate ? dst + out[a * B + b] : out[a * B + b];
          }
      }
    }
  }
}

}  // namespace

void mxfp4_gemm_nt_q8(int64_t m, const float* x, int64_t ldx, const Mxfp4Matrix& w, float* y,
                      int64_t ldy, bool accumulate) {
  MOE_CHECK(w.cols % mxfp4::kBlock == 0, "mxfp4_gemm_nt_q8: cols {} is not a multiple of 32",
            w.cols);
  if (m <= 0 || w.rows <= 0) return;
  switch (simd::current()) {
#ifdef MOE_Q8_X86
    case simd::Target::Avx512: {
      static const bool vnni_vbmi =
          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
      if (vnni_vbmi)
        return m == 1 ? run<1, 4>(m, x, ldx, w, y, ldy, accumulate, tile_avx512_vnni<1, 4>)
                      : run<2, 4>(m, x, ldx, w, y, ldy, accumulate, tile_avx512_vnni<2, 4>);
      [[fallthrough]];
    }
    case simd::Target::Avx2:
      return m == 1 ? run<1, 4>(m, x, ldx, w, y, ldy, accumulate, tile_avx2<1, 4>)
                    : run<2, 2>(m, x, ldx, w, y, ldy, accumulate, tile_avx2<2, 2>);
#endif
    default: return run<1, 1>(m, x, ldx, w, y, ldy, accumulate, tile_scalar<1, 1>);
  }
}

}  // namespace moe
