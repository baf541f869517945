#include "core/parallel.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "core/error.h"

namespace moe {

namespace {

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// How long a thread spins on a word before it sleeps on it.
std::chrono::nanoseconds spin_budget() {
  static const std::chrono::nanoseconds budget = [] {
    const char* v = std::getenv("MOE_SPIN_US");
    const long us = v && *v ? std::strtol(v, nullptr, 10) : 100;
    return std::chrono::nanoseconds(std::max(0L, us) * 1000);
  }();
  return budget;
}

// Waits until `word` differs from `seen`: spins for the budget, then sleeps on a futex.
// `sleepers` counts sleeping threads so that wakers skip the system call when nobody sleeps.
uint32_t wait_change(std::atomic<uint32_t>& word, uint32_t seen, std::atomic<int>& sleepers) {
  const auto budget = spin_budget();
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    const uint32_t now = word.load(std::memory_order_acquire);
    if (now != seen) return now;
    if ((spins & 63) != 63) {
      cpu_relax();
      continue;
    }
    if (std::chrono::steady_clock::now() - start < budget) continue;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (word.load(std::memory_order_seq_cst) == seen) futex_wait(&word, seen);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void publish(std::atomic<uint32_t>& word, std::atomic<int>& sleepers) {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&word);
}

thread_local int t_index = 0;
thread_local bool t_in_loop = false;

struct Loop {
  detail::IndexFn fn = nullptr;
  void* body = nullptr;
  int64_t begin = 0, end = 0;
  bool dynamic = false;
  int parts = 1;
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::exception_ptr error;  // the first exception a body threw; the caller rethrows it

  void run_part(int part) {
    try {
      run_indices(part);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      next.store(end, std::memory_order_relaxed);  // dynamic loops stop handing out work
    }
  }

  void run_indices(int part) {
    if (dynamic) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < end;) fn(body, i);
      return;
    }
    const int64_t n = end - begin;
    const int64_t lo = begin + n * part / parts, hi = begin + n * (part + 1) / parts;
    for (int64_t i = lo; i < hi; ++i) fn(body, i);
  }
};

class Pool {
 public:
  Pool() {
    try {
      resize(default_threads());
    } catch (const std::system_error&) {
      // No thread could be created: loops run on the caller alone.
    }
  }
  ~Pool() { stop_workers(); }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void resize(int n) {
    n = std::max(1, n);
    MOE_CHECK(!t_in_loop, "set_num_threads({}) inside a parallel loop's body", n);
    const std::lock_guard<std::mutex> lock(mu_);
    if (n == threads_.load()) return;
    stop_workers();
    stop_ = false;
    // Workers start from the generation as it is now: one read later could miss a loop (or
    // the stop) published before the thread got going.
    const uint32_t generation = start_.load(std::memory_order_acquire);
    try {
      for (int w = 1; w < n; ++w) workers_.emplace_back([this, w, generation] { worker(w, generation); });
    } catch (...) {
      stop_workers();  // no thread count the loops would wait for in vain
      throw;
    }
    threads_ = n;
  }

  void run(int64_t begin, int64_t end, bool dynamic, detail::IndexFn fn, void* body) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    // Nested loops, a second caller while a loop runs, one thread or one index: serially here.
    // The count is read again under the lock (a resize may have run meanwhile).
    const bool shared = !t_in_loop && n > 1 && threads() > 1 && lock.try_lock();
    const int threads = shared ? threads_.load() : 1;
    if (threads == 1) {
      if (lock.owns_lock()) lock.unlock();
      for (int64_t i = begin; i < end; ++i) fn(body, i);
      return;
    }
    loop_.fn = fn, loop_.body = body, loop_.begin = begin, loop_.end = end, loop_.dynamic = dynamic;
    loop_.parts = static_cast<int>(std::min<int64_t>(threads, n));
    loop_.next.store(begin, std::memory_order_relaxed);
    loop_.error = nullptr;
    const uint32_t done_before = done_.load(std::memory_order_relaxed);
    running_.store(threads - 1, std::memory_order_relaxed);
    publish(start_, start_sleepers_);
    t_in_loop = true;
    loop_.run_part(0);
    t_in_loop = false;
    // The last worker to finish bumps done_.
    for (uint32_t d = done_before; d == done_before;) d = wait_change(done_, done_before, done_sleepers_);
    if (loop_.error) {
      std::exception_ptr e = std::exchange(loop_.error, nullptr);
      lock.unlock();
      std::rethrow_exception(e);
    }
  }

 private:
  static int default_threads() {
    if (const char* v = std::getenv("OMP_NUM_THREADS"); v && *v) {
      const int n = std::atoi(v);
      if (n > 0) return n;
    }
    return available_cpus();
  }

  void worker(int index, uint32_t seen) {
    t_index = index;
    for (;;) {
      seen = wait_change(start_, seen, start_sleepers_);
      if (stop_.load(std::memory_order_acquire)) return;
      if (index < loop_.parts) {
        t_in_loop = true;
        loop_.run_part(index);
        t_in_loop = false;
      }
      if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) publish(done_, done_sleepers_);
    }
  }

  void stop_workers() {
    threads_ = 1;  // loops started from now on (even from a static destructor) run serially
    if (workers_.empty()) return;
    stop_.store(true, std::memory_order_release);
    publish(start_, start_sleepers_);
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex mu_;  // one loop at a time; held while it runs
  std::atomic<int> threads_{1};
  std::vector<std::thread> workers_;
  Loop loop_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> start_{0}, done_{0};
  std::atomic<int> start_sleepers_{0}, done_sleepers_{0};
  std::atomic<int> running_{0};
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

void set_num_threads(int n) { pool().resize(n); }

int num_threads() { return pool().threads(); }

int thread_index() { return t_index; }

int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace detail {
void run_loop(int64_t begin, int64_t end, bool dynamic, IndexFn fn, void* body) {
  pool().run(begin, end, dynamic, fn, body);
}
}  // namespace detail

}  // namespace moe
