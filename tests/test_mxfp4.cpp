// MXFP4 codec against the OCP MX v1.0 definitions (bit-exact vectors, special blocks, a
// brute-force nearest-value quantizer) and the fused kernels against "dequantize the whole
// matrix, then a double-precision matmul", on every Highway target this build carries.
#include <hwy/targets.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/simd.h"
#include "kernels/gemm.h"
#include "kernels/mxfp4.h"
#include "kernels/mxfp4_gemm.h"
#include "kernels/mxfp4_gemm_q8.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace mx = moe::mxfp4;

namespace {

uint32_t bits(float v) { return std::bit_cast<uint32_t>(v); }

// ---------------------------------------------------------------------------------- codec

TEST(Mxfp4Codec, EveryE2M1CodeDecodesAndEncodesBack) {
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(bits(mx::e2m1_value(static_cast<uint8_t>(c))), bits(want[c])) << "code " << c;
    // High bits are ignored on decode.
    EXPECT_EQ(bits(mx::e2m1_value(static_cast<uint8_t>(0xA0 | c))), bits(want[c]));
    EXPECT_EQ(mx::e2m1_encode(want[c]), c) << "value " << want[c];
  }
  EXPECT_TRUE(std::signbit(mx::e2m1_value(8)));
}

TEST(Mxfp4Codec, RoundingTiesGoToEvenAndLargeValuesSaturate) {
  struct Case {
    float v;
    uint8_t code;
  };
  const Case cases[] = {
      {0.25f, 0},    {0.75f, 2},  {1.25f, 2},   {1.75f, 4},   {2.5f, 4},    {3.5f, 6},
      {5.0f, 6},     {0.1f, 0},   {0.3f, 1},    {0.7f, 1},    {1.3f, 3},    {2.6f, 5},
      {3.4f, 5},     {5.1f, 7},   {6.0f, 7},    {7.0f, 7},    {100.0f, 7},  {1e30f, 7},
      {INFINITY, 7}, {-0.25f, 8}, {-0.75f, 10}, {-1.25f, 10}, {-1.75f, 12}, {-2.5f, 12},
      {-3.5f, 14},   {-5.0f, 14}, {-6.0f, 15},  {-7.0f, 15},  {-1e30f, 15}, {-INFINITY, 15},
      {0.0f, 0},     {-0.0f, 8},  {-0.1f, 8},   {1e-40f, 0},  {-1e-40f, 8},
  };
  for (const Case& c : cases) EXPECT_EQ(mx::e2m1_encode(c.v), c.code) << "v = " << c.v;
  // Just off each tie the nearest value wins.
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const uint8_t below[] = {0, 1, 2, 3, 4, 5, 6}, above[] = {1, 2, 3, 4, 5, 6, 7};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(mx::e2m1_encode(std::nextafter(ties[i], 0.0f)), below[i]) << ties[i];
    EXPECT_EQ(mx::e2m1_encode(std::nextafter(ties[i], 10.0f)), above[i]) << ties[i];
  }
  EXPECT_EQ(mx::e2m1_encode(NAN), 0);
}

TEST(Mxfp4Codec, ScaleBytesDecodeToExactPowersOfTwo) {
  EXPECT_EQ(bits(mx::e8m0_value(0)), 0x00400000u);  // 2^-127, a subnormal, not zero
  EXPECT_EQ(mx::e8m0_value(0), std::ldexp(1.0f, -127));
  EXPECT_GT(mx::e8m0_value(0), 0.0f);
  EXPECT_EQ(mx::e8m0_value(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(mx::e8m0_value(127), 1.0f);
  EXPECT_EQ(mx::e8m0_value(128), 2.0f);
  EXPECT_EQ(mx::e8m0_value(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(mx::e8m0_value(255)));
  for (int e = 0; e < 255; ++e)
    EXPECT_EQ(static_cast<double>(mx::e8m0_value(static_cast<uint8_t>(e))),
              std::ldexp(1.0, e - 127));
}

// Independent reference quantizer: per block, shared exponent from the spec formula evaluated in
// double, then the nearest of the 15 distinct E2M1 values by exhaustive search (ties to the even
// code, saturation by clamping the scaled value to ±6 first).
void reference_quantize(const float* v, int64_t n, std::vector<uint8_t>& codes,
                        std::vector<uint8_t>& scales) {
  codes.assign(static_cast<size_t>(n), 0);
  scales.assign(static_cast<size_t>(n / 32), 0);
  for (int64_t b = 0; b < n / 32; ++b) {
    double amax = 0;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      finite = finite && std::isfinite(v[b * 32 + i]);
      amax = std::max(amax, std::fabs(static_cast<double>(v[b * 32 + i])));
    }
    if (!finite) {
      scales[b] = 0xFF;
      continue;
    }
    if (amax == 0) continue;
    const int e = std::clamp(static_cast<int>(std::floor(std::log2(amax))) - 2, -127, 127);
    scales[b] = static_cast<uint8_t>(e + 127);
    for (int i = 0; i < 32; ++i) {
      const double s = std::clamp(std::ldexp(static_cast<double>(v[b * 32 + i]), -e), -6.0, 6.0);
      int best = 0;
      double best_err = INFINITY;
      for (int c = 0; c < 8; ++c) {
        const double err = std::fabs(std::fabs(s) - mx::e2m1_value(static_cast<uint8_t>(c)));
        if (err < best_err || (err == best_err && c % 2 == 0)) best = c, best_err = err;
      }
      codes[b * 32 + i] = static_cast<uint8_t>(best | (std::signbit(s) ? 8 : 0));
    }
  }
}

std::vector<uint8_t> unpack(const std::vector<uint8_t>& packed) {
  std::vector<uint8_t> codes;
  for (uint8_t byte : packed) codes.push_back(byte & 15), codes.push_back(byte >> 4);
  return codes;
}

TEST(Mxfp4Codec, QuantizeMatchesBruteForceNearestIncludingTies) {
  Rng rng(11);
  const int64_t n = 32 * 400;
  std::vector<float> v(n);
  for (int64_t b = 0; b < n / 32; ++b) {
    // Blocks at many magnitudes; every fourth block made of exact tie points k/4 · 2^e.
    const float mag = std::ldexp(1.0f, static_cast<int>(rng.next_u64() % 60) - 30);
    for (int i = 0; i < 32; ++i) {
      float x = mag * rng.normal();
      if (b % 4 == 0) x = std::ldexp(static_cast<float>(rng.next_u64() % 33) / 4.0f, -3) * mag;
      if (b % 4 == 0 && rng.next_u64() % 2) x = -x;
      v[b * 32 + i] = x;
    }
  }
  std::vector<uint8_t> packed(n / 2), scales(n / 32), want_codes, want_scales;
  mx::quantize_row(v.data(), n, packed.data(), scales.data());
  reference_quantize(v.data(), n, want_codes, want_scales);
  EXPECT_EQ(scales, want_scales);
  EXPECT_EQ(unpack(packed), want_codes);
}

TEST(Mxfp4Codec, PackingPutsElementTwoIInTheLowNibble) {
  std::vector<float> v(32, 0.0f);
  v[0] = 4.0f;   // code 6, low nibble of byte 0
  v[1] = -1.0f;  // code 10, high nibble of byte 0
  v[30] = 0.5f;  // code 1, low nibble of byte 15
  v[31] = 6.0f;  // code 7, high nibble of byte 15; amax 6 -> shared exponent 0, scale byte 127
  uint8_t packed[16], scale;
  mx::quantize_row(v.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 127);
  EXPECT_EQ(packed[0], 0x06 | (10 << 4));
  EXPECT_EQ(packed[15], 0x01 | (7 << 4));
  for (int i = 1; i < 15; ++i) EXPECT_EQ(packed[i], 0);
}

TEST(Mxfp4Codec, ZeroNanAndInfBlocks) {
  // Four blocks: all zero (with a -0), one NaN, one +Inf, one -Inf; each among finite values.
  std::vector<float> v(128, 1.5f);
  for (int i = 0; i < 32; ++i) v[i] = i == 3 ? -0.0f : 0.0f;
  v[32 + 7] = NAN;
  v[64 + 31] = INFINITY;
  v[96] = -INFINITY;
  std::vector<uint8_t> packed(64, 0xAB), scales(4, 0xAB);
  mx::quantize_row(v.data(), 128, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 0);  // documented choice: 2^-127, elements +0
  for (int b = 1; b < 4; ++b) EXPECT_EQ(scales[b], 0xFF) << b;
  for (uint8_t byte : packed) EXPECT_EQ(byte, 0);
  std::vector<float> back(128);
  mx::dequantize_row(packed.data(), scales.data(), 128, back.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(bits(back[i]), 0u) << i;
  for (int i = 32; i < 128; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;

  // A poisoned block leaves its neighbours alone.
  std::vector<float> w(64, 3.0f);
  w[40] = NAN;
  uint8_t p2[32], s2[2];
  mx::quantize_row(w.data(), 64, p2, s2);
  EXPECT_EQ(s2[0], 126);  // amax 3: floor(log2 3) - 2 = -1
  EXPECT_EQ(s2[1], 0xFF);
}

TEST(Mxfp4Codec, SubnormalInputs) {
  // k · 2^-128 for k = 0..12: amax 12·2^-128 has floor(log2) = -125, so shared exponent -127
  // (scale byte 0) and the scaled values are k/2, exact ties included.
  std::vector<float> v(32, 0.0f);
  for (int k = 0; k <= 12; ++k) v[k] = std::ldexp(static_cast<float>(k), -128);
  for (int k = 13; k < 32; ++k) v[k] = -std::ldexp(static_cast<float>(k % 7), -128);
  uint8_t packed[16], scale;
  mx::quantize_row(v.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 0);
  const std::vector<uint8_t> codes = unpack(std::vector<uint8_t>(packed, packed + 16));
  for (int k = 0; k < 32; ++k) {
    const float scaled = std::ldexp(v[k], 127);
    EXPECT_EQ(codes[k], mx::e2m1_encode(scaled)) << k;
  }
  EXPECT_EQ(codes[5], 4);   // 2.5 -> 2
  EXPECT_EQ(codes[7], 6);   // 3.5 -> 4
  EXPECT_EQ(codes[10], 6);  // 5 -> 4
  EXPECT_EQ(codes[12], 7);  // 6
  std::vector<float> back(32);
  mx::dequantize_row(packed, &scale, 32, back.data());
  EXPECT_EQ(back[2], std::ldexp(1.0f, -127));  // 1.0 · 2^-127, exact
  EXPECT_EQ(back[1], std::ldexp(1.0f, -128));  // 0.5 · 2^-127

  // Tiny blocks clamp to scale byte 0 and round to zero; the smallest subnormal is the extreme.
  std::vector<float> tiny(32, std::numeric_limits<float>::denorm_min());
  mx::quantize_row(tiny.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 0);
  for (uint8_t byte : packed) EXPECT_EQ(byte, 0);
  // Values too small to clamp still scale exactly: 2^-127 alone is 1.0 · 2^-127.
  std::vector<float> one(32, 0.0f);
  one[9] = std::ldexp(1.0f, -127);
  mx::quantize_row(one.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 0);
  EXPECT_EQ(unpack(std::vector<uint8_t>(packed, packed + 16))[9], 2);
  // The largest finite float lands in scale byte 252 (exponent 125) and saturates to 6.
  std::vector<float> big(32, std::numeric_limits<float>::max());
  mx::quantize_row(big.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 252);
  EXPECT_EQ(packed[0], 0x77);
}

// Random packed rows whose every block holds a ±4 or ±6 (so amax fixes the block's own scale)
// and scales that keep 6·2^(e-127) finite: quantize(dequantize(q)) must give q back, byte for
// byte, -0 codes included.
TEST(Mxfp4Codec, QuantizeOfDequantizeIsTheIdentityOnValidData) {
  Rng rng(3);
  const int64_t n = 32 * 2000;
  std::vector<uint8_t> packed(n / 2), scales(n / 32);
  for (auto& b : packed) b = static_cast<uint8_t>(rng.next_u64());
  for (int64_t b = 0; b < n / 32; ++b) {
    scales[b] = static_cast<uint8_t>(rng.next_u64() % 253);  // 0..252
    const int64_t i = static_cast<int64_t>(rng.next_u64() % 32);
    const uint8_t code =
        static_cast<uint8_t>((rng.next_u64() % 2 ? 6 : 7) | (rng.next_u64() % 2 ? 8 : 0));
    uint8_t& byte = packed[(b * 32 + i) / 2];
    byte = i % 2 ? static_cast<uint8_t>((byte & 0x0F) | (code << 4))
                 : static_cast<uint8_t>((byte & 0xF0) | code);
  }
  scales[0] = 0, scales[1] = 252;  // both extremes always present
  std::vector<float> v(n);
  mx::dequantize_row(packed.data(), scales.data(), n, v.data());
  std::vector<uint8_t> packed2(n / 2), scales2(n / 32);
  mx::quantize_row(v.data(), n, packed2.data(), scales2.data());
  EXPECT_EQ(scales2, scales);
  EXPECT_EQ(packed2, packed);
}

TEST(Mxfp4Codec, DequantizeOfQuantizeIsWithinHalfAStep) {
  Rng rng(4);
  const int64_t n = 32 * 1000;
  std::vector<float> v(n), back(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = std::ldexp(rng.normal(), static_cast<int>(i / 32 % 40) - 20);
  std::vector<uint8_t> packed(n / 2), scales(n / 32);
  mx::quantize_row(v.data(), n, packed.data(), scales.data());
  mx::dequantize_row(packed.data(), scales.data(), n, back.data());
  for (int64_t i = 0; i < n; ++i) {
    const double s = mx::e8m0_value(scales[i / 32]), a = std::fabs(static_cast<double>(v[i]));
    const double err = std::fabs(static_cast<double>(back[i]) - v[i]);
    // E2M1 spacing is s/2 below 2s, s in [2s, 4s) and 2s in [4s, 6s]; the block maximum (< 8s)
    // may saturate to 6s, an error below a quarter of itself.
    const double half_step = a < 2 * s ? 0.25 * s : a < 4 * s ? 0.5 * s : s;
    EXPECT_LE(err, a > 6 * s ? 0.25 * a : half_step) << "i = " << i;
    EXPECT_EQ(std::signbit(back[i]), std::signbit(v[i])) << i;
  }
}

TEST(Mxfp4Codec, LengthMustBeAMultipleOf32) {
  float v[48] = {};
  uint8_t p[24], s[2];
  EXPECT_NE(error_of([&] { mx::quantize_row(v, 48, p, s); }), "(no error)");
  EXPECT_NE(error_of([&] { mx::dequantize_row(p, s, 48, v); }), "(no error)");
}

// -------------------------------------------------------------------------------- kernels

// A packed matrix with room around it: rows × cols_total, row strides larger than needed, so
// sub-matrices (row and 32-aligned column ranges) can be carved out of it.
struct PackedMatrix {
  int64_t rows, cols, pstride, sstride;
  std::vector<uint8_t> packed, scales;

  PackedMatrix(int64_t r, int64_t c, Rng& rng) : rows(r), cols(c) {
    pstride = c / 2 + 7;  // deliberately not a multiple of anything useful
    sstride = c / 32 + 3;
    packed.assign(static_cast<size_t>(std::max<int64_t>(1, r * pstride)), 0);
    scales.assign(static_cast<size_t>(std::max<int64_t>(1, r * sstride)), 0);
    for (auto& b : packed) b = static_cast<uint8_t>(rng.next_u64());
    // Scales 2^-6 .. 2^2 around 2^-2: magnitudes like real weights, all codes present.
    for (auto& s : scales) s = static_cast<uint8_t>(121 + rng.next_u64() % 9);
    // The bytes between rows are NaN scales: a kernel that reads a scale past a row's last
    // block gives NaN where the references do not.
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = c / 32; j < sstride; ++j) scales[static_cast<size_t>(i * sstride + j)] = 255;
  }
  Mxfp4Matrix view(int64_t r0 = 0, int64_t rn = -1, int64_t c0 = 0, int64_t cn = -1) const {
    if (rn < 0) rn = rows - r0;
    if (cn < 0) cn = cols - c0;
    return {packed.data() + r0 * pstride + c0 / 2,
            scales.data() + r0 * sstride + c0 / 32,
            rn,
            cn,
            pstride,
            sstride};
  }
};

std::vector<float> dequantize(const Mxfp4Matrix& w) {
  std::vector<float> out(static_cast<size_t>(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r)
    mx::dequantize_row(w.packed + r * w.packed_stride, w.scales + r * w.scale_stride, w.cols,
                       out.data() + r * w.cols);
  return out;
}

std::vector<float> random_floats(int64_t n, Rng& rng) {
  std::vector<float> v(static_cast<size_t>(std::max<int64_t>(n, 1)));
  for (auto& x : v) x = rng.normal();
  return v;
}

// Checks mxfp4_gemm_nt on x [m, cols] (row stride ldx) against the double reference; y has row
// stride ldy > rows so the kernel must not touch the gap; accumulate adds to random y.
void check_nt(const Mxfp4Matrix& w, int64_t m, int64_t ldx, int64_t ldy, bool accumulate,
              Rng& rng) {
  SCOPED_TRACE(::testing::Message() << "nt m=" << m << " rows=" << w.rows << " cols=" << w.cols
                                    << " ldx=" << ldx << " ldy=" << ldy << " acc=" << accumulate);
  const std::vector<float> W = dequantize(w), x = random_floats(m * ldx, rng);
  std::vector<float> y = random_floats(m * ldy, rng);
  const std::vector<float> y0 = y;
  mxfp4_gemm_nt(m, x.data(), ldx, w, y.data(), ldy, accumulate);
  std::vector<double> want(static_cast<size_t>(m * w.rows));
  std::vector<float> got(want.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < w.rows; ++r) {
      double s = accumulate ? y0[i * ldy + r] : 0.0;
      for (int64_t c = 0; c < w.cols; ++c)
        s += static_cast<double>(x[i * ldx + c]) * W[r * w.cols + c];
      want[i * w.rows + r] = s;
      got[i * w.rows + r] = y[i * ldy + r];
    }
  EXPECT_LT(rel_error(got.data(), want.data(), m * w.rows), 1e-6);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = w.rows; r < ldy; ++r) ASSERT_EQ(y[i * ldy + r], y0[i * ldy + r]);
}

void check_nn(const Mxfp4Matrix& w, int64_t m, int64_t lddy, int64_t lddx, bool accumulate,
              Rng& rng) {
  SCOPED_TRACE(::testing::Message()
               << "nn m=" << m << " rows=" << w.rows << " cols=" << w.cols << " lddy=" << lddy
               << " lddx=" << lddx << " acc=" << accumulate);
  const std::vector<float> W = dequantize(w), dy = random_floats(m * lddy, rng);
  std::vector<float> dx = random_floats(m * lddx, rng);
  const std::vector<float> dx0 = dx;
  mxfp4_gemm_nn(m, dy.data(), lddy, w, dx.data(), lddx, accumulate);
  std::vector<double> want(static_cast<size_t>(m * w.cols));
  std::vector<float> got(want.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < w.cols; ++c) {
      double s = accumulate ? dx0[i * lddx + c] : 0.0;
      for (int64_t r = 0; r < w.rows; ++r)
        s += static_cast<double>(dy[i * lddy + r]) * W[r * w.cols + c];
      want[i * w.cols + c] = s;
      got[i * w.cols + c] = dx[i * lddx + c];
    }
  EXPECT_LT(rel_error(got.data(), want.data(), m * w.cols), 1e-6);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = w.cols; c < lddx; ++c) ASSERT_EQ(dx[i * lddx + c], dx0[i * lddx + c]);
}

const int64_t kMs[] = {0, 1, 2, 3, 7, 8, 9, 31, 64, 65, 200};
const int64_t kCols[] = {32, 64, 96, 1024};
const int64_t kRows[] = {1, 5, 16, 33, 256};

TEST(Mxfp4Gemm, MatchesDequantizedDoubleReference) {
  Rng rng(21);
  for (int64_t cols : kCols)
    for (int64_t rows : kRows) {
      const PackedMatrix pm(rows, cols, rng);
      for (int64_t m : kMs) {
        const bool acc = (m + rows) % 2 == 1;
        check_nt(pm.view(), m, cols, rows, acc, rng);
        check_nn(pm.view(), m, rows, cols, !acc, rng);
      }
    }
}

// Contraction lengths past the kernels' internal chunks (1024 columns for nt, 256 rows for nn)
// and widths that leave partial tiles.
TEST(Mxfp4Gemm, LongContractionsAcrossChunks) {
  Rng rng(22);
  for (int64_t cols : {1056, 2080})
    for (int64_t rows : {257, 520})
      for (int64_t m : {1, 5, 9, 70}) {
        const PackedMatrix pm(rows, cols, rng);
        check_nt(pm.view(), m, cols, rows, m % 2 == 0, rng);
        check_nn(pm.view(), m, rows, cols, m % 2 == 1, rng);
      }
}

// Row and 32-aligned column sub-ranges of a larger packed matrix, with leading dimensions
// wider than the operands, accumulating and overwriting.
TEST(Mxfp4Gemm, StridedSubMatrices) {
  Rng rng(23);
  const PackedMatrix pm(70, 320, rng);
  for (int64_t m : {1, 4, 8, 13, 66})
    for (bool acc : {false, true}) {
      const Mxfp4Matrix sub = pm.view(/*r0=*/3, /*rn=*/41, /*c0=*/64, /*cn=*/192);
      check_nt(sub, m, 192 + 5, 41 + 3, acc, rng);
      check_nn(sub, m, 41 + 9, 192 + 17, acc, rng);
    }
}

// The kernels' arithmetic per output does not depend on m or on the tiling (see
// mxfp4_gemm.cpp), so a call on some of the rows reproduces those rows' bits exactly — also
// across the small-m (fused) / large-m (buffered) switch. Likewise for W row subsets (nt) and
// 32-column block subsets (nn).
TEST(Mxfp4Gemm, SubsetCallsReproduceTheFullCallBitForBit) {
  Rng rng(24);
  const int64_t m = 70, rows = 100, cols = 1088;
  const PackedMatrix pm(rows, cols, rng);
  const std::vector<float> x = random_floats(m * cols, rng), dy = random_floats(m * rows, rng);
  std::vector<float> y(m * rows), dx(m * cols);
  mxfp4_gemm_nt(m, x.data(), cols, pm.view(), y.data(), rows, false);
  mxfp4_gemm_nn(m, dy.data(), rows, pm.view(), dx.data(), cols, false);
  for (int64_t i0 : {0, 9, 41})
    for (int64_t k : {1, 2, 3, 5, 8, 9, 29}) {
      std::vector<float> ys(k * rows), dxs(k * cols);
      mxfp4_gemm_nt(k, x.data() + i0 * cols, cols, pm.view(), ys.data(), rows, false);
      mxfp4_gemm_nn(k, dy.data() + i0 * rows, rows, pm.view(), dxs.data(), cols, false);
      EXPECT_EQ(std::memcmp(ys.data(), y.data() + i0 * rows, ys.size() * 4), 0) << i0 << " " << k;
      EXPECT_EQ(std::memcmp(dxs.data(), dx.data() + i0 * cols, dxs.size() * 4), 0)
          << i0 << " " << k;
    }
  // nt on W rows [17, 17+23): y columns [17, 40).
  std::vector<float> ys(m * 23);
  mxfp4_gemm_nt(m, x.data(), cols, pm.view(17, 23), ys.data(), 23, false);
  for (int64_t i = 0; i < m; ++i)
    EXPECT_EQ(std::memcmp(ys.data() + i * 23, y.data() + i * rows + 17, 23 * 4), 0) << i;
  // nn on W columns [96, 96+544): dx columns [96, 640).
  std::vector<float> dxs(m * 544);
  mxfp4_gemm_nn(m, dy.data(), rows, pm.view(0, -1, 96, 544), dxs.data(), 544, false);
  for (int64_t i = 0; i < m; ++i)
    EXPECT_EQ(std::memcmp(dxs.data() + i * 544, dx.data() + i * cols + 96, 544 * 4), 0) << i;
}

TEST(Mxfp4Gemm, EmptyOperands) {
  Rng rng(25);
  const PackedMatrix pm(8, 64, rng);
  std::vector<float> x(64, 1.0f), y(8, 5.0f);
  mxfp4_gemm_nt(0, x.data(), 64, pm.view(), y.data(), 8, false);  // m = 0: nothing written
  EXPECT_EQ(y[0], 5.0f);
  // Empty contraction: accumulate leaves y, overwrite clears it (like gemm_*_serial).
  mxfp4_gemm_nt(1, x.data(), 64, pm.view(0, -1, 0, 0), y.data(), 8, true);
  EXPECT_EQ(y[0], 5.0f);
  mxfp4_gemm_nt(1, x.data(), 64, pm.view(0, -1, 0, 0), y.data(), 8, false);
  for (float v : y) EXPECT_EQ(v, 0.0f);
  std::vector<float> dx(64, 5.0f);
  mxfp4_gemm_nn(1, y.data(), 8, pm.view(0, 0), dx.data(), 64, true);
  EXPECT_EQ(dx[0], 5.0f);
  mxfp4_gemm_nn(1, y.data(), 8, pm.view(0, 0), dx.data(), 64, false);
  for (float v : dx) EXPECT_EQ(v, 0.0f);
  Mxfp4Matrix bad = pm.view();
  bad.cols = 48;
  EXPECT_NE(error_of([&] { mxfp4_gemm_nt(1, x.data(), 64, bad, y.data(), 8, false); }),
            "(no error)");
  EXPECT_NE(error_of([&] { mxfp4_gemm_nn(1, y.data(), 8, bad, dx.data(), 64, false); }),
            "(no error)");
}

// Scale bytes at the ends of the range decode exactly in the kernels too (2^-127 is not zero,
// 2^125 is not Inf): matrices with one scale byte throughout, inputs scaled so the products
// stay normal.
TEST(Mxfp4Gemm, ExtremeScaleBytes) {
  Rng rng(28);
  for (int scale : {0, 1, 2, 126, 127, 128, 200, 252}) {
    PackedMatrix pm(9, 96, rng);
    for (auto& s : pm.scales) s = static_cast<uint8_t>(scale);
    const float in_scale = std::ldexp(1.0f, scale <= 127 ? 100 : -100);
    for (int64_t m : {3, 12, 40}) {  // 40: AVX2's per-lane path
      SCOPED_TRACE(::testing::Message() << "scale byte " << scale << " m=" << m);
      const std::vector<float> W = dequantize(pm.view());
      std::vector<float> x = random_floats(m * 96, rng), dy = random_floats(m * 9, rng);
      for (float& v : x) v *= in_scale;
      for (float& v : dy) v *= in_scale;
      std::vector<float> y(m * 9), dx(m * 96);
      mxfp4_gemm_nt(m, x.data(), 96, pm.view(), y.data(), 9, false);
      mxfp4_gemm_nn(m, dy.data(), 9, pm.view(), dx.data(), 96, false);
      std::vector<double> wy(m * 9, 0.0), wdx(m * 96, 0.0);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < 9; ++r)
          for (int64_t c = 0; c < 96; ++c) {
            wy[i * 9 + r] += static_cast<double>(x[i * 96 + c]) * W[r * 96 + c];
            wdx[i * 96 + c] += static_cast<double>(dy[i * 9 + r]) * W[r * 96 + c];
          }
      EXPECT_LT(rel_error(y.data(), wy.data(), m * 9), 1e-6);
      EXPECT_LT(rel_error(dx.data(), wdx.data(), m * 96), 1e-6);
      EXPECT_GT(max_abs(y.data(), m * 9), 0.0);
    }
  }
}

// Every finite scale byte with every code in every position of a block, through each path (m
// picks fused, buffered or per-lane tiles): a unit-vector x row or dy row reads one decoded
// weight or one decoded row back exactly. The decode tables of the kernels are built apart from
// the codec (mxfp4_gemm.cpp); scale bytes above 252 overflow some codes to infinity (0 · inf).
TEST(Mxfp4Gemm, EveryScaleByteAndCodeDecodesAsTheCodec) {
  constexpr int64_t kScales = 253, kCols = 64;
  Rng rng(31);
  PackedMatrix pm(kScales, kCols, rng);
  for (int64_t r = 0; r < kScales; ++r) {
    uint8_t* row = pm.packed.data() + r * pm.pstride;
    for (int64_t i = 0; i < 16; ++i) {
      row[i] = static_cast<uint8_t>(i | (15 - i) << 4);
      row[16 + i] = static_cast<uint8_t>((i + 5) % 16 | (i * 3 + r) % 16 << 4);
    }
    pm.scales[r * pm.sstride] = static_cast<uint8_t>(r);
    pm.scales[r * pm.sstride + 1] = static_cast<uint8_t>(kScales - 1 - r);
  }
  const std::vector<float> W = dequantize(pm.view());
  for (int64_t m : {1, 12, 32, 64}) {
    SCOPED_TRACE(::testing::Message() << "m=" << m);
    for (int64_t c0 = 0; c0 < kCols; c0 += m) {
      std::vector<float> x(m * kCols, 0.0f), y(m * kScales);
      for (int64_t i = 0; i < m; ++i) x[i * kCols + (c0 + i) % kCols] = 1.0f;
      mxfp4_gemm_nt(m, x.data(), kCols, pm.view(), y.data(), kScales, false);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < kScales; ++r) {
          const int64_t c = (c0 + i) % kCols;
          ASSERT_EQ(y[i * kScales + r], W[r * kCols + c]) << "nt: row " << r << ", column " << c;
        }
    }
    for (int64_t r0 = 0; r0 < kScales; r0 += m) {
      std::vector<float> dy(m * kScales, 0.0f), dx(m * kCols);
      for (int64_t i = 0; i < m; ++i) dy[i * kScales + (r0 + i) % kScales] = 1.0f;
      mxfp4_gemm_nn(m, dy.data(), kScales, pm.view(), dx.data(), kCols, false);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < kCols; ++c) {
          const int64_t r = (r0 + i) % kScales;
          ASSERT_EQ(dx[i * kCols + c], W[r * kCols + c]) << "nn: row " << r << ", column " << c;
        }
    }
  }
}

// NaN scales poison exactly the outputs that read them.
TEST(Mxfp4Gemm, NanScalePropagates) {
  Rng rng(26);
  PackedMatrix pm(4, 64, rng);
  pm.scales[2 * pm.sstride + 1] = 0xFF;  // row 2, second block
  std::vector<float> x = random_floats(40 * 64, rng), y(40 * 4), dy(4, 1.0f), dx(64);
  for (int64_t m : {1, 12, 40}) {  // fused, buffered and (AVX2) per-lane paths
    mxfp4_gemm_nt(m, x.data(), 64, pm.view(), y.data(), 4, false);
    for (int64_t i = 0; i < m * 4; ++i) EXPECT_EQ(std::isnan(y[i]), i % 4 == 2) << m << " " << i;
  }
  mxfp4_gemm_nn(1, dy.data(), 4, pm.view(), dx.data(), 64, false);
  for (int c = 0; c < 64; ++c) EXPECT_EQ(std::isnan(dx[c]), c >= 32) << c;
}

// The kernels' arithmetic spelled out (mxfp4_gemm.h), for bitwise comparison.
// nt: per chunk of 1,024 columns, 16 lanes; lane l adds, block by block, x·w of elements 2l and
// 2l + 1 of the block (fused multiply-adds); the lanes are summed by the adjacent-pair tree;
// y = the first chunk's sum (or y + it when accumulating), + each later one.
std::vector<float> nt_contract(const Mxfp4Matrix& w, int64_t m, const float* x, int64_t ldx,
                               std::vector<float> y, int64_t ldy, bool accumulate) {
  const std::vector<float> W = dequantize(w);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < w.rows; ++r)
      for (int64_t c0 = 0; c0 < w.cols; c0 += 1024) {
        float lanes[16] = {};
        for (int64_t b = c0; b < std::min(w.cols, c0 + 1024); b += 32)
          for (int l = 0; l < 16; ++l)
            for (int e = 0; e < 2; ++e) {
              const int64_t c = b + 2 * l + e;
              lanes[l] = std::fma(x[i * ldx + c], W[r * w.cols + c], lanes[l]);
            }
        for (int width = 16; width > 1; width /= 2)
          for (int j = 0; j < width / 2; ++j) lanes[j] = lanes[2 * j] + lanes[2 * j + 1];
        float& out = y[i * ldy + r];
        out = c0 == 0 && !accumulate ? lanes[0] : out + lanes[0];
      }
  return y;
}

TEST(Mxfp4Gemm, NtIsItsSpelledOutArithmeticOnEveryTarget) {
  Rng rng(29);
  for_each_simd_target([&](simd::Target) {
    // Every row count of the small-m tile table (kernels/mxfp4_gemm.cpp, with_nt_kernel), then
    // the buffered and per-lane paths.
    for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 40})
      for (int64_t cols : {32, 320, 1088, 2080})
        for (bool acc : {false, true}) {
          const PackedMatrix pm(13, cols, rng);
          const std::vector<float> x = random_floats(m * (cols + 3), rng), y0 = random_floats(m * 15, rng);
          std::vector<float> y = y0;
          mxfp4_gemm_nt(m, x.data(), cols + 3, pm.view(), y.data(), 15, acc);
          const std::vector<float> want = nt_contract(pm.view(), m, x.data(), cols + 3, y0, 15, acc);
          ASSERT_EQ(std::memcmp(y.data(), want.data(), y.size() * 4), 0)
              << "m=" << m << " cols=" << cols << " acc=" << acc;
        }
  });
}

TEST(Mxfp4Gemm, NnIsTheFp32GemmOnTheDecodedWeightsOnEveryTarget) {
  // dx = dy·W is the fp32 gemm_nn's chain over W's rows in order, on the dequantized values.
  // 520 rows: AVX2 runs the fp32 GEMM itself on W's decoded rows (kNnGemmFromRows).
  Rng rng(30);
  for_each_simd_target([&](simd::Target) {
    for (int64_t m : {1, 2, 3, 4, 5, 8, 9, 40, 520})
      for (int64_t rows : {1, 17, 300})
        for (bool acc : {false, true}) {
          const PackedMatrix pm(rows, 352, rng);
          const std::vector<float> W = dequantize(pm.view());
          const std::vector<float> dy = random_floats(m * rows, rng), dx0 = random_floats(m * 360, rng);
          std::vector<float> got = dx0, want = dx0;
          mxfp4_gemm_nn(m, dy.data(), rows, pm.view(), got.data(), 360, acc);
          gemm_nn_serial(m, 352, rows, dy.data(), rows, W.data(), 352, want.data(), 360, acc);
          ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
              << "m=" << m << " rows=" << rows << " acc=" << acc;
        }
  });
}

TEST(Mxfp4Gemm, SameBitsOnEveryTarget) {
  Rng rng(31);
  const PackedMatrix pm(70, 1088, rng);
  const std::vector<float> x = random_floats(50 * 1088, rng), dy = random_floats(50 * 70, rng);
  for (int64_t m : {1, 2, 7, 50})
    expect_same_bits_on_every_target([&] {
      std::vector<float> y(m * 70), dx(m * 1088);
      mxfp4_gemm_nt(m, x.data(), 1088, pm.view(), y.data(), 70, false);
      mxfp4_gemm_nn(m, dy.data(), 70, pm.view(), dx.data(), 1088, false);
      y.insert(y.end(), dx.begin(), dx.end());
      return y;
    });
}

// Issue 9's contract for every matmul entry point, on every target: a row computed alone equals
// the same row inside a 1,000-row call, bit for bit.
TEST(Mxfp4Gemm, RowAloneEqualsRowInsideAThousandRowCall) {
  Rng rng(28);
  const int64_t m = 1000, rows = 96, cols = 320;
  const PackedMatrix pm(rows, cols, rng);
  const std::vector<float> x = random_floats(m * cols, rng), dy = random_floats(m * rows, rng);
  for_each_simd_target([&](simd::Target) {
    std::vector<float> y(m * rows), dx(m * cols), y1(rows), dx1(cols);
    mxfp4_gemm_nt(m, x.data(), cols, pm.view(), y.data(), rows, false);
    mxfp4_gemm_nn(m, dy.data(), rows, pm.view(), dx.data(), cols, false);
    for (int64_t i : {0, 1, 7, 8, 9, 500, 999}) {
      mxfp4_gemm_nt(1, x.data() + i * cols, cols, pm.view(), y1.data(), rows, false);
      mxfp4_gemm_nn(1, dy.data() + i * rows, rows, pm.view(), dx1.data(), cols, false);
      EXPECT_EQ(std::memcmp(y1.data(), y.data() + i * rows, rows * 4), 0) << "nt row " << i;
      EXPECT_EQ(std::memcmp(dx1.data(), dx.data() + i * cols, cols * 4), 0) << "nn row " << i;
    }
  });
}

// The same checks on every SIMD target this CPU runs (the scalar one included).
TEST(Mxfp4Gemm, EveryTarget) {
  Rng rng(27);
  for_each_simd_target([&](simd::Target) {
    for (int64_t m : {1, 2, 5, 9, 40}) {
      const PackedMatrix pm(37, 1088, rng);
      check_nt(pm.view(), m, 1088, 37, m % 2 == 0, rng);
      check_nn(pm.view(0, -1, 32, 1024), m, 37, 1024 + 3, m % 2 == 1, rng);
    }
  });
  EXPECT_GE(simd::supported().size(), 2u) << "scalar and at least one vector target";
}

// ---- int8-activation inference path (mxfp4_gemm_q8.h) ------------------------------------

// Its arithmetic spelled out independently of the kernel (top of mxfp4_gemm_q8.cpp): x blocks
// quantized with q = nearbyint(x · (127 / amax)), half-scale amax / 254; per 128-column span,
// lane l sums 2·E2M1·q over the span's elements 8l..8l+7 exactly, then
// acc_l = fma(float(sum), sxh · 2^(e − 127), acc_l); y = adjacent-pair tree (+ y).
std::vector<float> q8_contract(const Mxfp4Matrix& w, int64_t m, const float* x, int64_t ldx,
                               std::vector<float> y, int64_t ldy, bool accumulate) {
  const int64_t blocks = w.cols / 32, spans = (w.cols + 127) / 128;
  for (int64_t i = 0; i < m; ++i) {
    std::vector<int> q(static_cast<size_t>(spans * 128), 0);
    std::vector<float> sxh(static_cast<size_t>(spans * 4), 0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      float amax = 0;
      bool finite = true;
      for (int64_t k = 32 * b; k < 32 * b + 32; ++k) {
        finite = finite && std::isfinite(x[i * ldx + k]);
        amax = std::max(amax, std::fabs(x[i * ldx + k]));
      }
      if (!finite) {
        sxh[b] = std::nanf("");
        continue;
      }
      if (amax == 0) continue;
      sxh[b] = amax / 254.0f;
      for (int64_t k = 32 * b; k < 32 * b + 32; ++k)
        q[k] = static_cast<int>(std::nearbyint(x[i * ldx + k] * (127.0f / amax)));
    }
    for (int64_t r = 0; r < w.rows; ++r) {
      float lanes[16] = {};
      for (int64_t s = 0; s < spans; ++s)
        for (int l = 0; l < 16; ++l) {
          const int64_t blk = 4 * s + l / 4;
          if (blk >= blocks) {
            lanes[l] = std::fma(0.0f, 0.0f, lanes[l]);
            continue;
          }
          int sum = 0;
          for (int64_t k = 128 * s + 8 * l; k < 128 * s + 8 * l + 8; ++k) {
            const uint8_t byte = w.packed[r * w.packed_stride + k / 2];
            sum += static_cast<int>(2 * mx::e2m1_value(k % 2 ? byte >> 4 : byte & 15)) * q[k];
          }
          const float c = sxh[blk] * mx::e8m0_value(w.scales[r * w.scale_stride + blk]);
          lanes[l] = std::fma(static_cast<float>(sum), c, lanes[l]);
        }
      for (int width = 16; width > 1; width /= 2)
        for (int j = 0; j < width / 2; ++j) lanes[j] = lanes[2 * j] + lanes[2 * j + 1];
      float& out = y[i * ldy + r];
      out = accumulate ? out + lanes[0] : lanes[0];
    }
  }
  return y;
}

TEST(Mxfp4GemmQ8, IsItsSpelledOutArithmeticOnEveryTarget) {
  Rng rng(41);
  for_each_simd_target([&](simd::Target) {
    for (int64_t m : {1, 2, 3, 5, 70})
      for (int64_t cols : {32, 96, 128, 160, 1088})
        for (int64_t rows : {1, 6, 13})
          for (bool acc : {false, true}) {
            const PackedMatrix pm(rows, cols, rng);
            const std::vector<float> x = random_floats(m * (cols + 5), rng),
                                     y0 = random_floats(m * (rows + 2), rng);
            std::vector<float> y = y0;
            mxfp4_gemm_nt_q8(m, x.data(), cols + 5, pm.view(), y.data(), rows + 2, acc);
            const std::vector<float> want =
                q8_contract(pm.view(), m, x.data(), cols + 5, y0, rows + 2, acc);
            ASSERT_EQ(std::memcmp(y.data(), want.data(), y.size() * 4), 0)
                << "m=" << m << " cols=" << cols << " rows=" << rows << " acc=" << acc;
          }
  });
}

// The only error is the activation rounding: per output at most half a quantization step per
// element, |y − y_exact| <= Σ_blocks (amax / 254) · Σ|w|, plus fp32 rounding of the sums.
TEST(Mxfp4GemmQ8, ErrorIsBoundedByTheActivationRounding) {
  Rng rng(42);
  const PackedMatrix pm(40, 1024, rng);
  const std::vector<float> W = dequantize(pm.view());
  for (int64_t m : {1, 9}) {
    std::vector<float> x = random_floats(m * 1024, rng);
    for (int64_t k = 0; k < m * 1024; k += 97) x[k] *= 30;  // outliers widen some blocks' steps
    std::vector<float> y(m * 40);
    mxfp4_gemm_nt_q8(m, x.data(), 1024, pm.view(), y.data(), 40, false);
    double worst = 0, typical = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = 0; r < 40; ++r) {
        double exact = 0, bound = 0, mag = 0;
        for (int64_t b = 0; b < 32; ++b) {
          double amax = 0, wsum = 0;
          for (int64_t k = 32 * b; k < 32 * b + 32; ++k) {
            const double xv = x[i * 1024 + k], wv = W[r * 1024 + k];
            exact += xv * wv;
            mag += std::fabs(xv * wv);
            amax = std::max(amax, std::fabs(xv));
            wsum += std::fabs(wv);
          }
          bound += amax / 254 * wsum;
        }
        const double err = std::fabs(y[i * 40 + r] - exact);
        EXPECT_LE(err, bound + 1e-5 * mag) << "row " << i << " out " << r;
        worst = std::max(worst, err / bound);
        typical += err / mag;
      }
    EXPECT_GT(worst, 0.0);  // it does round
    EXPECT_LT(typical / (m * 40), 5e-3);
  }
}

// Scale bytes 0 (2^-127), 1, 254 and 255 (NaN): the vector tiles hand such tiles to the scalar
// one, so the contract holds for them too, on every target; a NaN scale poisons exactly the
// outputs that read it, a non-finite activation every output of its row.
TEST(Mxfp4GemmQ8, EdgeScalesAndNonFiniteInputs) {
  Rng rng(43);
  for_each_simd_target([&](simd::Target) {
    PackedMatrix pm(9, 256, rng);
    pm.scales[1 * pm.sstride + 0] = 0;
    pm.scales[2 * pm.sstride + 5] = 1;
    pm.scales[3 * pm.sstride + 7] = 253;
    pm.scales[6 * pm.sstride + 2] = 255;
    std::vector<float> x = random_floats(2 * 256, rng), y(2 * 9);
    x[256 + 40] = INFINITY;  // row 1, block 1
    mxfp4_gemm_nt_q8(2, x.data(), 256, pm.view(), y.data(), 9, false);
    const std::vector<float> want = q8_contract(pm.view(), 2, x.data(), 256, y, 9, false);
    EXPECT_TRUE(std::isnan(y[6]));
    for (int64_t r = 0; r < 9; ++r) {
      EXPECT_TRUE(std::isnan(y[9 + r])) << r;
      // Row 3's 2^126 block may overflow to ±Inf (and NaN in the lane tree), as the contract does.
      if (r != 6 && !(std::isnan(y[r]) && std::isnan(want[r]))) {
        EXPECT_EQ(std::memcmp(&y[r], &want[r], 4), 0) << r << ": " << y[r] << " vs " << want[r];
      }
    }
    EXPECT_FALSE(std::isnan(y[1]) || std::isnan(y[2])) << "2^-127 and 2^-126 blocks are finite";
    // The same in a short last span (160 columns: its block 4 is the tail span's only block),
    // with x zero elsewhere and the block's codes all +1, so a tile that missed the edge bytes
    // would give 0 instead of the 2^-127 block's tiny sum and +Inf instead of NaN.
    PackedMatrix tail(5, 160, rng);
    tail.scales[1 * tail.sstride + 4] = 0;
    tail.scales[3 * tail.sstride + 4] = 255;
    for (int64_t r : {1, 3})
      for (int64_t k = 64; k < 80; ++k) tail.packed[static_cast<size_t>(r * tail.pstride + k)] = 0x22;
    std::vector<float> xt(3 * 160, 0.0f), yt(3 * 5);
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t k = 128; k < 160; ++k) xt[i * 160 + k] = 0.5f + 0.01f * static_cast<float>(k - 128 + i);
    mxfp4_gemm_nt_q8(3, xt.data(), 160, tail.view(), yt.data(), 5, false);
    const std::vector<float> want_t = q8_contract(tail.view(), 3, xt.data(), 160, yt, 5, false);
    for (int64_t i = 0; i < 15; ++i) {
      EXPECT_EQ(std::isnan(yt[i]), i % 5 == 3) << i;
      if (i % 5 != 3) {
        EXPECT_EQ(std::memcmp(&yt[i], &want_t[i], 4), 0) << i;
      }
      if (i % 5 == 1) {
        EXPECT_NE(yt[i], 0.0f) << "the 2^-127 block's sum is tiny, not zero";
      }
    }
    std::vector<float> zeros(256, 0.0f), yz(9, 1.0f);
    mxfp4_gemm_nt_q8(1, zeros.data(), 256, pm.view(0, 6), yz.data(), 9, false);
    for (int64_t r = 0; r < 6; ++r) EXPECT_EQ(yz[r], 0.0f);
  });
}

TEST(Mxfp4GemmQ8, RowAloneEqualsRowInsideAThousandRowCall) {
  Rng rng(44);
  const int64_t m = 1000, rows = 24, cols = 320;
  const PackedMatrix pm(rows, cols, rng);
  const std::vector<float> x = random_floats(m * cols, rng);
  for_each_simd_target([&](simd::Target) {
    std::vector<float> y(m * rows), y1(rows);
    mxfp4_gemm_nt_q8(m, x.data(), cols, pm.view(), y.data(), rows, false);
    for (int64_t i : {0, 1, 63, 64, 65, 999}) {
      mxfp4_gemm_nt_q8(1, x.data() + i * cols, cols, pm.view(), y1.data(), rows, false);
      EXPECT_EQ(std::memcmp(y1.data(), y.data() + i * rows, rows * 4), 0) << "row " << i;
    }
  });
}

TEST(Mxfp4GemmQ8, RejectsColumnsNotAMultipleOf32) {
  Rng rng(45);
  const PackedMatrix pm(2, 64, rng);
  Mxfp4Matrix bad = pm.view();
  bad.cols = 40;
  std::vector<float> x(64), y(2);
  EXPECT_NE(error_of([&] { mxfp4_gemm_nt_q8(1, x.data(), 64, bad, y.data(), 2, false); }),
            "(no error)");
}

}  // namespace
