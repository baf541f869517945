#pragma once
// Parallel loops on the engine's own thread pool. Determinism rule for the whole engine: a value
// is always computed by one iteration in a fixed order; reductions split work into chunks whose
// size does not depend on the thread count and add the chunk results in index order. Which
// thread runs an iteration never matters.
//
// Waiting policy: between loops a worker spins for a bounded time (MOE_SPIN_US microseconds,
// default 100) and then sleeps in the kernel, so back-to-back loops of a training step start
// without a wake-up while an idle or oversubscribed pool gives its cores away (docs/PERF.md).
// A loop started inside another loop's body runs serially on the calling thread. An exception
// thrown by a body ends the loop early and is rethrown to the caller once every thread stopped.
#include <cstdint>
#include <type_traits>
#include <utility>

namespace moe {

// Threads of the pool, the calling thread included (at least 1). The default is
// OMP_NUM_THREADS when set, else the CPUs this process may run on.
void set_num_threads(int n);
int num_threads();
// 0 on the thread that started the running loop (and outside loops), 1..n-1 on the workers:
// an index for per-thread scratch.
int thread_index();
// CPUs this process may run on (its affinity mask).
int available_cpus();

// Fixed chunk length for cross-row reductions (independent of thread count by design).
constexpr int64_t kReduceChunk = 64;

namespace detail {
using IndexFn = void (*)(void* body, int64_t i);
void run_loop(int64_t begin, int64_t end, bool dynamic, IndexFn fn, void* body);
template <typename F>
void call_body(void* body, int64_t i) {
  (*static_cast<std::remove_reference_t<F>*>(body))(i);
}
}  // namespace detail

// Static partition: thread t takes the t-th contiguous share of [begin, end).
template <typename F>
void parallel_for(int64_t begin, int64_t end, F&& body) {
  detail::run_loop(begin, end, false, &detail::call_body<F>, const_cast<void*>(static_cast<const void*>(&body)));
}

// Dynamic schedule for uneven work (e.g. experts with very different token counts): threads
// take the next index as they finish. Still deterministic: each index is processed entirely by
// one thread.
template <typename F>
void parallel_for_dynamic(int64_t begin, int64_t end, F&& body) {
  detail::run_loop(begin, end, true, &detail::call_body<F>, const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace moe
