#pragma once
// A minimal SVG writer for the training report: the handful of shapes a line chart and a heat
// map need, with text escaped, so the report needs no plotting library.
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moe::svg {

struct Stroke {
  Stroke(std::string color_ = "#000", double width_ = 1, std::string dash_ = "", double opacity_ = 1)
      : color(std::move(color_)), width(width_), dash(std::move(dash_)), opacity(opacity_) {}
  std::string color;
  double width;
  std::string dash;  // SVG stroke-dasharray, e.g. "6 4"; empty: solid
  double opacity;
};

enum class Anchor { Start, Middle, End };

struct Font {
  Font(double size_ = 12, Anchor anchor_ = Anchor::Start, bool bold_ = false,
       std::string color_ = "#222", double rotate_ = 0)
      : size(size_), anchor(anchor_), bold(bold_), color(std::move(color_)), rotate(rotate_) {}
  double size;
  Anchor anchor;
  bool bold;
  std::string color;
  double rotate;  // degrees about the text's anchor point
};

class Document {
 public:
  Document(double width, double height);

  void rect(double x, double y, double w, double h, const std::string& fill,
            const std::string& stroke = "none", const std::string& title = "");
  void line(double x1, double y1, double x2, double y2, const Stroke& s);
  // Points with a non-finite coordinate break the line into separate pieces (skipped steps).
  void polyline(const std::vector<std::pair<double, double>>& points, const Stroke& s);
  void circle(double cx, double cy, double r, const std::string& fill,
              const std::string& stroke = "none", const std::string& title = "");
  void text(double x, double y, std::string_view content, const Font& f = {});
  // A horizontal or vertical linear gradient definition, referenced as url(#id).
  void linear_gradient(const std::string& id, const std::vector<std::pair<double, std::string>>& stops,
                       bool vertical);

  double width() const { return width_; }
  double height() const { return height_; }
  // The complete document, XML declaration included.
  std::string str() const;

 private:
  double width_, height_;
  std::string defs_, body_;
};

std::string escape_xml(std::string_view text);
// Round, human tick positions covering [lo, hi] (about `target` of them, spaced 1, 2 or 5 x 10^k).
std::vector<double> nice_ticks(double lo, double hi, int target);
// A tick label without trailing zeros: "0.5", "2", "1500", "1.2e+06".
std::string tick_label(double v);
// Viridis colour map (perceptually uniform, readable in grey and by colour-blind readers);
// t is clamped to [0, 1].
std::string viridis(double t);

}  // namespace moe::svg
