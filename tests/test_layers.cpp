// Basic layers against double-precision references and finite differences.
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"
#include "model/layers.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

// Loss = dot(forward(x), r) recomputed by finite differences over fp32 forwards.
template <typename Layer>
double layer_loss(Layer& layer, const Tensor& x, const Tensor& r) {
  Tensor y = layer.forward(x, Pass::Eval);
  return dot(y.f32(), r.f32(), y.numel());
}

void expect_grad_close(const char* what, double worst, double tol = 2e-2) {
  EXPECT_LT(worst, tol) << what;
}

}  // namespace

TEST(Linear, ForwardMatchesDoubleAndBackwardMatchesFiniteDifferences) {
  Rng rng(3);
  Linear lin;
  lin.init("w", 7, 5);
  fill_random(lin.weight.value, rng, 0.5f);
  lin.weight.allocate_grad();
  Tensor x = random_tensor({4, 7}, rng), r = random_tensor({4, 5}, rng);
  Tensor y = lin.forward(x, Pass::Train);
  for (int t = 0; t < 4; ++t)
    for (int o = 0; o < 5; ++o) {
      double s = 0;
      for (int i = 0; i < 7; ++i) s += double(x.f32()[t * 7 + i]) * lin.weight.w()[o * 7 + i];
      EXPECT_NEAR(y.f32()[t * 5 + o], s, 1e-5);
    }
  Tensor dx = lin.backward(r);
  EXPECT_FALSE(lin.has_saved());
  expect_grad_close("dx", finite_difference_check([&] { return layer_loss(lin, x, r); }, x.f32(), dx.f32(), x.numel()));
  expect_grad_close("dW", finite_difference_check([&] { return layer_loss(lin, x, r); }, lin.weight.w(), lin.weight.g(), lin.weight.value.numel()));
}

TEST(RMSNorm, ForwardMatchesDoubleAndBackwardMatchesFiniteDifferences) {
  Rng rng(4);
  RMSNorm norm;
  norm.init("n", 67, 1e-6);
  fill_random(norm.weight.value, rng, 1.0f);
  norm.weight.allocate_grad();
  Tensor x = random_tensor({5, 67}, rng), r = random_tensor({5, 67}, rng);
  Tensor y = norm.forward(x, Pass::Train);
  for (int t = 0; t < 5; ++t) {
    double ss = 0;
    for (int i = 0; i < 67; ++i) ss += double(x.f32()[t * 67 + i]) * x.f32()[t * 67 + i];
    const double rs = 1.0 / std::sqrt(ss / 67 + 1e-6);
    for (int i = 0; i < 67; ++i)
      EXPECT_NEAR(y.f32()[t * 67 + i], x.f32()[t * 67 + i] * rs * norm.weight.w()[i], 1e-5);
  }
  Tensor dx = norm.backward(r);
  expect_grad_close("dx", finite_difference_check([&] { return layer_loss(norm, x, r); }, x.f32(), dx.f32(), x.numel(), 1e-2f, 64, 1e-2));
  expect_grad_close("dw", finite_difference_check([&] { return layer_loss(norm, x, r); }, norm.weight.w(), norm.weight.g(), 67));
}

TEST(Embedding, GathersRowsAndScatterAddsRepeatedTokens) {
  Rng rng(5);
  Embedding emb;
  emb.init("e", 10, 3);
  fill_random(emb.weight.value, rng);
  emb.weight.allocate_grad();
  Tensor tokens = Tensor::empty({4}, DType::I32, MemCategory::Activations);
  const int32_t ids[4] = {2, 7, 2, 0};
  std::memcpy(tokens.raw(), ids, sizeof(ids));
  Tensor y = emb.forward(tokens, Pass::Train);
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 3; ++i) EXPECT_EQ(y.f32()[t * 3 + i], emb.weight.w()[ids[t] * 3 + i]);
  Tensor dy = random_tensor({4, 3}, rng);
  emb.backward(dy);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FLOAT_EQ(emb.weight.g()[2 * 3 + i], dy.f32()[0 * 3 + i] + dy.f32()[2 * 3 + i]);
    EXPECT_EQ(emb.weight.g()[5 * 3 + i], 0.0f);
  }
  const int32_t bad[1] = {10};
  Tensor bad_tokens = Tensor::empty({1}, DType::I32, MemCategory::Activations);
  std::memcpy(bad_tokens.raw(), bad, sizeof(bad));
  EXPECT_THROW(emb.forward(bad_tokens, Pass::Eval), Error);
}

TEST(SwiGLU, BackwardMatchesFiniteDifferencesForEveryWeight) {
  Rng rng(6);
  SwiGLU mlp;
  mlp.init("m.", 9, 13);
  ParamList ps;
  mlp.collect(ps);
  for (Param* p : ps) {
    fill_random(p->value, rng, 0.4f);
    p->allocate_grad();
  }
  Tensor x = random_tensor({6, 9}, rng), r = random_tensor({6, 9}, rng);
  Tensor y = mlp.forward(x, Pass::Train);
  // Double reference of the forward.
  for (int t = 0; t < 6; ++t)
    for (int o = 0; o < 9; ++o) {
      double s = 0;
      for (int h = 0; h < 13; ++h) {
        double g = 0, u = 0;
        for (int i = 0; i < 9; ++i) {
          g += double(x.f32()[t * 9 + i]) * mlp.gate.weight.w()[h * 9 + i];
          u += double(x.f32()[t * 9 + i]) * mlp.up.weight.w()[h * 9 + i];
        }
        s += g / (1 + std::exp(-g)) * u * mlp.down.weight.w()[o * 13 + h];
      }
      EXPECT_NEAR(y.f32()[t * 9 + o], s, 1e-4 * std::max(1.0, std::fabs(s)));
    }
  Tensor dx = mlp.backward(r);
  EXPECT_FALSE(mlp.has_saved());
  auto loss = [&] { return layer_loss(mlp, x, r); };
  expect_grad_close("dx", finite_difference_check(loss, x.f32(), dx.f32(), x.numel()));
  for (Param* p : ps) expect_grad_close(p->name.c_str(), finite_difference_check(loss, p->w(), p->g(), p->value.numel()));
}

TEST(Layers, EvalForwardLeavesNoActivations) {
  Rng rng(7);
  SwiGLU mlp;
  mlp.init("m.", 8, 8);
  RMSNorm norm;
  norm.init("n", 8, 1e-6);
  const int64_t before = MemoryTracker::instance().current(MemCategory::Activations);
  {
    Tensor x = random_tensor({3, 8}, rng, 1.0f, MemCategory::Activations);
    Tensor y = mlp.forward(norm.forward(x, Pass::Eval), Pass::Eval);
    EXPECT_FALSE(mlp.has_saved());
    EXPECT_FALSE(norm.has_saved());
  }
  EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Activations), before);
}

TEST(SwiGLU, TrainForwardSavesOnlyGateAndUp) {
  Rng rng(9);
  SwiGLU mlp;
  mlp.init("m.", 8, 12);
  const int64_t before = MemoryTracker::instance().current(MemCategory::Activations);
  Tensor x = random_tensor({5, 8}, rng);  // the caller's (Scratch)
  mlp.forward(x, Pass::Train).reset();
  // g and u [T, hidden]; down's input h is recomputed in backward, not kept.
  EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Activations) - before,
            2 * 5 * 12 * static_cast<int64_t>(sizeof(float)));
  EXPECT_FALSE(mlp.down.has_saved());
  mlp.backward(random_tensor({5, 8}, rng)).reset();
  EXPECT_FALSE(mlp.has_saved() || mlp.gate.has_saved() || mlp.up.has_saved());
  EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Activations), before);
}

TEST(Layers, SameBitsForOneAndTwoThreads) {
  auto run = [](int threads) {
    set_num_threads(threads);
    Rng rng(8);
    SwiGLU mlp;
    mlp.init("m.", 96, 200);
    RMSNorm norm;
    norm.init("n", 96, 1e-6);
    ParamList ps;
    mlp.collect(ps);
    norm.collect(ps);
    for (Param* p : ps) {
      fill_random(p->value, rng, 0.2f);
      p->allocate_grad();
    }
    Tensor x = random_tensor({300, 96}, rng), r = random_tensor({300, 96}, rng);
    Tensor y = mlp.forward(norm.forward(x, Pass::Train), Pass::Train);
    Tensor dx = norm.backward(mlp.backward(r));
    std::vector<float> out(dx.f32(), dx.f32() + dx.numel());
    for (Param* p : ps) out.insert(out.end(), p->g(), p->g() + p->grad.numel());
    out.insert(out.end(), y.f32(), y.f32() + y.numel());
    return out;
  };
  const auto a = run(1), b = run(2);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}
