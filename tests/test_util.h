#pragma once
// Shared helpers for the op tests: random inputs, error metrics, finite differences.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"

#include "core/rng.h"
#include "core/simd.h"
#include "core/tensor.h"
#include "model/param.h"

namespace moe::testing {

inline Tensor random_tensor(const Shape& shape, Rng& rng, float scale = 1.0f,
                            MemCategory cat = MemCategory::Scratch) {
  Tensor t = Tensor::empty(shape, DType::F32, cat);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = scale * rng.normal();
  return t;
}

inline void fill_random(const Tensor& t, Rng& rng, float scale = 1.0f) {
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = scale * rng.normal();
}

// Token ids uniform in [0, vocab), I32 [n].
inline Tensor random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty({n}, DType::I32, MemCategory::Activations);
  for (int64_t i = 0; i < n; ++i) t.i32()[i] = static_cast<int32_t>(rng.next_u64() % vocab);
  return t;
}

// ||a - b|| / max(||b||, floor): the norm-wise relative error used by every comparison.
template <typename A, typename B>
double rel_error(const A* a, const B* b, int64_t n, double floor = 1e-30) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), floor);
}

inline double max_abs(const float* a, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i])));
  return m;
}

// Central finite differences of a scalar loss (evaluated in double over fp32 forwards) with
// respect to up to `max_checks` entries of `x`, compared with `analytic`. Returns the worst
// relative error, each entry judged against max(|fd|, |analytic|, abs_floor).
inline double finite_difference_check(const std::function<double()>& loss, float* x,
                                      const float* analytic, int64_t n, float eps = 1e-2f,
                                      int64_t max_checks = 64, double abs_floor = 1e-3) {
  double worst = 0;
  const int64_t stride = std::max<int64_t>(1, n / max_checks);
  for (int64_t i = 0; i < n; i += stride) {
    const float orig = x[i];
    x[i] = orig + eps;
    const double lp = loss();
    x[i] = orig - eps;
    const double lm = loss();
    x[i] = orig;
    const double fd = (lp - lm) / (2.0 * static_cast<double>(eps));
    const double denom = std::max({std::fabs(fd), std::fabs(static_cast<double>(analytic[i])), abs_floor});
    worst = std::max(worst, std::fabs(fd - analytic[i]) / denom);
  }
  return worst;
}

// Projection loss sum(y * r) for a fixed random r, so every output contributes to the gradient.
// Central differences of a double-precision loss over every entry of `v` (restored after).
inline std::vector<double> fd_grad(const std::function<double()>& loss, std::vector<double>& v,
                            double eps = 1e-6) {
  std::vector<double> g(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double o = v[i];
    v[i] = o + eps;
    const double lp = loss();
    v[i] = o - eps;
    const double lm = loss();
    v[i] = o;
    g[i] = (lp - lm) / (2 * eps);
  }
  return g;
}

inline double dot(const float* y, const float* r, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(y[i]) * static_cast<double>(r[i]);
  return s;
}

// ".avx2" when a SIMD target is forced, else "": ctest runs some binaries once per target, and
// those runs may be concurrent (ctest -j), so each names its files apart.
inline std::string forced_simd_suffix() {
  const char* simd = std::getenv("MOE_SIMD");
  return simd != nullptr && *simd != '\0' ? std::string(".") + simd : std::string();
}

// A fresh, empty directory for the running test: <build>/<group>/<suite>.<test>[.<target>].
inline std::filesystem::path scratch_dir(const std::string& group) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(MOE_BINARY_DIR) / group /
                                    (std::string(info->test_suite_name()) + "." + info->name() +
                                     forced_simd_suffix());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline void write_text(const std::filesystem::path& p, const std::string& text) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// One JSON value per non-empty line.
inline std::vector<nlohmann::json> parse_jsonl(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A shell command's standard output and exit status (-1 when it did not exit normally).
struct CommandResult {
  int status = -1;
  std::string output;
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 1 << 16> buf{};
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), pipe)) > 0;) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The message of the moe::Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Runs body(target) once per SIMD target this CPU supports (scalar included), then restores the
// target that was in force.
template <typename F>
void for_each_simd_target(F&& body) {
  const simd::Target before = simd::current();
  for (simd::Target t : simd::supported()) {
    simd::select(t);
    SCOPED_TRACE(simd::name(t));
    body(t);
  }
  simd::select(before);
}

// run() -> std::vector<float> must give the same floats, bit for bit, on every SIMD target.
template <typename F>
void expect_same_bits_on_every_target(F&& run) {
  std::vector<float> first;
  for_each_simd_target([&](simd::Target t) {
    const std::vector<float> got = run();
    if (first.empty()) first = got;
    ASSERT_EQ(got.size(), first.size());
    EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * sizeof(float)), 0)
        << simd::name(t) << " differs from " << simd::name(simd::supported().front());
  });
}

// Relative error of p's gradient along direction d against central differences of `loss`
// (|fd - g·d| / |g|); p's values are restored.
inline double directional_error(const std::function<double()>& loss, Param& p,
                              const std::vector<float>& d, float eps) {
  const int64_t n = p.value.numel();
  std::vector<float> orig(p.w(), p.w() + n);
  double gd = 0, gg = 0;
  for (int64_t i = 0; i < n; ++i) gd += double(p.g()[i]) * d[i], gg += double(p.g()[i]) * p.g()[i];
  auto at = [&](float t) {
    for (int64_t i = 0; i < n; ++i) p.w()[i] = orig[i] + t * d[i];
    return loss();
  };
  const double fd = (at(eps) - at(-eps)) / (2.0 * eps);
  std::copy(orig.begin(), orig.end(), p.w());
  return std::fabs(fd - gd) / std::sqrt(gg);
}

inline std::vector<float> unit_vector(std::vector<float> v) {
  double n = 0;
  for (float x : v) n += double(x) * x;
  for (float& x : v) x = static_cast<float>(x / std::sqrt(n));
  return v;
}

}  // namespace moe::testing
