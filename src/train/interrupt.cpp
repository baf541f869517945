#include "train/interrupt.h"

#include <csignal>

namespace moe {

namespace {

volatile std::sig_atomic_t g_requested = 0;
struct sigaction g_old_int, g_old_term;

extern "C" void on_stop_signal(int sig) {
  g_requested = 1;
  // The next Ctrl-C is not caught: it ends the process the usual way.
  if (sig == SIGINT) std::signal(SIGINT, SIG_DFL);
}

}  // namespace

InterruptGuard::InterruptGuard() {
  g_requested = 0;
  struct sigaction sa = {};
  sa.sa_handler = on_stop_signal;
  // Interrupted reads and writes resume: a Ctrl-C during a checkpoint write must finish that
  // write (and then save at the step's end), not fail it with EINTR. Every user of the flag
  // polls it; none relies on a blocking call being cut short.
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGTERM, &sa, &g_old_term);
}

InterruptGuard::~InterruptGuard() {
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGTERM, &g_old_term, nullptr);
}

bool InterruptGuard::requested() const { return g_requested != 0; }

}  // namespace moe
