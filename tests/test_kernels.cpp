// Highway row kernels against double-precision references, at lengths that exercise full
// vectors, masked tails and empty rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/parallel.h"
#include "core/simd.h"
#include "kernels/activations.h"
#include "kernels/vector_math.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {
const int64_t kLengths[] = {0, 1, 3, 16, 17, 33, 255, 1000};
}

TEST(VectorMath, SoftmaxAndLogSumExpMatchDouble) {
  Rng rng(1);
  for (int64_t n : kLengths) {
    Tensor x = random_tensor({n}, rng, 4.0f);
    std::vector<float> row(x.f32(), x.f32() + n), scratch(static_cast<size_t>(n));
    double mx = -INFINITY, sum = 0;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(row[i]));
    for (int64_t i = 0; i < n; ++i) sum += std::exp(row[i] - mx);
    if (n == 0) continue;
    const double lse = mx + std::log(sum);
    EXPECT_NEAR(log_sum_exp(row.data(), scratch.data(), n), lse, 1e-6 * std::max(1.0, std::fabs(lse)));
    EXPECT_NEAR(softmax_inplace(row.data(), n), lse, 1e-6 * std::max(1.0, std::fabs(lse)));
    std::vector<double> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want[i] = std::exp(x.f32()[i] - lse);
    EXPECT_LT(rel_error(row.data(), want.data(), n), 1e-6) << "n=" << n;
  }
}

TEST(VectorMath, SigmoidAndSwigluMatchDouble) {
  Rng rng(2);
  for (int64_t n : kLengths) {
    Tensor g = random_tensor({n}, rng, 3.0f), u = random_tensor({n}, rng), dh = random_tensor({n}, rng);
    std::vector<float> s(n), h(n), dg(n), du(n);
    sigmoid_row(g.f32(), s.data(), n);
    swiglu_row(g.f32(), u.f32(), h.data(), n);
    swiglu_backward_row(g.f32(), u.f32(), dh.f32(), dg.data(), du.data(), n);
    std::vector<double> ws(n), wh(n), wdg(n), wdu(n);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g.f32()[i], sg = 1.0 / (1.0 + std::exp(-gi));
      ws[i] = sg;
      wh[i] = gi * sg * u.f32()[i];
      wdg[i] = dh.f32()[i] * u.f32()[i] * sg * (1 + gi * (1 - sg));
      wdu[i] = dh.f32()[i] * gi * sg;
    }
    EXPECT_LT(rel_error(s.data(), ws.data(), n), 1e-6) << n;
    EXPECT_LT(rel_error(h.data(), wh.data(), n), 1e-6) << n;
    EXPECT_LT(rel_error(dg.data(), wdg.data(), n), 1e-6) << n;
    EXPECT_LT(rel_error(du.data(), wdu.data(), n), 1e-6) << n;
  }
}

TEST(VectorMath, MaskedTailLeavesMemoryBeyondTheRowUntouched) {
  std::vector<float> buf(40, 7.0f);
  scale_row(buf.data(), 17, 2.0f);
  EXPECT_EQ(buf[16], 14.0f);
  EXPECT_EQ(buf[17], 7.0f);
  EXPECT_EQ(row_max(buf.data(), 0), -INFINITY);
}

TEST(VectorMath, ExpIsAccurateAndHandlesTheEdges) {
  // exp_shift_sum(x, 1, 0) leaves exp(x) in x.
  auto exp1 = [](float x) {
    exp_shift_sum(&x, 1, 0.0f);
    return x;
  };
  double worst_ulps = 0;
  for (float x = -87.0f; x <= 88.7f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    const float got = exp1(x);
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
    worst_ulps = std::max(worst_ulps, std::fabs(got - want) / ulp);
  }
  EXPECT_LT(worst_ulps, 2.0);
  EXPECT_EQ(exp1(0.0f), 1.0f);
  EXPECT_EQ(exp1(-200.0f), 0.0f);
  EXPECT_EQ(exp1(-INFINITY), 0.0f);
  EXPECT_EQ(exp1(89.0f), INFINITY);
  EXPECT_EQ(exp1(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(exp1(NAN)));
  // Subnormal results round once: e^-100 = 3.72e-44.
  EXPECT_NEAR(exp1(-100.0f), 3.720076e-44f, 1.5e-45f);
}

TEST(VectorMath, SumOfSquaresIsTheSixteenLaneSum) {
  Rng rng(9);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{100003}}) {
    Tensor x = random_tensor({std::max<int64_t>(n, 1)}, rng, 3.0f);
    double lanes[16] = {};
    long double exact = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double sq = static_cast<double>(x.f32()[i]) * x.f32()[i];
      lanes[i % 16] += sq;
      exact += sq;
    }
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    const double got = sum_of_squares(x.f32(), n);
    EXPECT_EQ(got, lanes[0]) << "n = " << n;
    EXPECT_LE(std::fabs(got - static_cast<double>(exact)), 1e-14 * static_cast<double>(exact)) << "n = " << n;
  }
  const float big[2] = {3e38f, -3e38f};  // each square exceeds fp32 but not double
  const double f = big[0];
  EXPECT_EQ(sum_of_squares(big, 2), 2.0 * f * f);
}

TEST(VectorMath, SumsOfSquaresOfSeveralRowsAreEachRowsOwnSum) {
  // Rows of unequal lengths read together (tails, an empty row, one shorter than the rest):
  // each sum has the bits of sum_of_squares on that row alone, on every target.
  Rng rng(10);
  const std::vector<int64_t> lengths = {100003, 17, 0, 64, 1, 4099, 16, 33, 15, 70000, 2, 31};
  std::vector<Tensor> rows;
  for (int64_t n : lengths) rows.push_back(random_tensor({std::max<int64_t>(n, 1)}, rng, 3.0f));
  auto run = [&] {
    std::vector<float> out;
    for (size_t g = 0; g < lengths.size(); g += kSquareRows) {
      const float* at[kSquareRows];
      int64_t n[kSquareRows];
      double sums[kSquareRows];
      for (int r = 0; r < kSquareRows; ++r) at[r] = rows[g + r].f32(), n[r] = lengths[g + r];
      sums_of_squares(at, n, sums);
      for (int r = 0; r < kSquareRows; ++r) {
        EXPECT_EQ(sums[r], sum_of_squares(at[r], n[r])) << "row " << g + r << ", n = " << n[r];
        float halves[2];
        std::memcpy(halves, &sums[r], sizeof(double));
        out.insert(out.end(), halves, halves + 2);
      }
    }
    return out;
  };
  static_assert(12 % kSquareRows == 0, "whole groups of the 12 rows above");
  expect_same_bits_on_every_target(run);
}

TEST(VectorMath, AdamWRowZeroesTheGradientItReadsAndUpdatesAlike) {
  Rng rng(11);
  const int64_t n = 37;  // two vectors and a tail on AVX-512, four and a tail on AVX2
  const Tensor g = random_tensor({n}, rng, 1.0f), w0 = random_tensor({n}, rng, 1.0f);
  AdamWRowParams p{0.5f, 0.999f, 0.9f, 0.95f, 0.1f, 0.05f, 1e-3f, 0.7f, 1e-8f};
  std::vector<float> w_kept(w0.f32(), w0.f32() + n), m_kept(n, 0.1f), v_kept(n, 0.2f);
  std::vector<float> g_kept(g.f32(), g.f32() + n);
  adamw_row(w_kept.data(), g_kept.data(), m_kept.data(), v_kept.data(), n, p);
  std::vector<float> w_zeroed(w0.f32(), w0.f32() + n), m_zeroed(n, 0.1f), v_zeroed(n, 0.2f);
  std::vector<float> g_zeroed(g.f32(), g.f32() + n);
  g_zeroed.push_back(7.0f);  // past the row: left alone
  p.zero_grad = true;
  adamw_row(w_zeroed.data(), g_zeroed.data(), m_zeroed.data(), v_zeroed.data(), n, p);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(g_kept[static_cast<size_t>(i)], g.f32()[i]) << i;
    EXPECT_EQ(g_zeroed[static_cast<size_t>(i)], 0.0f) << i;
    EXPECT_EQ(w_zeroed[static_cast<size_t>(i)], w_kept[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(m_zeroed[static_cast<size_t>(i)], m_kept[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(v_zeroed[static_cast<size_t>(i)], v_kept[static_cast<size_t>(i)]) << i;
  }
  EXPECT_EQ(g_zeroed[static_cast<size_t>(n)], 7.0f);
}

TEST(VectorMath, DotProductIsTheSixteenLaneSum) {
  Rng rng(10);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{256}, int64_t{100003}}) {
    Tensor a = random_tensor({std::max<int64_t>(n, 1)}, rng, 3.0f);
    Tensor b = random_tensor({std::max<int64_t>(n, 1)}, rng, 3.0f);
    double lanes[16] = {};
    for (int64_t i = 0; i < n; ++i) lanes[i % 16] += static_cast<double>(a.f32()[i]) * b.f32()[i];
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    EXPECT_EQ(dot_product(a.f32(), b.f32(), n), lanes[0]) << "n = " << n;
  }
}

TEST(VectorMath, SoftmaxBackwardRowIsTheDotThenTheLaneWiseFormula) {
  // Attention's softmax backward: d = float(dot_product(p, dp)), then each element rounded as
  // scale · (p · (dp − d)); the elements past n stay untouched; the dot product is returned.
  Rng rng(13);
  for_each_simd_target([&](simd::Target t) {
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{256}, int64_t{1001}}) {
      Tensor p = random_tensor({n + 3}, rng, 1.0f), dp = random_tensor({n + 3}, rng, 2.0f);
      std::vector<float> got(p.f32(), p.f32() + n + 3);
      const double dot = softmax_backward_row(got.data(), dp.f32(), n, 0.3f);
      ASSERT_EQ(dot, dot_product(p.f32(), dp.f32(), n)) << simd::name(t) << " n=" << n;
      const float d = static_cast<float>(dot);
      for (int64_t j = 0; j < n + 3; ++j) {
        const float want = j < n ? 0.3f * (p.f32()[j] * (dp.f32()[j] - d)) : p.f32()[j];
        ASSERT_EQ(got[j], want) << simd::name(t) << " n=" << n << " j=" << j;
      }
    }
  });
}

TEST(VectorMath, AddRowAndColumnSumsAreTheScalarLoopsOnEveryTarget) {
  // RMSNorm's weight gradient and the residual adds: the vector kernels must keep the scalar
  // loops' bits (one double chain per column from +0, rows in order).
  Rng rng(12);
  const int64_t rows = 37, stride = 270;
  Tensor x = random_tensor({rows * stride}, rng, 3.0f), dy = random_tensor({rows * stride}, rng),
         rstd = random_tensor({rows}, rng, 2.0f);
  for_each_simd_target([&](simd::Target t) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{8}, int64_t{17}, int64_t{64},
                      int64_t{161}, int64_t{256}}) {
      for (int64_t off : {int64_t{0}, int64_t{6}}) {
        double got[256];
        scaled_product_column_sums(x.f32() + off, dy.f32() + off, rstd.f32(), rows, stride, n, got);
        for (int64_t j = 0; j < n; ++j) {
          double want = 0;
          for (int64_t r = 0; r < rows; ++r)
            want += static_cast<double>(dy.f32()[r * stride + off + j]) * x.f32()[r * stride + off + j] *
                    static_cast<double>(rstd.f32()[r]);
          ASSERT_EQ(got[j], want) << simd::name(t) << " n=" << n << " j=" << j;
        }
      }
      std::vector<float> y(dy.f32(), dy.f32() + n + 5);
      add_row(y.data() + 5, x.f32(), n);
      for (int64_t i = 0; i < n + 5; ++i)
        ASSERT_EQ(y[i], i < 5 ? dy.f32()[i] : dy.f32()[i] + x.f32()[i - 5]) << simd::name(t) << " n=" << n;
    }
  });
}

TEST(Activations, RmsnormWeightGradientIsSummedPerChunkOfRowsInOrder) {
  // Chunks of kReduceChunk rows, each one double chain per column from +0, the chunks' sums
  // added in order: the same bits for any thread count, SIMD target and wave of chunks (dim
  // 2,048 takes 16 chunks a wave, so 40 chunks run in three).
  Rng rng(21);
  const int64_t dim = 2048, rows = 40 * kReduceChunk + 5;
  Tensor x = random_tensor({rows * dim}, rng), dy = random_tensor({rows * dim}, rng),
         w = random_tensor({dim}, rng), rstd = random_tensor({rows}, rng, 0.5f);
  // Column 0 tells the chunks' order apart even after the rounding to fp32: chunk sums 1e30,
  // -1e30 and 1 give 1 in order, 0 in most others.
  for (int64_t r = 0; r < rows; ++r) x.f32()[r * dim] = dy.f32()[r * dim] = 0.0f;
  for (int64_t c : {0, 1, 2}) {
    const int64_t r = c * kReduceChunk;
    rstd.f32()[r] = 1.0f;
    x.f32()[r * dim] = c == 2 ? 1.0f : 1e15f;
    dy.f32()[r * dim] = c == 0 ? 1e15f : c == 1 ? -1e15f : 1.0f;
  }
  std::vector<double> want(static_cast<size_t>(dim), 0.0);
  for (int64_t lo = 0; lo < rows; lo += kReduceChunk)
    for (int64_t j = 0; j < dim; ++j) {
      double chunk = 0;
      for (int64_t r = lo; r < std::min(rows, lo + kReduceChunk); ++r)
        chunk += static_cast<double>(dy.f32()[r * dim + j]) * x.f32()[r * dim + j] *
                 static_cast<double>(rstd.f32()[r]);
      want[static_cast<size_t>(j)] += chunk;
    }
  ASSERT_EQ(want[0], 1.0);
  const int before = num_threads();
  for_each_simd_target([&](simd::Target t) {
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      std::vector<float> dx(static_cast<size_t>(rows * dim)), dw(static_cast<size_t>(dim), 0.5f);
      rmsnorm_backward(x.f32(), w.f32(), rstd.f32(), dy.f32(), dx.data(), dw.data(), rows, dim);
      for (int64_t j = 0; j < dim; ++j)
        ASSERT_EQ(dw[static_cast<size_t>(j)], 0.5f + static_cast<float>(want[static_cast<size_t>(j)]))
            << simd::name(t) << " threads " << threads << " j=" << j;
      std::vector<float> row(static_cast<size_t>(dim));
      for (int64_t r : {int64_t{0}, rows - 1}) {
        rmsnorm_backward_row(x.f32() + r * dim, w.f32(), rstd.f32()[r], dy.f32() + r * dim, row.data(), dim);
        ASSERT_EQ(std::memcmp(row.data(), dx.data() + r * dim, sizeof(float) * static_cast<size_t>(dim)), 0);
      }
    }
  });
  set_num_threads(before);
}

TEST(VectorMath, NaNInARowReachesTheSum) {
  // A non-finite step must be seen as such, not turned into a finite loss.
  std::vector<float> row = {1.0f, NAN, 2.0f};
  EXPECT_TRUE(std::isnan(exp_shift_sum(row.data(), 3, 0.0f)));
}

TEST(VectorMath, EveryKernelGivesTheSameBitsOnEveryTarget) {
  // Each supported SIMD target runs every row kernel on the same rows; all outputs must equal
  // the first target's bit for bit (16 virtual lanes for sums, lane-wise arithmetic otherwise).
  Rng rng(5);
  const int64_t n = 1000;
  Tensor x = random_tensor({n}, rng, 6.0f), u = random_tensor({n}, rng), dh = random_tensor({n}, rng);
  auto run = [&] {
    std::vector<float> out;
    for (int64_t len : {int64_t{1}, int64_t{7}, int64_t{16}, int64_t{33}, n}) {
      std::vector<float> a(x.f32(), x.f32() + len), b(len), c(len), d(len), e(len);
      out.push_back(row_max(a.data(), len));
      out.push_back(static_cast<float>(softmax_inplace(a.data(), len)));
      out.insert(out.end(), a.begin(), a.end());
      std::vector<float> scratch(len);
      out.push_back(static_cast<float>(log_sum_exp(x.f32(), scratch.data(), len)));
      sigmoid_row(x.f32(), b.data(), len);
      swiglu_row(x.f32(), u.f32(), c.data(), len);
      swiglu_backward_row(x.f32(), u.f32(), dh.f32(), d.data(), e.data(), len);
      for (auto* v : {&b, &c, &d, &e}) out.insert(out.end(), v->begin(), v->end());
      std::vector<float> y(len), dxr(len);
      const float rs = rmsnorm_row(x.f32(), u.f32(), y.data(), len, 1e-6f);
      rmsnorm_backward_row(x.f32(), u.f32(), rs, dh.f32(), dxr.data(), len);
      out.push_back(rs);
      for (auto* v : {&y, &dxr}) out.insert(out.end(), v->begin(), v->end());
      std::vector<float> w(x.f32(), x.f32() + len), m(len, 0.1f), vv(len, 0.2f);
      adamw_row(w.data(), u.f32(), m.data(), vv.data(), len, {0.5f, 0.999f, 0.9f, 0.95f, 0.1f, 0.05f, 1e-3f, 0.7f, 1e-8f});
      for (auto* v : {&w, &m, &vv}) out.insert(out.end(), v->begin(), v->end());
      std::vector<float> sb(u.f32(), u.f32() + len);
      softmax_backward_row(sb.data(), dh.f32(), len, 0.3f);
      out.insert(out.end(), sb.begin(), sb.end());
      for (const double sum : {sum_of_squares(x.f32(), len), dot_product(x.f32(), u.f32(), len)}) {
        float halves[2];
        std::memcpy(halves, &sum, sizeof sum);
        out.insert(out.end(), halves, halves + 2);
      }
    }
    return out;
  };
  expect_same_bits_on_every_target(run);
}
