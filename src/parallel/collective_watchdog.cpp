#include "parallel/collective_watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace moe {

namespace {

using Clock = std::chrono::steady_clock;

// Odd while a wait is open. Every wait moves it on by 2, so the watchdog tells one long wait
// from a stream of short ones by the value alone, and the waiting thread never reads a clock.
// Only the thread that calls MPI writes it.
std::atomic<uint64_t> g_wait_seq{0};
std::atomic<const char*> g_wait_what{nullptr};
std::atomic<int64_t> g_step{-1};
std::atomic<int> g_slow_phase{0};
std::atomic<bool> g_armed{false};

}  // namespace

CollectiveWait::CollectiveWait(const char* what) noexcept {
  g_wait_what.store(what, std::memory_order_relaxed);
  g_wait_seq.store(g_wait_seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

CollectiveWait::~CollectiveWait() {
  g_wait_seq.store(g_wait_seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

CollectiveWatchdog::SlowPhase::SlowPhase() { g_slow_phase.fetch_add(1, std::memory_order_relaxed); }
CollectiveWatchdog::SlowPhase::~SlowPhase() { g_slow_phase.fetch_sub(1, std::memory_order_relaxed); }

void CollectiveWatchdog::set_step(int64_t step) { g_step.store(step, std::memory_order_relaxed); }

struct CollectiveWatchdog::Impl {
  Limit waits, slow_phase_waits;
  int rank = 0;
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  std::thread thread;

  void watch() {
    // Detection comes between limit and limit + one tick after the wait began.
    double shortest = 1.0;
    for (const Limit& l : {waits, slow_phase_waits})
      if (l.seconds > 0) shortest = std::min(shortest, l.seconds / 4);
    const auto tick = std::chrono::duration<double>(shortest);
    uint64_t timed = 0;  // the open wait being timed (its g_wait_seq value), 0: none
    Clock::time_point since;
    std::unique_lock lock(mutex);
    while (!wake.wait_for(lock, tick, [&] { return stop; })) {
      const uint64_t seq = g_wait_seq.load(std::memory_order_acquire);
      const Limit& limit = g_slow_phase.load(std::memory_order_relaxed) > 0 ? slow_phase_waits : waits;
      if ((seq & 1) == 0 || !(limit.seconds > 0)) {
        timed = 0;
        continue;
      }
      const auto now = Clock::now();
      if (seq != timed) {
        timed = seq;
        since = now;
        continue;
      }
      const double waited = std::chrono::duration<double>(now - since).count();
      if (waited >= limit.seconds) give_up(waited, limit);
    }
  }

  // The main thread sits inside MPI (it holds no stdio lock), so printing here is safe; MPI
  // itself may not be called from this thread, hence _Exit and not MPI_Abort.
  [[noreturn]] void give_up(double waited_s, const Limit& limit) const {
    const char* what = g_wait_what.load(std::memory_order_relaxed);
    const int64_t step = g_step.load(std::memory_order_relaxed);
    char where[48] = "";
    if (step >= 0) std::snprintf(where, sizeof where, " at step %lld", static_cast<long long>(step));
    std::fflush(stdout);
    std::fprintf(stderr,
                 "rank %d: error: no progress from the other ranks for %.0f s in %s%s: a rank "
                 "stalled or died (%s = %g s); ending the job\n",
                 rank, waited_s, what ? what : "a collective", where, limit.setting, limit.seconds);
    std::fflush(stderr);
    std::_Exit(1);
  }
};

CollectiveWatchdog::CollectiveWatchdog(Limit waits, Limit slow_phase_waits, int rank) {
  if (!(waits.seconds > 0) && !(slow_phase_waits.seconds > 0)) return;
  MOE_CHECK(!g_armed.exchange(true), "a collective watchdog is already armed in this process");
  impl_ = std::make_unique<Impl>();
  impl_->waits = waits;
  impl_->slow_phase_waits = slow_phase_waits;
  impl_->rank = rank;
  impl_->thread = std::thread([impl = impl_.get()] { impl->watch(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  if (!impl_) return;
  {
    const std::lock_guard lock(impl_->mutex);
    impl_->stop = true;
  }
  impl_->wake.notify_one();
  impl_->thread.join();
  g_armed.store(false);
}

}  // namespace moe
