// `moe report`: redraw a run's report from its metrics file, e.g. for a run that was
// interrupted, resumed, or is still going.
#include <fmt/format.h>

#include "cli/commands.h"
#include "report/training_report.h"

namespace moe::cli {

void add_report_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "report", "write DIR/report/ (loss curve, expert-load heat map, summary) from DIR/metrics.jsonl");
  auto run_dir = std::make_shared<std::string>();
  cmd->add_option("--run", *run_dir, "run directory (run.out_dir of `moe train`)")->required();
  cmd->callback([run_dir] {
    const ReportFiles f = write_training_report(*run_dir);
    fmt::print("wrote {}\n      {}\n      {}\n", f.summary.string(), f.loss_chart.string(),
               f.expert_load_chart.string());
  });
}

}  // namespace moe::cli
