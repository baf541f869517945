#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

TEST(Tensor, ZeroSizedIsOrdinary) {
  Tensor t = Tensor::zeros({0, 16}, DType::F32, MemCategory::Activations);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.nbytes(), 0);
  t.zero();
  Tensor v = t.view({16, 0});
  EXPECT_EQ(v.dim(0), 16);
}

TEST(Tensor, ViewRejectsWrongCount) {
  Tensor t = Tensor::zeros({3, 4}, DType::F32, MemCategory::Scratch);
  EXPECT_THROW(t.view({5, 2}), Error);
}

TEST(Memory, TracksEveryCategoryAndReleases) {
  auto& tracker = MemoryTracker::instance();
  const int64_t before = tracker.current(MemCategory::Routing);
  {
    Tensor a = Tensor::zeros({100}, DType::I32, MemCategory::Routing);
    Tensor b = a;  // shared storage counts once
    EXPECT_EQ(tracker.current(MemCategory::Routing), before + 400);
  }
  EXPECT_EQ(tracker.current(MemCategory::Routing), before);
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
  // 1 + 3*2^-8 is halfway too: rounds up to the even neighbour 1 + 2^-6.
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
}

TEST(Tensor, NarrowSharesStorage) {
  Tensor t = Tensor::zeros({4, 3, 2}, DType::F32, MemCategory::Scratch);
  Tensor e2 = t.narrow(2, 1);
  EXPECT_EQ(e2.shape(), (Shape{1, 3, 2}));
  e2.f32()[5] = 7.0f;
  EXPECT_EQ(t.f32()[2 * 6 + 5], 7.0f);
  EXPECT_EQ(t.narrow(4, 0).numel(), 0);
  EXPECT_THROW(t.narrow(3, 2), Error);
}

TEST(BlockCache, LargeBlocksAreReusedAndBounded) {
  release_cached_blocks();
  const BlockCacheStats start = block_cache_stats();
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({12 << 20}, DType::F32, MemCategory::Scratch);  // 48 MiB
    first = a.raw();
    std::fill(a.f32(), a.f32() + a.numel(), 5.0f);
  }
  EXPECT_GE(block_cache_stats().cached_bytes, int64_t{48} << 20) << "kept, not unmapped";
  {
    // A slightly different size of the same 2 MiB class comes back from the cache...
    Tensor b = Tensor::zeros({(12 << 20) - 1000}, DType::F32, MemCategory::Scratch);
    EXPECT_EQ(b.raw(), first);
    EXPECT_EQ(block_cache_stats().hits, start.hits + 1);
    // ...and zeros() still zeroes a recycled block.
    EXPECT_EQ(max_abs(b.f32(), b.numel()), 0.0);
    EXPECT_EQ(MemoryTracker::instance().current(MemCategory::Scratch), b.nbytes())
        << "the tracker counts what tensors use, not what the cache holds";
  }
  {
    // A much smaller request does not take (and waste) the big block.
    Tensor c = Tensor::empty({9 << 20}, DType::F32, MemCategory::Scratch);  // 36 MiB
    EXPECT_NE(c.raw(), first);
  }
  // Never more than kMaxCachedBytes held.
  {
    std::vector<Tensor> many;
    for (int i = 0; i < 12; ++i)
      many.push_back(Tensor::empty({int64_t{24} << 20}, DType::F32, MemCategory::Scratch));  // 96 MiB
  }
  EXPECT_LE(block_cache_stats().cached_bytes, static_cast<int64_t>(kMaxCachedBytes));
  release_cached_blocks();
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
  // Small blocks bypass the cache.
  const int64_t misses = block_cache_stats().misses;
  { Tensor d = Tensor::empty({1000}, DType::F32, MemCategory::Scratch); }
  EXPECT_EQ(block_cache_stats().misses, misses);
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
}

#if defined(__SANITIZE_ADDRESS__)
#define MOE_TEST_GLIBC_MALLOC 0  // ASan brings its own allocator
#elif defined(__GLIBC__)
#define MOE_TEST_GLIBC_MALLOC 1
#else
#define MOE_TEST_GLIBC_MALLOC 0
#endif

TEST(BlockCache, WhatAStepFreesServesTheNextWithoutPageFaults) {
  if (!MOE_TEST_GLIBC_MALLOC) GTEST_SKIP() << "glibc's malloc only";
  // Activations of 1-16 MiB (below the block cache, 59 MiB in all) allocated, written and freed
  // like a step's: with glibc's defaults (which trim a heap top of more than twice the largest
  // block freed) or with blocks from aligned_alloc (whose split-off fronts keep the free blocks
  // from merging), thousands of pages were faulted in again every step.
  auto minor_faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<int64_t>(u.ru_minflt);
  };
  auto step = [] {
    std::vector<Tensor> acts;
    for (int64_t mib : {1, 4, 16, 8, 2, 8, 4, 16}) {
      acts.push_back(Tensor::empty({mib << 18}, DType::F32, MemCategory::Activations));
      std::fill(acts.back().f32(), acts.back().f32() + acts.back().numel(), 1.0f);
    }
  };
  step();
  step();
  const int64_t before = minor_faults();
  for (int i = 0; i < 5; ++i) step();
  EXPECT_LT(minor_faults() - before, 100) << "freed memory went back to the kernel";
}

TEST(ThreadPool, LoopsCoverEveryIndexOnceAtAnyThreadCount) {
  const int before = num_threads();
  for (int threads : {1, 2, 3, 8}) {
    set_num_threads(threads);
    EXPECT_EQ(num_threads(), threads);
    for (int round = 0; round < 200; ++round) {
      const int64_t n = round % 37;
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int> bad_index{0};
      auto body = [&](int64_t i) {
        hits[static_cast<size_t>(i)].fetch_add(1);
        if (thread_index() < 0 || thread_index() >= threads) bad_index.fetch_add(1);
      };
      if (round % 2) parallel_for(0, n, body);
      else parallel_for_dynamic(0, n, body);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << threads << " " << i;
      EXPECT_EQ(bad_index.load(), 0);
    }
  }
  set_num_threads(before);
}

TEST(ThreadPool, NestedLoopsRunSeriallyOnTheCallingThread) {
  std::vector<int> inner_thread(64, -1);
  std::atomic<int> mismatches{0};
  parallel_for(0, 8, [&](int64_t o) {
    const int me = thread_index();
    parallel_for(0, 8, [&](int64_t i) {
      inner_thread[static_cast<size_t>(o * 8 + i)] = thread_index();
      if (thread_index() != me) mismatches.fetch_add(1);
    });
  });
  EXPECT_EQ(mismatches.load(), 0);
  for (int t : inner_thread) EXPECT_GE(t, 0);
}

TEST(ThreadPool, ResizingInsideALoopIsAnError) {
  std::atomic<int> errors{0};
  parallel_for(0, 4, [&](int64_t) {
    try {
      set_num_threads(3);
    } catch (const Error&) {
      errors.fetch_add(1);
    }
  });
  EXPECT_EQ(errors.load(), 4);
}

TEST(ThreadPool, AnExceptionInABodyReachesTheCaller) {
  for (bool dynamic : {false, true}) {
    auto body = [](int64_t i) {
      if (i == 13) fail("body {} failed", i);
    };
    try {
      if (dynamic) parallel_for_dynamic(0, 100, body);
      else parallel_for(0, 100, body);
      ADD_FAILURE() << "no exception";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "body 13 failed");
    }
    // The pool still works afterwards.
    std::atomic<int64_t> sum{0};
    parallel_for(0, 100, [&](int64_t i) { sum.fetch_add(i); });
    EXPECT_EQ(sum.load(), 4950);
  }
}
