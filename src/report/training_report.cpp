#include "report/training_report.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <numeric>

#include "core/memory.h"
#include "io/atomic_file.h"
#include "report/charts.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

std::string loss_cell(double loss) {
  return std::isfinite(loss) ? fmt::format("{:.4f} (perplexity {:.2f})", loss, std::exp(loss))
                             : std::string("n/a");
}

std::string duration(double s) {
  if (!std::isfinite(s)) return "n/a";
  if (s < 60) return fmt::format("{:.1f} s", s);
  if (s < 3600) return fmt::format("{} min {:02d} s", static_cast<int64_t>(s) / 60, static_cast<int64_t>(s) % 60);
  return fmt::format("{} h {:02d} min", static_cast<int64_t>(s) / 3600, (static_cast<int64_t>(s) % 3600) / 60);
}

// Busiest expert over the mean expert: 1 is perfect balance, n_experts means one expert took all.
std::string max_over_mean(const std::vector<int64_t>& counts) {
  if (counts.empty()) return "n/a";
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total == 0) return "n/a";
  const double mean = static_cast<double>(total) / static_cast<double>(counts.size());
  return fmt::format("{:.2f}", static_cast<double>(*std::max_element(counts.begin(), counts.end())) / mean);
}

}  // namespace

std::string summary_markdown(const RunHistory& h) {
  double train_s = 0, val_s = 0, mfu_weighted = 0, mfu_s = 0, recent = 0;
  double step_tokens = 0;
  int64_t skipped = 0, n_recent = 0;
  double final_val = std::numeric_limits<double>::quiet_NaN();
  for (const StepMetrics& s : h.steps) {
    if (std::isfinite(s.step_s)) train_s += s.step_s;
    if (std::isfinite(s.val_s)) val_s += s.val_s;
    if (std::isfinite(s.step_s) && std::isfinite(s.tokens_per_s)) step_tokens += s.tokens_per_s * s.step_s;
    if (std::isfinite(s.mfu) && std::isfinite(s.step_s)) mfu_weighted += s.mfu * s.step_s, mfu_s += s.step_s;
    if (std::isfinite(s.val_loss)) final_val = s.val_loss;
    skipped += s.skipped;
  }
  for (auto it = h.steps.rbegin(); it != h.steps.rend() && n_recent < 10; ++it)
    if (std::isfinite(it->loss)) recent += it->loss, ++n_recent;
  const double final_train = n_recent ? recent / static_cast<double>(n_recent)
                                      : std::numeric_limits<double>::quiet_NaN();

  std::string md = "# Training report\n\n";
  md += fmt::format("Source: `{}` ({} step records). Pictures: [loss curve](loss.svg), "
                    "[expert load](expert_load.svg).\n\n", h.source.string(), h.steps.size());
  md += "| | |\n|---|---|\n";
  md += fmt::format("| steps | {} ({} skipped as non-finite) |\n", h.steps.back().step, skipped);
  md += fmt::format("| final train loss | {} (mean of the last {} steps) |\n", loss_cell(final_train), n_recent);
  md += fmt::format("| final validation loss | {} |\n", loss_cell(final_val));
  md += fmt::format("| unigram entropy baseline | {} |\n", loss_cell(h.unigram_entropy));
  if (std::isfinite(final_val) && std::isfinite(h.unigram_entropy))
    md += fmt::format("| validation loss vs baseline | {:+.4f} nats ({:.1f}% of the baseline) |\n",
                      final_val - h.unigram_entropy, 100.0 * final_val / h.unigram_entropy);
  md += fmt::format("| tokens seen | {} |\n", h.steps.back().tokens);
  md += fmt::format("| wall time | {} ({} in training steps, {} validating) |\n",
                    duration(train_s + val_s), duration(train_s), duration(val_s));
  md += fmt::format("| throughput | {:.0f} tokens/s (training steps) |\n",
                    train_s > 0 ? step_tokens / train_s : 0.0);
  std::string peak = "the measured fp32 GEMM peak";  // what records before the FMA peak used
  if (std::isfinite(h.fma_peak_gflops) && h.fma_peak_gflops > 0)
    peak = fmt::format("the {:.0f} GFLOP/s fp32 FMA peak ({}{})", h.fma_peak_gflops,
                       h.simd.empty() ? "?" : h.simd, h.cpu.empty() ? "" : ", " + h.cpu);
  md += fmt::format("| MFU | {} |\n", mfu_s > 0 ? fmt::format("{:.1f}% of {}", 100.0 * mfu_weighted / mfu_s, peak)
                                                 : std::string("n/a (not in the metrics)"));

  if (!h.peak_memory.empty()) {
    md += "\n## Peak tracked memory\n\n| category | peak |\n|---|---|\n";
    // Category order as the engine defines it, then anything else the file holds.
    std::vector<std::string> order;
    for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c)
      order.emplace_back(mem_category_name(static_cast<MemCategory>(c)));
    for (const auto& [cat, bytes] : h.peak_memory)
      if (std::find(order.begin(), order.end(), cat) == order.end()) order.push_back(cat);
    for (const std::string& cat : order)
      if (h.peak_memory.count(cat)) md += fmt::format("| {} | {} |\n", cat, format_bytes(h.peak_memory.at(cat)));
    md += "\nPeaks are per category; they need not occur at the same moment.\n";
  }

  if (!h.expert_load.empty()) {
    md += "\n## Expert load (busiest expert / mean expert; 1.00 is perfect balance)\n\n";
    md += fmt::format("| layer | whole run | last {} step{} |\n|---|---|---|\n", h.load_window,
                      h.load_window == 1 ? "" : "s");
    for (const LayerLoad& l : h.expert_load)
      md += fmt::format("| {} | {} | {} |\n", l.layer, max_over_mean(l.run_counts), max_over_mean(l.window_counts));
  }
  return md;
}

ReportFiles write_training_report(const fs::path& run_dir) {
  const RunHistory h = read_run_history(run_dir / "metrics.jsonl");
  const fs::path dir = run_dir / kReportDir;
  fs::create_directories(dir);
  ReportFiles f{dir / "loss.svg", dir / "expert_load.svg", dir / "summary.md"};
  write_file_atomic(f.loss_chart, loss_chart_svg(h));
  write_file_atomic(f.expert_load_chart, expert_load_svg(h));
  write_file_atomic(f.summary, summary_markdown(h));
  return f;
}

}  // namespace moe
