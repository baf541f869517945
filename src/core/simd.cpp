#include "core/simd.h"

#include <hwy/targets.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>

#include "core/error.h"

namespace moe::simd {

namespace {

// Highway's target bit for each of ours. SSE4/SSSE3 are never used: without a hardware FMA the
// kernels run their exact scalar path anyway, so such CPUs run the scalar target throughout.
int64_t hwy_bit(Target t) {
  switch (t) {
    case Target::Avx512: return HWY_AVX3;
    case Target::Avx2: return HWY_AVX2;
    default: return HWY_SCALAR;
  }
}

bool cpu_has(Target t) {
  if (t == Target::Scalar) return true;
  // Highway's own detection of the real CPU, whatever target is forced at the moment.
  static const int64_t real = [] {
    hwy::SetSupportedTargetsForTest(0);
    return hwy::SupportedTargets();
  }();
  return (real & hwy_bit(t)) != 0 && (HWY_TARGETS & hwy_bit(t)) != 0;
}

std::atomic<int> g_current{-1};
std::mutex g_select_mu;  // Highway's target mask is a plain global

}  // namespace

Target parse(std::string_view n, std::string_view what) {
  if (n == "auto") return Target::Auto;
  if (n == "avx512") return Target::Avx512;
  if (n == "avx2") return Target::Avx2;
  if (n == "scalar") return Target::Scalar;
  fail("{}: unknown SIMD target '{}' (expected auto, avx512, avx2 or scalar)", what, n);
}

const char* name(Target t) {
  switch (t) {
    case Target::Auto: return "auto";
    case Target::Avx512: return "avx512";
    case Target::Avx2: return "avx2";
    case Target::Scalar: return "scalar";
  }
  return "?";
}

const char* description(Target t) {
  switch (t) {
    case Target::Avx512: return "AVX-512 (F/BW/DQ/VL + FMA)";
    case Target::Avx2: return "AVX2 + FMA";
    case Target::Scalar: return "scalar (exact fallback)";
    default: return name(t);
  }
}

std::vector<Target> supported() {
  std::vector<Target> out;
  for (Target t : {Target::Avx512, Target::Avx2, Target::Scalar})
    if (cpu_has(t)) out.push_back(t);
  return out;
}

std::string supported_names() {
  std::string s;
  for (Target t : supported()) s += (s.empty() ? "" : ", ") + std::string(name(t));
  return s;
}

void select(Target t) {
  if (t == Target::Auto) t = supported().front();
  MOE_CHECK(cpu_has(t), "SIMD target '{}' is not supported by this CPU ({}); supported: {}",
            name(t), cpu_model(), supported_names());
  const std::lock_guard<std::mutex> lock(g_select_mu);
  hwy::SetSupportedTargetsForTest(hwy_bit(t));
  g_current.store(static_cast<int>(t));
}

Target current() {
  int c = g_current.load();
  if (c < 0) {
    // The first kernel call may come from several threads at once: one applies MOE_SIMD (or
    // fails on it, again for every caller), the others wait for it.
    static std::mutex first_use;
    const std::lock_guard<std::mutex> lock(first_use);
    if (g_current.load() < 0) {
      const char* env = std::getenv("MOE_SIMD");
      select(env && *env ? parse(env, "environment variable MOE_SIMD") : Target::Auto);
    }
    c = g_current.load();
  }
  return static_cast<Target>(c);
}

void apply_option(const std::string& value, std::string_view what) {
  if (value.empty())
    current();
  else
    select(parse(value, what));
}

std::string cpu_model() {
  // Virtual machines often hide the marketing name ("AMD EPYC"), so family and model go with it.
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU", family, number;
  auto value = [&] {
    const auto colon = line.find(':');
    std::string v = colon == std::string::npos ? "" : line.substr(colon + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    return v;
  };
  while (std::getline(in, line) && line.find_first_not_of(" \t") != std::string::npos) {
    if (line.rfind("model name", 0) == 0) model = value();
    else if (line.rfind("cpu family", 0) == 0) family = value();
    else if (line.rfind("model", 0) == 0 && line.rfind("model name", 0) != 0) number = value();
  }
  if (!family.empty()) model += " (family " + family + " model " + number + ")";
  return model;
}

}  // namespace moe::simd
