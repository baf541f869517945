#pragma once
// The end-of-training report, <run>/report/: loss.svg (loss curve), expert_load.svg (heat map)
// and summary.md (final losses, throughput, MFU, memory, expert balance). Everything comes from
// <run>/metrics.jsonl, so `moe report --run DIR` reproduces exactly what the trainer wrote.
#include <filesystem>
#include <string>

#include "report/run_history.h"

namespace moe {

inline constexpr const char* kReportDir = "report";

struct ReportFiles {
  std::filesystem::path loss_chart, expert_load_chart, summary;
};

std::string summary_markdown(const RunHistory& h);

// Reads <run_dir>/metrics.jsonl and writes the three files (atomically) into <run_dir>/report.
ReportFiles write_training_report(const std::filesystem::path& run_dir);

}  // namespace moe
