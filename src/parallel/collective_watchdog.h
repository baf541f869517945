#pragma once
// A rank that stops making progress without dying (SIGSTOP, a hung disk, a livelocked node)
// leaves every other rank blocked in its next collective forever: MPI reports nothing, because
// nothing failed. The watchdog turns that hang into an ending with the cause printed.
//
// Only waits inside collectives are timed: every blocking MPI call of MpiCommunicator is
// wrapped in a CollectiveWait, which costs two relaxed atomic stores (no clock read, no lock).
// A thread wakes about once a second; when it sees the same wait still open for longer than the
// limit, it prints one line naming the rank, the collective, the step and the cause, and ends
// this process with _Exit(1). The thread never calls MPI (the library is initialised at
// MPI_THREAD_FUNNELED); mpirun sees a rank exit without MPI_Finalize and tears down the whole
// job, the stalled rank included.
//
// Long but legitimate one-sided work that other ranks wait for in a barrier (rank 0 writing a
// checkpoint) runs inside a CollectiveWatchdog::SlowPhase scope, where waits are timed against a
// second, longer limit: a disk that hangs for good still ends the job, a slow one does not.
#include <cstdint>
#include <memory>

namespace moe {

class CollectiveWatchdog {
 public:
  // A limit on one wait, and what sets it, for the message (e.g. "parallel.collective_timeout").
  // seconds <= 0: such waits are never timed.
  struct Limit {
    double seconds = 0;
    const char* setting = "";
  };
  // Arms the process's watchdog for the lifetime of this object: a wait in a collective longer
  // than `waits.seconds` (inside a SlowPhase: `slow_phase_waits.seconds`) ends the process. With
  // neither limit positive nothing is started. One armed watchdog per process at a time.
  CollectiveWatchdog(Limit waits, Limit slow_phase_waits, int rank);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // The training step in progress, for the message (-1: none).
  static void set_step(int64_t step);

  // While one exists anywhere in the process, waits are timed against the slow-phase limit.
  class SlowPhase {
   public:
    SlowPhase();
    ~SlowPhase();
    SlowPhase(const SlowPhase&) = delete;
    SlowPhase& operator=(const SlowPhase&) = delete;
  };

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Marks the calling thread as blocked in collective `what` (a string literal, e.g.
// "MPI_Alltoallv (all_to_all_v)") until destruction. Not nestable; MPI calls only.
class CollectiveWait {
 public:
  explicit CollectiveWait(const char* what) noexcept;
  ~CollectiveWait();
  CollectiveWait(const CollectiveWait&) = delete;
  CollectiveWait& operator=(const CollectiveWait&) = delete;
};

}  // namespace moe
