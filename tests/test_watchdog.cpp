// The collective watchdog (src/parallel/collective_watchdog.h) in one process: a wait longer
// than the limit ends the process with the cause; short waits, work outside waits and waits in a
// slow phase (a checkpoint write) shorter than that phase's limit never fire it. The end-to-end drill (a SIGSTOPped rank under mpirun) is
// tests/fault_drills.sh stall.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "parallel/collective_watchdog.h"

namespace moe {
namespace {

using namespace std::chrono_literals;

TEST(CollectiveWatchdogDeathTest, AWaitLongerThanTheLimitEndsTheProcessWithTheCause) {
  // The watchdog is a thread: the child must start from a clean exec, not a fork of this one.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const CollectiveWatchdog watchdog({0.4, "test.limit"}, {60, "test.slow"}, 3);
        CollectiveWatchdog::set_step(7);
        const CollectiveWait wait("MPI_Test (stalled)");
        std::this_thread::sleep_for(10s);
        std::exit(0);  // not reached when the watchdog works
      },
      testing::ExitedWithCode(1),
      "rank 3: error: no progress from the other ranks for [0-9]+ s in MPI_Test \\(stalled\\) at "
      "step 7: a rank stalled or died \\(test.limit = 0.4 s\\); ending the job");
}

TEST(CollectiveWatchdogDeathTest, AWaitInASlowPhaseEndsTheProcessAtTheSlowPhaseLimit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const CollectiveWatchdog watchdog({60, "test.limit"}, {0.4, "test.slow"}, 1);
        const CollectiveWatchdog::SlowPhase writing;
        const CollectiveWait wait("MPI_Barrier");
        std::this_thread::sleep_for(10s);
        std::exit(0);
      },
      testing::ExitedWithCode(1),
      "rank 1: error: no progress from the other ranks for [0-9]+ s in MPI_Barrier: a rank "
      "stalled or died \\(test.slow = 0.4 s\\); ending the job");
}

TEST(CollectiveWatchdog, ShortWaitsWorkBetweenWaitsAndSlowPhaseWaitsDoNotFire) {
  const CollectiveWatchdog watchdog({0.3, "test.limit"}, {5, "test.slow"}, 0);
  // Many short waits, together far longer than the limit.
  for (int i = 0; i < 60; ++i) {
    const CollectiveWait wait("MPI_Alltoallv");
    std::this_thread::sleep_for(10ms);
  }
  // Long work between collectives: not a wait.
  std::this_thread::sleep_for(800ms);
  // A long wait for one rank's checkpoint write.
  {
    const CollectiveWatchdog::SlowPhase slow_writes;
    const CollectiveWait wait("MPI_Barrier");
    std::this_thread::sleep_for(800ms);
  }
  SUCCEED();
}

TEST(CollectiveWatchdog, ZeroIsOffAndOneWatchdogAtATime) {
  const CollectiveWatchdog off({0, "test.limit"}, {0, "test.slow"}, 0);
  {
    const CollectiveWait wait("MPI_Barrier");
    std::this_thread::sleep_for(50ms);
  }
  const CollectiveWatchdog on({60, "test.limit"}, {0, "test.slow"}, 0);
  EXPECT_THROW(CollectiveWatchdog({60, "test.limit"}, {60, "test.slow"}, 0), std::exception);
}

}  // namespace
}  // namespace moe
