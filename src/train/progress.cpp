#include "train/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fmt/format.h>

namespace moe {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
}

std::string format_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e4) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

Progress::Progress(const std::string& mode, int64_t log_every) : log_every_(log_every) {
  if (mode == "bar")
    mode_ = Mode::Live;
  else if (mode == "lines")
    mode_ = Mode::Lines;
  else if (mode == "none")
    mode_ = Mode::None;
  else
    mode_ = isatty(STDOUT_FILENO) ? Mode::Live : Mode::Lines;
}

void Progress::clear_live() {
  if (!live_shown_) return;
  // Carriage return + erase line: the next text starts where the status line was.
  std::fputs("\r\033[2K", stdout);
  std::fflush(stdout);
  live_shown_ = false;
}

void Progress::step(const StepStatus& s) {
  const std::string text =
      fmt::format("step {}/{} | loss {:.4f} | lr {:.2e} | {} tok/s | MFU {:.1f}% | ETA {}", s.step,
                  s.total, s.loss, s.lr, format_count(s.tokens_per_s), 100.0 * s.mfu,
                  format_duration(s.eta_s));
  switch (mode_) {
    case Mode::Live:
      fmt::print("\r\033[2K{}", text);
      std::fflush(stdout);
      live_shown_ = true;
      break;
    case Mode::Lines:
      if (s.step % log_every_ == 0 || s.step == s.total || s.step == 1) {
        fmt::print("{} | grad norm {:.3f}\n", text, s.grad_norm);
        std::fflush(stdout);
      }
      break;
    case Mode::None: break;
  }
}

void Progress::message(const std::string& line) {
  clear_live();
  fmt::print("{}\n", line);
  std::fflush(stdout);
}

void Progress::warning(const std::string& line) {
  clear_live();
  fmt::print(stderr, "warning: {}\n", line);
  std::fflush(stderr);
}

void Progress::finish() {
  if (live_shown_) {
    std::fputs("\n", stdout);
    std::fflush(stdout);
    live_shown_ = false;
  }
}

}  // namespace moe
