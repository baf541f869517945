// fp32 GEMM against the machine's FMA peak, per SIMD target, and the engine's kernels side by side
// with the Debian libraries that could have served instead (OpenBLAS, BLIS, oneDNN), each on the
// same operands in the same run:
//  * rate: best and median GFLOP/s over --reps calls of an n³ product (nt, nn, tn for the
//    engine; nt for the libraries), and the best as a fraction of the FMA peak of the target,
//    measured right before;
//  * contract: does a row computed alone equal the same row inside a 1,000-row call (bitwise)?
//    do 1 and all threads give the same bits? (what expert parallelism needs to be exact);
//  * few rows (--few-rows): 1-16 rows against 4096 × 1024 weights cycled from DRAM (decoding a
//    few sequences, an expert's few tokens, its input gradient), nt and nn, as weight bytes read
//    per second against the DRAM read measured right before, per target.
// The libraries are opened with dlopen when installed (libopenblas0-openmp, libblis4-openmp,
// libdnnl2), so none of them is a build dependency; a missing one prints "not installed".
#include <dlfcn.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "core/rng.h"
#include "core/simd.h"
#include "kernels/fma_peak.h"
#include "kernels/gemm.h"
#include "kernels/read_bandwidth.h"

using namespace moe;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// C[M,N] = A[M,K]·B[N,K]ᵀ, row-major, on `threads` threads.
struct Candidate {
  std::string name;
  std::function<void(int threads)> set_threads;
  std::function<void(int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C)> nt;
};

void* open_lib(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (void* h = dlopen(n, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND)) return h;
  return nullptr;
}

std::vector<Candidate> candidates() {
  std::vector<Candidate> out;
  out.push_back({"moe (own kernels)", [](int t) { set_num_threads(t); },
                 [](int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C) {
                   gemm_nt(M, N, K, A, K, B, K, C, N, false);
                 }});
  if (void* h = open_lib({"/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0", "libopenblas.so.0"})) {
    using Gemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
    auto gemm = reinterpret_cast<Gemm>(dlsym(h, "cblas_sgemm"));
    auto threads = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
    auto core = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"));
    if (gemm && threads)
      out.push_back({fmt::format("OpenBLAS 0.3 ({} kernels)", core ? core() : "?"), threads,
                     [gemm](int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C) {
                       // CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112
                       gemm(101, 111, 112, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0f,
                            A, static_cast<int>(K), B, static_cast<int>(K), 0.0f, C, static_cast<int>(N));
                     }});
  }
  if (void* h = open_lib({"libblis.so.4"})) {
    // bli_sgemm(transa, transb, m, n, k, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) with
    // 64-bit dims/strides; BLIS_NO_TRANSPOSE = 0, BLIS_TRANSPOSE = 8.
    using Gemm = void (*)(int, int, int64_t, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                          const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t);
    auto gemm = reinterpret_cast<Gemm>(dlsym(h, "bli_sgemm"));
    auto threads = reinterpret_cast<void (*)(int64_t)>(dlsym(h, "bli_thread_set_num_threads"));
    if (gemm && threads)
      out.push_back({"BLIS 0.9", [threads](int t) { threads(t); },
                     [gemm](int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C) {
                       const float one = 1.0f, zero = 0.0f;
                       gemm(0, 8, M, N, K, &one, A, K, 1, B, K, 1, &zero, C, N, 1);
                     }});
  }
  if (void* h = open_lib({"libdnnl.so.2"})) {
    using Gemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                         int64_t, float, float*, int64_t);
    auto gemm = reinterpret_cast<Gemm>(dlsym(h, "dnnl_sgemm"));
    // oneDNN's Debian build threads with OpenMP: its libgomp takes the count.
    auto threads = reinterpret_cast<void (*)(int)>(dlsym(h, "omp_set_num_threads"));
    if (gemm && threads)
      out.push_back({"oneDNN 2.6", threads,
                     [gemm](int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C) {
                       gemm('N', 'T', M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
                     }});
  }
  return out;
}

struct Rate {
  double best = 0, median = 0;
};

Rate time_calls(int reps, double flops, const std::function<void()>& call) {
  call();  // warm-up: page faults, packing buffers, JIT
  std::vector<double> r;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    r.push_back(flops / seconds_since(t0) / 1e9);
  }
  std::sort(r.begin(), r.end());
  return {r.back(), r[r.size() / 2]};
}

std::vector<float> random_floats(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = rng.normal();
  return v;
}

// Rows of a 1,000-row call that differ from the same row computed alone, and whether one thread
// and all threads agree.
std::pair<int, bool> contract(const Candidate& c, int threads) {
  const int64_t M = 1000, N = 150, K = 300;
  const auto A = random_floats(M * K, 1), B = random_floats(N * K, 2);
  std::vector<float> all(static_cast<size_t>(M * N)), one_thread(all.size()), row(static_cast<size_t>(N));
  c.set_threads(threads);
  c.nt(M, N, K, A.data(), B.data(), all.data());
  int differ = 0;
  for (int64_t i = 0; i < M; ++i) {
    c.nt(1, N, K, A.data() + i * K, B.data(), row.data());
    differ += std::memcmp(row.data(), all.data() + i * N, sizeof(float) * N) != 0;
  }
  c.set_threads(1);
  c.nt(M, N, K, A.data(), B.data(), one_thread.data());
  c.set_threads(threads);
  return {differ, std::memcmp(all.data(), one_thread.data(), sizeof(float) * all.size()) == 0};
}

// Products of a few rows against weights too large for any cache: per call, one 4096 × 1024
// matrix of a set that is at least 3x the last-level cache, taken in turn, so every call streams
// its weights from DRAM.
void few_rows(int threads, int reps) {
  const int64_t rows = 4096, cols = 1024, bytes = rows * cols * 4;
  const int64_t count = std::clamp<int64_t>(3 * last_level_cache_bytes() / bytes + 1, 4, 64);
  std::vector<std::vector<float>> w;
  for (int64_t i = 0; i < count; ++i) w.push_back(random_floats(rows * cols, 100 + static_cast<uint64_t>(i)));
  const auto x = random_floats(16 * rows, 5);
  std::vector<float> y(static_cast<size_t>(16 * rows));
  fmt::print("\nFew rows against {} weight matrices of {} × {} ({} MB), taken in turn from DRAM; "
             "nt: y = x·Wᵀ, nn: dx = dy·W; median of {} passes over the set\n\n",
             count, rows, cols, count * bytes / 1000000, reps);
  fmt::print("| target | DRAM read GB/s | rows | nt GFLOP/s | nt weights GB/s (of DRAM) | nn GFLOP/s | nn weights GB/s (of DRAM) |\n");
  fmt::print("|---|---|---|---|---|---|---|\n");
  auto seconds_per_call = [&](const std::function<void(const float*)>& call) {
    for (const auto& m : w) call(m.data());  // warm-up: page faults, scratch
    std::vector<double> s;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& m : w) call(m.data());
      s.push_back(seconds_since(t0) / static_cast<double>(count));
    }
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  };
  const simd::Target before = simd::current();
  for (simd::Target t : simd::supported()) {
    if (t == simd::Target::Scalar) continue;
    simd::select(t);
    const double dram = measure_dram_read_gbs(threads);
    for (int64_t m : {1, 4, 8, 16}) {
      const double nt = seconds_per_call([&](const float* W) {
        gemm_nt(m, rows, cols, x.data(), cols, W, cols, y.data(), rows, false);
      });
      const double nn = seconds_per_call([&](const float* W) {
        gemm_nn(m, cols, rows, x.data(), rows, W, cols, y.data(), cols, false);
      });
      const double flops = 2.0 * static_cast<double>(m * rows * cols);
      fmt::print("| {} | {:.1f} | {} | {:.1f} | {:.1f} ({:.2f}) | {:.1f} | {:.1f} ({:.2f}) |\n",
                 simd::name(t), dram, m, flops / nt / 1e9, bytes / nt / 1e9, bytes / nt / 1e9 / dram,
                 flops / nn / 1e9, bytes / nn / 1e9, bytes / nn / 1e9 / dram);
    }
  }
  simd::select(before);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp32 GEMM vs the FMA peak, per SIMD target, and vs OpenBLAS / BLIS / oneDNN"};
  int64_t n = 2048;
  int threads = available_cpus(), reps = 10;
  bool libraries = true;
  app.add_option("--size", n, "n of the n x n x n products");
  app.add_option("--threads", threads);
  app.add_option("--reps", reps, "timed calls per figure (after one warm-up)");
  app.add_option("--libraries", libraries, "also time OpenBLAS, BLIS and oneDNN when installed");
  bool few = true;
  app.add_option("--few-rows", few, "also time 1-16 rows against weights from DRAM, vs the DRAM read");
  CLI11_PARSE(app, argc, argv);
  set_num_threads(threads);
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  const auto A = random_floats(n * n, 3), B = random_floats(n * n, 4);
  std::vector<float> C(static_cast<size_t>(n * n));

  fmt::print("{} threads, {}, n = {}, best / median of {} calls\n\n", threads, simd::cpu_model(), n, reps);
  fmt::print("| target | FMA peak GFLOP/s | nt best (median) | nn best (median) | tn best (median) | best / peak (nt, nn, tn) |\n");
  fmt::print("|---|---|---|---|---|---|\n");
  const simd::Target before = simd::current();
  for (simd::Target t : simd::supported()) {
    if (t == simd::Target::Scalar) continue;  // exact fallback, not a speed target
    simd::select(t);
    const double peak = measure_fma_peak(threads).gflops;
    const Rate nt = time_calls(reps, flops, [&] { gemm_nt(n, n, n, A.data(), n, B.data(), n, C.data(), n, false); });
    const Rate nn = time_calls(reps, flops, [&] { gemm_nn(n, n, n, A.data(), n, B.data(), n, C.data(), n, false); });
    const Rate tn = time_calls(reps, flops, [&] { gemm_tn(n, n, n, A.data(), n, B.data(), n, C.data(), n, false); });
    fmt::print("| {} | {:.1f} | {:.1f} ({:.1f}) | {:.1f} ({:.1f}) | {:.1f} ({:.1f}) | {:.3f}, {:.3f}, {:.3f} |\n",
               simd::description(t), peak, nt.best, nt.median, nn.best, nn.median, tn.best, tn.median,
               nt.best / peak, nn.best / peak, tn.best / peak);
  }
  simd::select(before);
  if (few) few_rows(threads, reps);
  if (!libraries) return 0;

  const double peak = measure_fma_peak(threads).gflops;
  fmt::print("\nnt, {} target, FMA peak {:.1f} GFLOP/s measured now\n\n", simd::name(simd::current()), peak);
  fmt::print("| implementation | best GFLOP/s (median) | best / FMA peak | rows differing alone vs in a 1000-row call | 1 thread = {} threads |\n", threads);
  fmt::print("|---|---|---|---|---|\n");
  for (const Candidate& c : candidates()) {
    c.set_threads(threads);
    const Rate r = time_calls(reps, flops, [&] { c.nt(n, n, n, A.data(), B.data(), C.data()); });
    const auto [differ, same_threads] = contract(c, threads);
    fmt::print("| {} | {:.1f} ({:.1f}) | {:.3f} | {} of 1000 | {} |\n", c.name, r.best, r.median, r.best / peak,
               differ, same_threads ? "yes" : "no");
  }
  for (const char* missing : {"libopenblas.so.0", "libblis.so.4", "libdnnl.so.2"})
    if (!open_lib({missing}) && !(std::string(missing) == "libopenblas.so.0" &&
                                  open_lib({"/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0"})))
      fmt::print("| {} | not installed | | | |\n", missing);
  set_num_threads(threads);
  return 0;
}
