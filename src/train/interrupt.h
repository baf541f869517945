#pragma once
// Ctrl-C (SIGINT) or SIGTERM during training asks the run to stop cleanly: the current step
// finishes, a checkpoint is written, and the run ends so `moe train --resume` continues it
// bitwise. A second Ctrl-C ends the process at once (the default action is restored after the
// first), for when the user really means it.
//
// Under mpirun only some ranks may see the signal; the trainer folds the request into the
// step's loss all-reduce, so every rank stops after the same step.
namespace moe {

class InterruptGuard {
 public:
  InterruptGuard();   // installs the handlers (restoring the previous ones on destruction)
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  // A signal arrived since construction.
  bool requested() const;
};

}  // namespace moe
