// Highway row kernels against double-precision references, at lengths that exercise full
// vectors, masked tails and empty rows.
#include <cmath>
#include <vector>

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
