// The simulated low precision of DeepSeek-V4's reference forward (kernels/quant_sim.h,
// model/v4/simulated_precision.h) against plain references written here: the power-of-two
// block scales, E4M3 and E2M1 rounding (ties to even) by brute force over each format's grid,
// round trips of values the formats hold, the Hadamard rotation against Sylvester's matrix, and
// which features of a row each kind touches.
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/quant_sim.h"
#include "model/v4/simulated_precision.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

// A format's non-negative grid, ascending, with each value's code parity (the even code wins a
// tie): E4M3 m/8·2^-6 (subnormal) and (1 + m/8)·2^e up to 448; E2M1 0, .5, 1, 1.5, 2, 3, 4, 6.
struct GridPoint {
  double value;
  bool even_code;
};

std::vector<GridPoint> e4m3_grid() {
  std::vector<GridPoint> g;
  for (int m = 0; m < 8; ++m) g.push_back({std::ldexp(m / 8.0, -6), m % 2 == 0});
  for (int e = -6; e <= 8; ++e)
    for (int m = 0; m < 8; ++m) {
      const double v = std::ldexp(1.0 + m / 8.0, e);
      if (v <= 448.0) g.push_back({v, m % 2 == 0});
    }
  return g;
}

std::vector<GridPoint> e2m1_grid() {
  const double v[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  std::vector<GridPoint> g;
  for (int c = 0; c < 8; ++c) g.push_back({v[c], c % 2 == 0});
  return g;
}

// The nearest grid value to v (|v| within the grid), ties to the even code; the sign is v's.
double nearest(const std::vector<GridPoint>& grid, double v) {
  const double a = std::fabs(v);
  const GridPoint* best = &grid[0];
  for (const GridPoint& p : grid) {
    const double d = std::fabs(p.value - a), db = std::fabs(best->value - a);
    if (d < db || (d == db && p.even_code && !best->even_code)) best = &p;
  }
  return std::copysign(best->value, v);
}

// The reference's scale, by search instead of float bits: the smallest power of two s (down to
// 2^-126) with max(amax, floor) · fl(1 / max) <= s, the product rounded to float first.
float scale_by_search(float amax, float floor, float max_value) {
  const float r = std::max(amax, floor) * (1.0f / max_value);
  int e = -126;
  while (std::ldexp(1.0, e) < static_cast<double>(r)) ++e;
  return std::ldexp(1.0f, e);
}

// The block quantize-dequantize, element by element from the plain references.
std::vector<float> expected_blocks(const std::vector<float>& x, int64_t block,
                                   const std::vector<GridPoint>& grid, float floor,
                                   float max_value) {
  std::vector<float> out(x.size());
  for (size_t b0 = 0; b0 < x.size(); b0 += static_cast<size_t>(block)) {
    float amax = 0;
    for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(x[b0 + i]));
    const float s = scale_by_search(amax, floor, max_value);
    for (int64_t i = 0; i < block; ++i) {
      const double v = std::clamp(static_cast<double>(x[b0 + i]) / s, -double(max_value),
                                  double(max_value));
      out[b0 + i] = static_cast<float>(nearest(grid, v) * s);
    }
  }
  return out;
}

std::vector<float> random_values(int64_t n, uint64_t seed, float scale) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = scale * rng.normal();
  return v;
}

void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]) && ++bad <= 5)
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << ", want " << want[i];
  EXPECT_EQ(bad, 0) << what;
}

}  // namespace

TEST(QuantSim, BlockScalesArePowersOfTwoFromTheFloatProduct) {
  // 2^ceil(log2(amax / max)): exact powers of two of max stay, anything above doubles.
  EXPECT_EQ(sim_fp8_scale(448.0f), 1.0f);
  EXPECT_EQ(sim_fp8_scale(std::nextafter(448.0f, 1e9f)), 2.0f);
  EXPECT_EQ(sim_fp8_scale(224.5f), 1.0f);
  EXPECT_EQ(sim_fp8_scale(224.0f), 0.5f);
  EXPECT_EQ(sim_fp8_scale(3.5f), 1.0f / 128);
  EXPECT_EQ(sim_fp4_scale(6.0f), 1.0f);
  EXPECT_EQ(sim_fp4_scale(0.75f), 0.125f);
  // DeepSeek's rule, not OCP MX's (floor(log2 amax) - 2, which gives 1 for amax 7).
  EXPECT_EQ(sim_fp4_scale(7.0f), 2.0f);
  // The floors: 1e-4 (FP8) and 6·2^-126 (FP4), so zeros and tiny blocks get a finite scale.
  EXPECT_EQ(sim_fp8_scale(0.0f), std::ldexp(1.0f, -22));  // 1e-4 / 448 = 2.2e-7 < 2^-22
  EXPECT_EQ(sim_fp4_scale(0.0f), std::ldexp(1.0f, -126));
  Rng rng(3);
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::ldexp(rng.uniform() + 0.5f,
                                  static_cast<int>(rng.next_u64() % 60) - 40);
    ASSERT_EQ(sim_fp8_scale(amax), scale_by_search(amax, 1e-4f, 448.0f)) << amax;
    ASSERT_EQ(sim_fp4_scale(amax), scale_by_search(amax, 6.0f * 0x1p-126f, 6.0f)) << amax;
  }
}

TEST(QuantSim, Fp8RoundsToTheNearestE4M3ValueTiesToEven) {
  // Scale 1 (amax 304): 1.0625 lies halfway between 1 and 1.125, 1.1875 between 1.125 and
  // 1.25, 304 between 288 and 320, -1.0625 as 1.0625; ties go to the even mantissa (1, 1.25,
  // 320 = 1.25·2^8). 2^-10 is half the smallest subnormal 2^-9, 3·2^-11 three quarters of it.
  std::vector<float> x(64, 0.0f);
  x[0] = 300.0f;
  x[1] = 1.0625f;
  x[2] = 1.1875f;
  x[3] = 304.0f;
  x[4] = -1.0625f;
  x[5] = 0x1p-10f;
  x[6] = 3 * 0x1p-11f;
  x[7] = 1.07f;
  fp8_e4m3_quant_dequant(x.data(), 64, kSimFp8Block);
  EXPECT_EQ(x[0], 288.0f);
  EXPECT_EQ(x[1], 1.0f);
  EXPECT_EQ(x[2], 1.25f);
  EXPECT_EQ(x[3], 320.0f);
  EXPECT_EQ(x[4], -1.0f);
  EXPECT_EQ(x[5], 0.0f);
  EXPECT_EQ(x[6], 0x1p-9f);
  EXPECT_EQ(x[7], 1.125f);
  // Random blocks over many magnitudes against the brute-force grid search.
  for (float magnitude : {1e-6f, 3e-3f, 1.0f, 50.0f, 1e5f}) {
    std::vector<float> v = random_values(64 * 40, 11, magnitude);
    const std::vector<float> want = expected_blocks(v, 64, e4m3_grid(), 1e-4f, 448.0f);
    fp8_e4m3_quant_dequant(v.data(), static_cast<int64_t>(v.size()), kSimFp8Block);
    expect_bits(v, want, "fp8");
  }
}

TEST(QuantSim, Fp4RoundsToTheNearestE2M1ValueTiesToEvenAndRoundTrips) {
  for (float magnitude : {1e-30f, 0.01f, 1.0f, 300.0f}) {
    std::vector<float> v = random_values(32 * 60, 12, magnitude);
    const std::vector<float> want = expected_blocks(v, 32, e2m1_grid(), 6.0f * 0x1p-126f, 6.0f);
    fp4_e2m1_quant_dequant(v.data(), static_cast<int64_t>(v.size()), kSimFp4Block);
    expect_bits(v, want, "fp4");
  }
  // Ties at scale 1 (amax 6): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  std::vector<float> t = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -5.0f, -0.75f};
  t.resize(32, 0.0f);
  fp4_e2m1_quant_dequant(t.data(), 32, kSimFp4Block);
  const std::vector<float> want = {6, 0, 1, 1, 2, 2, 4, 4, -4, -1};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(t[i], want[i]) << i;
  // Values the format holds come back unchanged, at any power-of-two scale (amax = 6·2^k).
  for (int k : {-20, -3, 0, 7}) {
    std::vector<float> held;
    for (int i = 0; i < 32; ++i)
      held.push_back(std::ldexp((i % 2 ? -1.0f : 1.0f) * static_cast<float>(e2m1_grid()[i % 8].value), k));
    std::vector<float> again = held;
    fp4_e2m1_quant_dequant(again.data(), 32, kSimFp4Block);
    expect_bits(again, held, "fp4 round trip");
    fp4_e2m1_quant_dequant(again.data(), 32, kSimFp4Block);
    expect_bits(again, held, "fp4 round trip twice");
  }
  // E4M3 values at their block's scale round-trip too, and quantizing twice changes nothing.
  std::vector<float> v = random_values(128, 13, 2.0f);
  fp8_e4m3_quant_dequant(v.data(), 128, kSimFp8Block);
  std::vector<float> twice = v;
  fp8_e4m3_quant_dequant(twice.data(), 128, kSimFp8Block);
  expect_bits(twice, v, "fp8 idempotent");
}

TEST(QuantSim, NanStaysAndOnlyItsOwnElement) {
  std::vector<float> v(32, 1.0f);
  v[3] = std::numeric_limits<float>::quiet_NaN();
  v[4] = 5.0f;
  fp4_e2m1_quant_dequant(v.data(), 32, kSimFp4Block);
  EXPECT_TRUE(std::isnan(v[3]));
  EXPECT_EQ(v[4], 4.0f);  // the block's amax 5 ignores the NaN: scale 1, 5 -> 4 (tie to even)
  EXPECT_EQ(v[0], 1.0f);
  std::vector<float> w(64, 0.5f);
  w[10] = std::numeric_limits<float>::quiet_NaN();
  fp8_e4m3_quant_dequant(w.data(), 64, kSimFp8Block);
  EXPECT_TRUE(std::isnan(w[10]));
  EXPECT_EQ(w[0], 0.5f);
}

TEST(QuantSim, HadamardIsSylvestersMatrixOverSqrtNAndItsOwnInverse) {
  for (int64_t n : {1, 2, 8, 32, 128}) {
    // Column j of the transform is H[:, j] / sqrt(n), H[i][j] = (-1)^popcount(i & j).
    for (int64_t j = 0; j < n; ++j) {
      std::vector<float> e(static_cast<size_t>(n), 0.0f);
      e[static_cast<size_t>(j)] = 1.0f;
      hadamard_rotate(e.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double want = (std::popcount(static_cast<uint64_t>(i & j)) % 2 ? -1.0 : 1.0) /
                            std::sqrt(static_cast<double>(n));
        ASSERT_NEAR(e[static_cast<size_t>(i)], want, 1e-7) << n << " " << i << " " << j;
      }
    }
    // Orthonormal: norms and dot products stay; applied twice it is the identity.
    const std::vector<float> a = random_values(n, 21, 1.0f), b = random_values(n, 22, 1.0f);
    std::vector<float> ra = a, rb = b;
    hadamard_rotate(ra.data(), n);
    hadamard_rotate(rb.data(), n);
    double dot = 0, rdot = 0;
    for (int64_t i = 0; i < n; ++i) {
      dot += static_cast<double>(a[i]) * b[i];
      rdot += static_cast<double>(ra[i]) * rb[i];
    }
    EXPECT_NEAR(rdot, dot, 1e-5 * (1 + std::fabs(dot))) << n;
    hadamard_rotate(ra.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(ra[i], a[i], 1e-6) << n << " " << i;
  }
}

TEST(QuantSim, EachKindTouchesItsFeaturesOnly) {
  const int64_t rows = 5, width = 80, rope = 16;
  const std::vector<float> x = random_values(rows * width, 31, 1.0f);
  // Fp8NonRope: the first 64 features of each row as one FP8 block; the rotated tail untouched.
  std::vector<float> y = x;
  simulate_precision(SimulatedPrecision::Fp8NonRope, y.data(), rows, width, rope);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> head(x.begin() + r * width, x.begin() + r * width + (width - rope));
    fp8_e4m3_quant_dequant(head.data(), width - rope, kSimFp8Block);
    for (int64_t i = 0; i < width; ++i) {
      const float want = i < width - rope ? head[static_cast<size_t>(i)] : x[r * width + i];
      ASSERT_EQ(y[r * width + i], want) << r << " " << i;
    }
  }
  // HadamardFp4: the whole row rotated, then FP4 in blocks of 32.
  std::vector<float> z(x.begin(), x.begin() + 4 * 32);
  std::vector<float> want = z;
  simulate_precision(SimulatedPrecision::HadamardFp4, z.data(), 4, 32, rope);
  for (int64_t r = 0; r < 4; ++r) {
    hadamard_rotate(want.data() + r * 32, 32);
    fp4_e2m1_quant_dequant(want.data() + r * 32, 32, kSimFp4Block);
  }
  expect_bits(z, want, "hadamard + fp4");
  // None leaves everything.
  y = x;
  simulate_precision(SimulatedPrecision::None, y.data(), rows, width, rope);
  expect_bits(y, x, "none");
}

TEST(QuantSim, ShapesOutsideTheBlocksAreErrorsNamingThem) {
  std::vector<float> v(48, 1.0f);
  std::string err = error_of([&] { fp8_e4m3_quant_dequant(v.data(), 48, kSimFp8Block); });
  EXPECT_NE(err.find("length 48 is not a multiple of the block 64"), std::string::npos) << err;
  err = error_of([&] { hadamard_rotate(v.data(), 48); });
  EXPECT_NE(err.find("length must be a power of two, got 48"), std::string::npos) << err;
}
