#include "report/svg.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fmt/format.h>

namespace moe::svg {

namespace {

// Coordinates with two decimals keep files small and diffs stable.
std::string num(double v) {
  std::string s = fmt::format("{:.2f}", v);
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

std::string stroke_attrs(const Stroke& s) {
  std::string a = fmt::format(R"( stroke="{}" stroke-width="{}")", escape_xml(s.color), num(s.width));
  if (!s.dash.empty()) a += fmt::format(R"( stroke-dasharray="{}")", escape_xml(s.dash));
  if (s.opacity < 1) a += fmt::format(R"( stroke-opacity="{}")", num(s.opacity));
  return a;
}

std::string title_element(const std::string& title) {
  return title.empty() ? std::string() : "<title>" + escape_xml(title) + "</title>";
}

}  // namespace

Document::Document(double width, double height) : width_(width), height_(height) {}

void Document::rect(double x, double y, double w, double h, const std::string& fill,
                    const std::string& stroke, const std::string& title) {
  const std::string open = fmt::format(R"(<rect x="{}" y="{}" width="{}" height="{}" fill="{}" stroke="{}")",
                                       num(x), num(y), num(w), num(h), escape_xml(fill), escape_xml(stroke));
  body_ += title.empty() ? open + "/>\n" : open + ">" + title_element(title) + "</rect>\n";
}

void Document::line(double x1, double y1, double x2, double y2, const Stroke& s) {
  body_ += fmt::format(R"(<line x1="{}" y1="{}" x2="{}" y2="{}"{}/>)", num(x1), num(y1), num(x2),
                       num(y2), stroke_attrs(s)) + "\n";
}

void Document::polyline(const std::vector<std::pair<double, double>>& points, const Stroke& s) {
  std::string pts;
  int n = 0;
  std::pair<double, double> first;
  auto flush = [&] {
    // A single point would be invisible as a line: drawn as a dot instead.
    if (n == 1) {
      circle(first.first, first.second, s.width, s.color);
    } else if (n > 1) {
      body_ += fmt::format(R"(<polyline fill="none" stroke-linejoin="round" points="{}"{}/>)",
                           pts, stroke_attrs(s)) + "\n";
    }
    pts.clear();
    n = 0;
  };
  for (const auto& [x, y] : points) {
    if (!std::isfinite(x) || !std::isfinite(y)) {
      flush();
      continue;
    }
    if (n == 0) first = {x, y};
    pts += (n ? " " : "") + num(x) + "," + num(y);
    ++n;
  }
  flush();
}

void Document::circle(double cx, double cy, double r, const std::string& fill,
                      const std::string& stroke, const std::string& title) {
  const std::string open = fmt::format(R"(<circle cx="{}" cy="{}" r="{}" fill="{}" stroke="{}")",
                                       num(cx), num(cy), num(r), escape_xml(fill), escape_xml(stroke));
  body_ += title.empty() ? open + "/>\n" : open + ">" + title_element(title) + "</circle>\n";
}

void Document::text(double x, double y, std::string_view content, const Font& f) {
  static constexpr std::array<const char*, 3> anchors = {"start", "middle", "end"};
  std::string attrs = fmt::format(R"( x="{}" y="{}" font-size="{}" text-anchor="{}" fill="{}")", num(x),
                                  num(y), num(f.size), anchors[static_cast<size_t>(f.anchor)],
                                  escape_xml(f.color));
  if (f.bold) attrs += R"( font-weight="bold")";
  if (f.rotate != 0)
    attrs += fmt::format(R"x( transform="rotate({} {} {})")x", num(f.rotate), num(x), num(y));
  body_ += "<text" + attrs + ">" + escape_xml(content) + "</text>\n";
}

void Document::linear_gradient(const std::string& id,
                               const std::vector<std::pair<double, std::string>>& stops,
                               bool vertical) {
  // Vertical gradients run bottom (offset 0) to top, like a colour bar's value axis.
  defs_ += fmt::format(R"(<linearGradient id="{}" x1="0" y1="{}" x2="{}" y2="0">)", escape_xml(id),
                       vertical ? 1 : 0, vertical ? 0 : 1) + "\n";
  for (const auto& [offset, color] : stops)
    defs_ += fmt::format(R"(<stop offset="{}" stop-color="{}"/>)", num(offset), escape_xml(color)) + "\n";
  defs_ += "</linearGradient>\n";
}

std::string Document::str() const {
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" viewBox="0 0 {} {}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">)",
                     num(width_), num(height_), num(width_), num(height_)) + "\n";
  if (!defs_.empty()) out += "<defs>\n" + defs_ + "</defs>\n";
  // An opaque background: viewers with a dark theme would otherwise show black text on black.
  out += fmt::format(R"(<rect x="0" y="0" width="{}" height="{}" fill="#fff"/>)", num(width_), num(height_)) + "\n";
  out += body_;
  out += "</svg>\n";
  return out;
}

std::string escape_xml(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {};
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) return {lo};
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  // A small tolerance keeps an end tick that rounding pushed just outside the range.
  const double eps = step * 1e-9;
  for (double v = std::ceil((lo - eps) / step) * step; v <= hi + eps; v += step)
    ticks.push_back(std::fabs(v) < eps ? 0.0 : v);
  return ticks;
}

std::string tick_label(double v) {
  if (v != 0 && (std::fabs(v) >= 1e6 || std::fabs(v) < 1e-3)) return fmt::format("{:.2g}", v);
  std::string s = fmt::format("{:.4f}", v);
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

std::string viridis(double t) {
  // Nine samples of matplotlib's viridis, linearly interpolated.
  static constexpr std::array<std::array<double, 3>, 9> stops = {{{68, 1, 84},
                                                                  {71, 44, 122},
                                                                  {59, 81, 139},
                                                                  {44, 113, 142},
                                                                  {33, 144, 141},
                                                                  {39, 173, 129},
                                                                  {92, 200, 99},
                                                                  {170, 220, 50},
                                                                  {253, 231, 37}}};
  if (!std::isfinite(t)) t = 0;
  t = std::clamp(t, 0.0, 1.0) * static_cast<double>(stops.size() - 1);
  const size_t i = std::min(static_cast<size_t>(t), stops.size() - 2);
  const double f = t - static_cast<double>(i);
  std::array<int, 3> rgb{};
  for (size_t c = 0; c < 3; ++c)
    rgb[c] = static_cast<int>(std::lround(stops[i][c] + f * (stops[i + 1][c] - stops[i][c])));
  return fmt::format("#{:02x}{:02x}{:02x}", rgb[0], rgb[1], rgb[2]);
}

}  // namespace moe::svg
