#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <numeric>
#include <string>
#include <vector>

#include "report/charts.h"
#include "report/svg.h"

namespace moe {

namespace {

// Share of the layer's routed tokens per expert, in percent.
std::vector<double> shares(const std::vector<int64_t>& counts) {
  const double total = static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  std::vector<double> out;
  for (int64_t c : counts) out.push_back(total > 0 ? 100.0 * static_cast<double>(c) / total : 0.0);
  return out;
}

}  // namespace

std::string expert_load_svg(const RunHistory& h) {
  const bool have = !h.expert_load.empty() && !h.expert_load.front().run_counts.empty();
  if (!have) {
    svg::Document doc(640, 120);
    doc.text(320, 50, "Expert load", {18, svg::Anchor::Middle, true});
    doc.text(320, 80,
             h.expert_load.empty() ? "no MoE layers in this model"
                                   : "the metrics hold no per-expert counts",
             {13, svg::Anchor::Middle, false, "#555"});
    return doc.str();
  }
  const auto layers = static_cast<int64_t>(h.expert_load.size());
  const auto experts = static_cast<int64_t>(h.expert_load.front().run_counts.size());
  const double cw = std::clamp(720.0 / static_cast<double>(experts), 3.0, 48.0);
  const double ch = std::clamp(300.0 / static_cast<double>(layers), 3.0, 34.0);
  const double left = 86, top = 80, panel_gap = 76, right = 150, bottom = 62;
  const double gw = cw * static_cast<double>(experts), gh = ch * static_cast<double>(layers);
  const double W = std::max(560.0, left + gw + right);
  const double H = top + 2 * gh + panel_gap + bottom;
  svg::Document doc(W, H);

  struct Panel {
    std::string title;
    std::vector<std::vector<double>> share;  // [layer][expert], percent
  };
  std::vector<Panel> panels(2);
  panels[0].title = fmt::format("whole run ({} steps)", h.steps.size());
  panels[1].title = fmt::format("last {} step{}", h.load_window, h.load_window == 1 ? "" : "s");
  double hi = 0;
  for (const LayerLoad& l : h.expert_load) {
    panels[0].share.push_back(shares(l.run_counts));
    panels[1].share.push_back(shares(l.window_counts.empty() ? l.run_counts : l.window_counts));
    for (const Panel& p : panels) hi = std::max(hi, *std::max_element(p.share.back().begin(), p.share.back().end()));
  }
  // One scale for both panels, from zero so that colour reads as an amount; at least twice the
  // uniform share so a well-balanced run does not look alarmingly contrasted.
  const double uniform = 100.0 / static_cast<double>(experts);
  hi = std::max({hi, 2 * uniform, 1e-9});

  doc.text(W / 2, 26, "Expert load: share of routed tokens per expert", {18, svg::Anchor::Middle, true});
  doc.text(W / 2, 44,
           fmt::format("{} MoE layers × {} routed experts · uniform share {:.2f}%", layers, experts,
                       uniform),
           {12, svg::Anchor::Middle, false, "#555"});
  // Label every k-th expert / layer so labels never overlap.
  const int64_t estep = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(22.0 / cw)));
  const int64_t lstep = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(14.0 / ch)));
  const bool values_fit = cw >= 34 && ch >= 16;

  for (size_t p = 0; p < panels.size(); ++p) {
    const double y0 = top + static_cast<double>(p) * (gh + panel_gap);
    doc.text(left, y0 - 8, panels[p].title, {13, svg::Anchor::Start, true});
    for (int64_t l = 0; l < layers; ++l) {
      const double y = y0 + ch * static_cast<double>(l);
      if (l % lstep == 0)
        doc.text(left - 8, y + ch / 2 + 4,
                 fmt::format("layer {}", h.expert_load[static_cast<size_t>(l)].layer), {11, svg::Anchor::End});
      for (int64_t e = 0; e < experts; ++e) {
        const double v = panels[p].share[static_cast<size_t>(l)][static_cast<size_t>(e)];
        const double x = left + cw * static_cast<double>(e);
        doc.rect(x, y, cw, ch, svg::viridis(v / hi), "none",
                 fmt::format("layer {}, expert {}: {:.2f}%", h.expert_load[static_cast<size_t>(l)].layer, e, v));
        if (values_fit)
          doc.text(x + cw / 2, y + ch / 2 + 4, fmt::format("{:.1f}", v),
                   {10, svg::Anchor::Middle, false, v / hi > 0.6 ? "#111" : "#fff"});
      }
    }
    doc.rect(left, y0, gw, gh, "none", "#333");
    for (int64_t e = 0; e < experts; e += estep)
      doc.text(left + cw * (static_cast<double>(e) + 0.5), y0 + gh + 15, std::to_string(e),
               {10, svg::Anchor::Middle});
    doc.text(left + gw / 2, y0 + gh + 32, "expert", {12, svg::Anchor::Middle});
  }

  // Colour bar spanning both panels, with the uniform share marked.
  const double bx = left + gw + 28, bw = 16, by = top, bh = 2 * gh + panel_gap;
  std::vector<std::pair<double, std::string>> stops;
  for (int i = 0; i <= 8; ++i) stops.emplace_back(i / 8.0, svg::viridis(i / 8.0));
  doc.linear_gradient("load-scale", stops, /*vertical=*/true);
  doc.rect(bx, by, bw, bh, "url(#load-scale)", "#333");
  auto BY = [&](double v) { return by + bh * (1 - v / hi); };
  for (double t : svg::nice_ticks(0, hi, 6)) {
    doc.line(bx + bw, BY(t), bx + bw + 4, BY(t), {"#333", 1});
    doc.text(bx + bw + 7, BY(t) + 4, svg::tick_label(t) + "%", {10});
  }
  doc.line(bx, BY(uniform), bx + bw + 44, BY(uniform), {"#d62728", 2, "3 2"});
  doc.text(bx + bw + 46, BY(uniform) + 4, "uniform", {10, svg::Anchor::Start, false, "#d62728"});
  doc.text(bx + bw / 2, by + bh + 22, "share of", {11, svg::Anchor::Middle});
  doc.text(bx + bw / 2, by + bh + 36, "layer tokens", {11, svg::Anchor::Middle});
  return doc.str();
}

}  // namespace moe
