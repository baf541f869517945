#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <utility>
#include <vector>

#include "report/charts.h"
#include "report/svg.h"

namespace moe {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Series {
  std::string label;
  svg::Stroke stroke;
  bool dots = false;
};

// Trailing mean over the last `window` finite losses: shows the trend through per-step noise
// without shifting it ahead of the data.
std::vector<double> moving_average(const std::vector<StepMetrics>& steps, size_t window) {
  std::vector<double> out(steps.size(), kNaN);
  double sum = 0;
  std::vector<double> recent;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!std::isfinite(steps[i].loss)) continue;
    recent.push_back(steps[i].loss);
    sum += steps[i].loss;
    if (recent.size() > window) sum -= recent[recent.size() - window - 1];
    out[i] = sum / static_cast<double>(std::min(recent.size(), window));
  }
  return out;
}

}  // namespace

std::string loss_chart_svg(const RunHistory& h) {
  const double W = 900, H = 540;
  const double left = 78, right = 24, top = 58, bottom = 64;
  const double pw = W - left - right, ph = H - top - bottom;
  svg::Document doc(W, H);

  const int64_t x_lo = std::min<int64_t>(0, h.steps.front().step - 1), x_hi = h.steps.back().step;
  double y_lo = std::numeric_limits<double>::infinity(), y_hi = -y_lo;
  auto widen = [&](double v) {
    if (std::isfinite(v)) y_lo = std::min(y_lo, v), y_hi = std::max(y_hi, v);
  };
  for (const StepMetrics& s : h.steps) widen(s.loss), widen(s.val_loss);
  widen(h.unigram_entropy);
  if (!std::isfinite(y_lo)) y_lo = 0, y_hi = 1;  // every step skipped: an empty frame
  if (y_hi - y_lo < 1e-6) y_lo -= 0.5, y_hi += 0.5;
  const double pad = 0.04 * (y_hi - y_lo);
  y_lo = std::max(0.0, y_lo - pad), y_hi += pad;

  auto X = [&](double step) {
    return left + pw * (step - static_cast<double>(x_lo)) / std::max(1.0, static_cast<double>(x_hi - x_lo));
  };
  auto Y = [&](double v) { return top + ph * (1 - (v - y_lo) / (y_hi - y_lo)); };

  doc.text(W / 2, 26, "Training loss", {18, svg::Anchor::Middle, true});
  std::string subtitle = fmt::format("{} steps", h.steps.back().step);
  for (auto it = h.steps.rbegin(); it != h.steps.rend(); ++it)
    if (std::isfinite(it->val_loss)) {
      subtitle += fmt::format(" · final validation loss {:.3f} (perplexity {:.2f})", it->val_loss,
                              std::exp(it->val_loss));
      break;
    }
  doc.text(W / 2, 44, subtitle, {12, svg::Anchor::Middle, false, "#555"});

  // Grid and ticks first, so the data draws over them.
  const svg::Stroke grid{"#e3e3e3", 1};
  for (double t : svg::nice_ticks(y_lo, y_hi, 8)) {
    doc.line(left, Y(t), left + pw, Y(t), grid);
    doc.line(left - 5, Y(t), left, Y(t), {"#333", 1});
    doc.text(left - 8, Y(t) + 4, svg::tick_label(t), {11, svg::Anchor::End});
  }
  for (double t : svg::nice_ticks(static_cast<double>(x_lo), static_cast<double>(x_hi), 10)) {
    doc.line(X(t), top, X(t), top + ph, grid);
    doc.line(X(t), top + ph, X(t), top + ph + 5, {"#333", 1});
    doc.text(X(t), top + ph + 19, svg::tick_label(t), {11, svg::Anchor::Middle});
  }
  doc.rect(left, top, pw, ph, "none", "#333");
  doc.text(left + pw / 2, H - 16, "optimizer step", {13, svg::Anchor::Middle});
  doc.text(22, top + ph / 2, "loss (nats per token)", {13, svg::Anchor::Middle, false, "#222", -90});

  std::vector<Series> legend;
  if (std::isfinite(h.unigram_entropy)) {
    const Series s{fmt::format("unigram entropy baseline ({:.3f})", h.unigram_entropy),
                   {"#d62728", 1.5, "7 5"}};
    doc.line(left, Y(h.unigram_entropy), left + pw, Y(h.unigram_entropy), s.stroke);
    legend.push_back(s);
  }
  std::vector<std::pair<double, double>> raw, smooth;
  const size_t window = std::clamp<size_t>(h.steps.size() / 40, 1, 50);
  const std::vector<double> avg = moving_average(h.steps, window);
  for (size_t i = 0; i < h.steps.size(); ++i) {
    const double x = X(static_cast<double>(h.steps[i].step));
    raw.emplace_back(x, std::isfinite(h.steps[i].loss) ? Y(h.steps[i].loss) : kNaN);
    smooth.emplace_back(x, std::isfinite(avg[i]) ? Y(avg[i]) : kNaN);
  }
  const Series raw_s{"train loss per step", {"#9ecae1", 1}};
  doc.polyline(raw, raw_s.stroke);
  legend.push_back(raw_s);
  if (window > 1) {
    const Series smooth_s{fmt::format("train loss, mean of last {} steps", window), {"#1f5fa8", 2}};
    doc.polyline(smooth, smooth_s.stroke);
    legend.push_back(smooth_s);
  }
  std::vector<std::pair<double, double>> val;
  for (const StepMetrics& s : h.steps)
    if (std::isfinite(s.val_loss)) val.emplace_back(X(static_cast<double>(s.step)), Y(s.val_loss));
  if (!val.empty()) {
    const Series val_s{"validation loss", {"#e6550d", 2}, true};
    doc.polyline(val, val_s.stroke);
    for (const auto& [x, y] : val) doc.circle(x, y, 4, "#e6550d", "#fff");
    legend.push_back(val_s);
  }

  // Legend in the top-right corner, where falling loss curves leave room.
  const double lw = 290, lh = 12 + 20 * static_cast<double>(legend.size());
  const double lx = left + pw - lw - 10, ly = top + 10;
  doc.rect(lx, ly, lw, lh, "#ffffff", "#bbbbbb");
  for (size_t i = 0; i < legend.size(); ++i) {
    const double y = ly + 16 + 20 * static_cast<double>(i);
    doc.line(lx + 10, y, lx + 42, y, legend[i].stroke);
    if (legend[i].dots) doc.circle(lx + 26, y, 4, legend[i].stroke.color, "#fff");
    doc.text(lx + 50, y + 4, legend[i].label, {12});
  }
  return doc.str();
}

}  // namespace moe
