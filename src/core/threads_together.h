#pragma once
// Timing a loop on every core at once, for the measurements of the machine's limits (FMA peak,
// DRAM read): `threads` threads of their own (not the pool, so the count is exact) start
// together after a spin barrier, and the slowest one's time is the run's.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace moe {

// Runs body(t) for t in [0, threads) on that many threads started together; returns the slowest
// thread's seconds.
template <class Body>
double slowest_seconds_together(int threads, Body&& body) {
  std::atomic<int> ready{0};
  std::vector<double> secs(static_cast<size_t>(threads));
  auto run = [&](int t) {
    ready.fetch_add(1);
    while (ready.load() < threads) {
    }
    const auto t0 = std::chrono::steady_clock::now();
    body(t);
    secs[static_cast<size_t>(t)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<std::thread> others;
  for (int t = 1; t < threads; ++t) others.emplace_back(run, t);
  run(0);
  for (std::thread& th : others) th.join();
  return *std::max_element(secs.begin(), secs.end());
}

}  // namespace moe
