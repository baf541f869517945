#pragma once
// What a running training prints: on a terminal one status line redrawn in place, otherwise
// (logs, pipes) a plain line every few steps. Events (validation, checkpoints, warnings) always
// get lines of their own.
#include <cstdint>
#include <string>

namespace moe {

struct StepStatus {
  int64_t step = 0;  // steps done
  int64_t total = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // fraction of the machine's fp32 FMA peak
  double eta_s = 0;
};

class Progress {
 public:
  enum class Mode { Live, Lines, None };
  // "auto" | "bar" | "lines" | "none"; auto picks Live on a terminal.
  Progress(const std::string& mode, int64_t log_every);
  Mode mode() const { return mode_; }

  void step(const StepStatus& s);
  // A line of its own on stdout (the live line is cleared first and redrawn by the next step).
  void message(const std::string& line);
  // To stderr, likewise clearing the live line.
  void warning(const std::string& line);
  // Ends the live line so later output starts on a fresh one.
  void finish();

 private:
  void clear_live();

  Mode mode_;
  int64_t log_every_;
  bool live_shown_ = false;
};

// "42s", "9m05s", "1h02m".
std::string format_duration(double seconds);
// "512", "12.3K", "4.56M".
std::string format_count(double n);

}  // namespace moe
