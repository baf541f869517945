#pragma once
// A training run as its metrics file tells it: what the report plots and summarizes. Read back
// from <out_dir>/metrics.jsonl (one JSON object per optimizer step, written by the trainer), so
// a finished, interrupted or resumed run can be re-plotted at any time.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace moe {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;          // NaN for a skipped (non-finite) step
  double val_loss = 0;      // NaN unless this step ran a validation
  int64_t tokens = 0;       // seen so far, resumes included
  double tokens_per_s = 0;
  double step_s = 0;
  double val_s = 0;         // time spent validating after this step
  double mfu = 0;           // NaN when the record predates MFU
  bool skipped = false;
};

struct LayerLoad {
  int64_t layer = 0;                  // model layer index
  std::vector<int64_t> run_counts;    // tokens routed to each expert over the whole run
  std::vector<int64_t> window_counts; // ... over the last `load_window` steps
};

struct RunHistory {
  std::filesystem::path source;
  std::vector<StepMetrics> steps;      // in file order (ascending step)
  double unigram_entropy = 0;          // NaN when no record carries it
  std::map<std::string, int64_t> peak_memory;  // tracked bytes by category, max over the run
  std::vector<LayerLoad> expert_load;  // MoE layers in model order; empty for a dense model
  int64_t load_window = 0;             // steps in LayerLoad::window_counts
  // What MFU is against, from the last record that says (records before the FMA peak have none).
  double fma_peak_gflops = 0;
  std::string simd, cpu;
};

// Raises moe::Error naming the file (and line and field) when it is missing, empty, or holds
// a line that is not a step record. A torn last line (a run killed mid-write) is ignored.
RunHistory read_run_history(const std::filesystem::path& metrics_file);

}  // namespace moe
