// MXFP4 expert matmuls in the decode regime, against the machine's DRAM read bandwidth measured
// in the same run. Experts of several layers (dim 1024, width 704, 64 experts, 73.5 MB of packed
// weights per layer; as many layers as hold three times the last-level cache) are cycled through
// as real decoding does:
//  * routed: one token through its top-6 experts per layer (gate‖up then down, m = 1), a fresh
//    random choice per token and layer;
//  * all experts: one token per expert over every expert of a layer (m = 1 each).
//  * kernel alone: each thread multiplies one token by its own matrix of 1024 columns and as many
//    rows (a multiple of 64, at most 1024: 544 KB) as fill three quarters of its core's L2 (Zen 3:
//    512 KiB, 704 rows), over and over: the kernel's own speed, with no DRAM or L3 in the way.
//    When this is below the DRAM read, the kernel's instructions are the limit, not memory.
// The figure is packed bytes read per second (weights + scales) and its fraction of DRAM read
// bandwidth (a plain streaming read of 1 GiB, or 4 times the last-level cache, on all threads, best
// of 5, measured once for the header and again next to each case). Threads: --threads;
// SIMD target: MOE_SIMD.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <fmt/format.h>
#include <thread>
#include <vector>

#include "core/block_cache.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "core/simd.h"
#include "kernels/fma_peak.h"
#include "kernels/mxfp4_gemm.h"
#include "kernels/mxfp4_gemm_q8.h"
#include "kernels/read_bandwidth.h"

using namespace moe;

namespace {

constexpr int64_t kDim = 1024, kWidth = 704, kTopK = 6;
int64_t g_experts = 64;  // per layer (--experts)

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A packed matrix [rows, cols] with its scales, random codes and realistic scale bytes, carved
// from a layer's arena.
struct Packed {
  uint8_t *bytes = nullptr, *scales = nullptr;
  int64_t rows = 0, cols = 0;
  Packed(int64_t r, int64_t c, uint8_t*& arena, Rng& rng) : rows(r), cols(c) {
    bytes = arena;
    scales = arena + r * c / 2;
    arena += nbytes();
    for (int64_t i = 0; i < r * c / 2; ++i) bytes[i] = static_cast<uint8_t>(rng.next_u64());
    for (int64_t i = 0; i < r * c / 32; ++i) scales[i] = static_cast<uint8_t>(118 + rng.next_u64() % 6);
  }
  Mxfp4Matrix view() const { return {bytes, scales, rows, cols, cols / 2, cols / 32}; }
  int64_t nbytes() const { return rows * cols / 2 + rows * cols / 32; }
};

struct Expert {
  Packed gate_up, down;
  Expert(uint8_t*& arena, Rng& rng) : gate_up(2 * kWidth, kDim, arena, rng), down(kDim, kWidth, arena, rng) {}
  static int64_t nbytes() { return (2 * kWidth * kDim + kDim * kWidth) * 17 / 32; }
};

// One layer's experts in one allocation, as the engine holds them (Mxfp4ExpertWeights): through
// the engine's block allocator, which offers blocks of 32 MiB and more to transparent huge pages,
// or (--small-pages) a plain 4 KiB-page allocation.
struct Layer {
  HostBlock block;
  std::vector<uint8_t> plain;
  std::vector<Expert> experts;
  Layer(int64_t n, bool small_pages, Rng& rng) {
    const auto bytes = static_cast<size_t>(n * Expert::nbytes());
    uint8_t* at = nullptr;
    if (small_pages) {
      plain.resize(bytes);
      at = plain.data();
    } else {
      block = allocate_block(bytes);
      at = static_cast<uint8_t*>(block.data);
    }
    experts.reserve(static_cast<size_t>(n));
    for (int64_t e = 0; e < n; ++e) experts.emplace_back(at, rng);
  }
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
  ~Layer() {
    if (block.data != nullptr) free_block(block);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"MXFP4 expert matmuls at decode (m = 1) against DRAM read bandwidth"};
  int threads = available_cpus(), layers = 0, tokens = 40;
  app.add_option("--threads", threads);
  app.add_option("--layers", layers,
                 "layers of experts cycled through (73.5 MB each; default: enough to hold three times "
                 "the last-level cache, at least 3)");
  app.add_option("--tokens", tokens, "tokens timed per case");
  app.add_option("--experts", g_experts,
                 "experts per layer (64; e.g. --layers 1 --experts 6 keeps them in the last-level cache, "
                 "to see the kernels without DRAM)")
      ->check(CLI::Range(int64_t{6}, int64_t{4096}));
  bool small_pages = false;
  app.add_flag("--small-pages", small_pages,
               "plain 4 KiB pages instead of the engine's allocator (huge pages where offered)");
  CLI11_PARSE(app, argc, argv);
  set_num_threads(threads);
  if (layers <= 0) {
    const int64_t layer_bytes = g_experts * Expert::nbytes();
    layers = static_cast<int>(std::max<int64_t>(3, (3 * last_level_cache_bytes() + layer_bytes - 1) / layer_bytes));
  }
  Rng rng(1);
  std::vector<std::unique_ptr<Layer>> experts;
  for (int l = 0; l < layers; ++l) experts.push_back(std::make_unique<Layer>(g_experts, small_pages, rng));
  const int64_t per_expert = Expert::nbytes();
  const double dram = measure_dram_read_gbs(threads);
  fmt::print("{}, {} threads, {} ({}), {} layers x {} experts = {:.0f} MB packed ({}); DRAM read {:.1f} GB/s\n\n",
             simd::cpu_model(), threads, simd::name(simd::current()), simd::description(simd::current()), layers,
             g_experts, static_cast<double>(layers * g_experts * per_expert) / 1e6,
             small_pages ? "4 KiB pages" : "engine allocator", dram);

  std::vector<float> x(kDim, 0.5f), h(2 * kWidth * g_experts), y(kDim * g_experts);
  bool int8 = false;
  auto expert_forward = [&](const Expert& ex, int64_t slot) {
    float* hs = h.data() + slot * 2 * kWidth;
    const auto nt = int8 ? mxfp4_gemm_nt_q8 : mxfp4_gemm_nt;
    nt(1, x.data(), kDim, ex.gate_up.view(), hs, 2 * kWidth, false);
    nt(1, hs, kWidth, ex.down.view(), y.data() + slot * kDim, kDim, false);
  };
  // The DRAM read is measured again next to each case: on a shared VM it can change by 1.5x
  // from one second to the next (a Zen 5 guest read 46-50 GB/s, then 75-83), and a fraction
  // against a figure from another moment says nothing.
  fmt::print("| activations | case | packed GB/s | DRAM read next to it, GB/s | of DRAM read | tokens/s |\n"
             "|---|---|---|---|---|---|\n");
  for (const bool q8 : {false, true})
  for (const bool routed : {true, false}) {
    int8 = q8;
    std::vector<int64_t> pick(kTopK), order(static_cast<size_t>(g_experts));
    for (int64_t e = 0; e < g_experts; ++e) order[static_cast<size_t>(e)] = e;
    int64_t bytes = 0;
    auto token = [&](int64_t t) {
      for (int l = 0; l < layers; ++l) {
        const auto& layer = experts[static_cast<size_t>((t + l) % layers)]->experts;
        if (routed) {
          // Distinct experts, as top-k routing picks them (a repeat would be read from cache).
          for (int64_t j = 0; j < kTopK; ++j) {
            const int64_t r = j + static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(g_experts - j));
            std::swap(order[static_cast<size_t>(j)], order[static_cast<size_t>(r)]);
            pick[j] = order[static_cast<size_t>(j)];
          }
          parallel_for_dynamic(0, kTopK, [&](int64_t j) { expert_forward(layer[pick[j]], j); });
          bytes += kTopK * per_expert;
        } else {
          parallel_for_dynamic(0, g_experts, [&](int64_t e) { expert_forward(layer[e], e); });
          bytes += g_experts * per_expert;
        }
      }
    };
    token(0);  // warm-up
    const double dram_here = measure_dram_read_gbs(threads);
    bytes = 0;
    const int n = routed ? tokens * 10 : tokens;
    const auto t0 = std::chrono::steady_clock::now();
    for (int t = 1; t <= n; ++t) token(t);
    const double s = seconds_since(t0), gbs = static_cast<double>(bytes) / s / 1e9;
    fmt::print("| {} | {} | {:.1f} | {:.1f} | {:.2f} | {:.0f} |\n", q8 ? "int8 (inference)" : "fp32 (exact)",
               routed ? fmt::format("1 token, top-6 of {} experts, per layer", g_experts)
                      : fmt::format("1 token per expert, all {} experts", g_experts),
               gbs, dram_here, gbs / dram_here, n / s);
  }

  // The kernel alone: one L2-resident matrix per thread, best of 5 rounds of kCalls calls each.
  constexpr int64_t kCalls = 2000;
  const int64_t own_rows =
      std::clamp<int64_t>(l2_cache_bytes() * 3 / 4 / (kDim * 17 / 32) / 64 * 64, 64, kDim);
  std::vector<std::vector<uint8_t>> own(static_cast<size_t>(threads));
  std::vector<Packed> mats;
  std::vector<std::vector<float>> outs(static_cast<size_t>(threads), std::vector<float>(kDim));
  for (auto& o : own) {
    o.resize(static_cast<size_t>(own_rows * kDim * 17 / 32));
    uint8_t* at = o.data();
    mats.emplace_back(own_rows, kDim, at, rng);
  }
  for (const bool q8 : {false, true}) {
    const auto nt = q8 ? mxfp4_gemm_nt_q8 : mxfp4_gemm_nt;
    const double dram_here = measure_dram_read_gbs(threads);
    double best = 1e30;
    for (int round = 0; round < 6; ++round) {  // round 0 warms up
      const auto t0 = std::chrono::steady_clock::now();
      parallel_for_dynamic(0, threads, [&](int64_t t) {
        for (int64_t c = 0; c < kCalls; ++c)
          nt(1, x.data(), kDim, mats[static_cast<size_t>(t)].view(), outs[static_cast<size_t>(t)].data(), kDim, false);
      });
      if (round > 0) best = std::min(best, seconds_since(t0));
    }
    const double gbs = static_cast<double>(threads * kCalls * mats[0].nbytes()) / best / 1e9;
    fmt::print("| {} | kernel alone: a {} × {} matrix per thread, L2-resident | {:.1f} | {:.1f} | {:.2f} | |\n",
               q8 ? "int8 (inference)" : "fp32 (exact)", own_rows, kDim, gbs, dram_here, gbs / dram_here);
  }
  return 0;
}
