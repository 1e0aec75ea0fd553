#include "apps/strata/report/report_html.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace strata::cli::report {
namespace {

// Colour-blind friendly palette (Okabe-Ito, then greys).
constexpr const char* kPalette[] = {"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7",
                                    "#56B4E9", "#F0E442", "#000000", "#999999", "#7F3C8D"};
constexpr int kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);
constexpr int kPlotTop = 40;
constexpr int kLegendRow = 18;

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

// A tick label: no trailing zeros, k/M for large values.
std::string TickLabel(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a >= 1e6 && std::fmod(a, 1e5) == 0)
    std::snprintf(buf, sizeof(buf), "%gM", v / 1e6);
  else if (a >= 1e4 && std::fmod(a, 1e3) == 0)
    std::snprintf(buf, sizeof(buf), "%gk", v / 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

std::string Text(double x, double y, const std::string& s, const char* anchor = "middle",
                 const char* extra = "") {
  return "<text x=\"" + Num(x) + "\" y=\"" + Num(y) + "\" text-anchor=\"" + anchor + "\"" + extra +
         ">" + Escape(s) + "</text>\n";
}

std::string Line(double x1, double y1, double x2, double y2, const char* stroke,
                 const char* extra = "") {
  return "<line x1=\"" + Num(x1) + "\" y1=\"" + Num(y1) + "\" x2=\"" + Num(x2) + "\" y2=\"" +
         Num(y2) + "\" stroke=\"" + stroke + "\"" + extra + "/>\n";
}

// Legend names are cut to fit the column right of the plot.
std::string Short(const std::string& s) { return s.size() <= 28 ? s : s.substr(0, 27) + "…"; }

struct Frame {
  int height;
  int plot_bottom;
};

Frame FrameFor(size_t legend_entries) {
  // Tall enough for the legend column, at least 340 px.
  const int legend_h = kPlotTop + static_cast<int>(legend_entries) * kLegendRow + 10;
  const int height = std::max(340, legend_h + 50);
  return {height, height - 56};
}

std::string Open(const std::string& title, int height) {
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"" << kChartWidth
    << "\" height=\"" << height << "\" viewBox=\"0 0 " << kChartWidth << " " << height
    << "\" font-family=\"sans-serif\" font-size=\"12\" role=\"img\" aria-label=\"" << Escape(title)
    << "\">\n";
  o << "<rect x=\"0\" y=\"0\" width=\"" << kChartWidth << "\" height=\"" << height
    << "\" fill=\"#ffffff\"/>\n";
  o << Text(kChartWidth / 2.0, 22, title, "middle", " font-size=\"15\" font-weight=\"bold\"");
  return o.str();
}

// Y axis from 0 to the ticks' top; returns the top value.
double YAxis(std::ostringstream& o, double y_max, int plot_bottom, const std::string& label,
             std::vector<double>* ticks_out) {
  if (!(y_max > 0)) y_max = 1;
  std::vector<double> ticks = NiceTicks(0, y_max, 5);
  const double top = ticks.back();
  for (double t : ticks) {
    const double y = plot_bottom - (plot_bottom - kPlotTop) * (t / top);
    o << Line(kPlotLeft, y, kPlotRight, y, "#e4e4e4");
    o << Text(kPlotLeft - 6, y + 4, TickLabel(t), "end");
  }
  o << Line(kPlotLeft, kPlotTop, kPlotLeft, plot_bottom, "#333333");
  const double mid = (kPlotTop + plot_bottom) / 2.0;
  o << "<text x=\"16\" y=\"" << Num(mid) << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
    << Num(mid) << ")\">" << Escape(label) << "</text>\n";
  *ticks_out = ticks;
  return top;
}

void LegendEntry(std::ostringstream& o, int i, const std::string& name, const char* colour,
                 bool dashed, bool box) {
  const double y = kPlotTop + 6 + i * kLegendRow;
  if (box)
    o << "<rect x=\"" << kLegendLeft << "\" y=\"" << Num(y - 6) << "\" width=\"14\" height=\"12\" "
      << "fill=\"" << colour << "\"/>\n";
  else
    o << Line(kLegendLeft, y, kLegendLeft + 22, y, colour,
              dashed ? " stroke-width=\"2.5\" stroke-dasharray=\"6 4\"" : " stroke-width=\"2.5\"");
  o << Text(kLegendLeft + 28, y + 4, Short(name), "start");
}

}  // namespace

std::string Escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string BytesLabel(double b) {
  const double k = 1024;
  char buf[32];
  if (b >= k * k * k && std::fmod(b, k * k * k) == 0)
    std::snprintf(buf, sizeof(buf), "%gG", b / (k * k * k));
  else if (b >= k * k && std::fmod(b, k * k) == 0)
    std::snprintf(buf, sizeof(buf), "%gM", b / (k * k));
  else if (b >= k && std::fmod(b, k) == 0)
    std::snprintf(buf, sizeof(buf), "%gK", b / k);
  else
    std::snprintf(buf, sizeof(buf), "%g", b);
  return buf;
}

std::vector<double> NiceTicks(double lo, double hi, int n) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / std::max(1, n);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  const double first = std::floor(lo / step + 1e-9) * step;
  for (double v = first; v < hi + step * 0.999; v += step) t.push_back(std::round(v / step) * step);
  if (t.size() < 2) t.push_back(t.back() + step);
  return t;
}

std::string RenderLineChart(const LineChart& c) {
  std::ostringstream o;
  const Frame f = FrameFor(c.series.size());
  o << Open(c.title, f.height);
  double x_lo = INFINITY, x_hi = -INFINITY, y_hi = 0;
  for (const Series& s : c.series)
    for (auto [x, y] : s.points) {
      if (c.log2_x && !(x > 0)) continue;
      x_lo = std::min(x_lo, x);
      x_hi = std::max(x_hi, x);
      if (std::isfinite(y)) y_hi = std::max(y_hi, y);
    }
  if (!std::isfinite(x_lo)) {
    o << Text((kPlotLeft + kPlotRight) / 2.0, f.height / 2.0, "no data");
    o << "</svg>\n";
    return o.str();
  }
  // X: from the first data point (no padding left of it) to the last.
  auto tx = [&](double x) { return c.log2_x ? std::log2(x) : x; };
  double a = tx(x_lo), b = tx(x_hi);
  if (b <= a) {
    a -= 1;
    b += 1;
  }
  auto px = [&](double x) { return kPlotLeft + (kPlotRight - kPlotLeft) * (tx(x) - a) / (b - a); };
  std::vector<double> yt;
  const double top = YAxis(o, y_hi * 1.05, f.plot_bottom, c.y_label, &yt);
  auto py = [&](double y) { return f.plot_bottom - (f.plot_bottom - kPlotTop) * (y / top); };
  // X ticks.
  std::vector<double> xt;
  if (c.log2_x) {
    const int lo = static_cast<int>(std::ceil(a - 1e-9)),
              hi = static_cast<int>(std::floor(b + 1e-9));
    const int stride = std::max(1, (hi - lo + 1 + 7) / 8);
    for (int e = lo; e <= hi; e += stride) xt.push_back(std::pow(2.0, e));
  } else {
    // Counts (threads, steps) get whole-number ticks only.
    bool whole = true;
    for (const Series& s : c.series)
      for (auto [x, y] : s.points) whole = whole && x == std::floor(x);
    for (double t : NiceTicks(x_lo, x_hi, 6))
      if (t >= x_lo - 1e-9 && t <= x_hi + 1e-9 && (!whole || t == std::floor(t))) xt.push_back(t);
    if (whole && xt.size() < 2) {
      xt.clear();
      for (double v = x_lo; v <= x_hi; v += 1) xt.push_back(v);
    }
    if (xt.empty() || xt.front() > x_lo + 1e-9) xt.insert(xt.begin(), x_lo);
  }
  for (double t : xt) {
    const double x = px(t);
    o << Line(x, f.plot_bottom, x, f.plot_bottom + 5, "#333333");
    o << Text(x, f.plot_bottom + 18,
              c.x_format == AxisFormat::kBytes ? BytesLabel(t) : TickLabel(t));
  }
  o << Line(kPlotLeft, f.plot_bottom, kPlotRight, f.plot_bottom, "#333333");
  o << Text((kPlotLeft + kPlotRight) / 2.0, f.plot_bottom + 40, c.x_label);
  for (size_t i = 0; i < c.series.size(); ++i) {
    const Series& s = c.series[i];
    const char* colour = kPalette[(s.color >= 0 ? s.color : static_cast<int>(i)) % kPaletteSize];
    auto pts = s.points;
    std::sort(pts.begin(), pts.end());
    std::string path;
    for (auto [x, y] : pts) {
      if (!std::isfinite(y) || (c.log2_x && !(x > 0))) continue;
      if (!path.empty()) path += ' ';
      path += Num(px(x));
      path += ',';
      path += Num(py(y));
    }
    o << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"2\""
      << (s.dashed ? " stroke-dasharray=\"6 4\"" : "") << " points=\"" << path << "\"/>\n";
    for (auto [x, y] : pts)
      if (std::isfinite(y) && !(c.log2_x && !(x > 0)))
        o << "<circle cx=\"" << Num(px(x)) << "\" cy=\"" << Num(py(y)) << "\" r=\"2.5\" fill=\""
          << colour << "\"><title>" << Escape(s.name) << ": " << TickLabel(y)
          << "</title></circle>\n";
    LegendEntry(o, static_cast<int>(i), s.name, colour, s.dashed, false);
  }
  o << "</svg>\n";
  return o.str();
}

std::string RenderStackedBars(const StackedBarChart& c) {
  std::ostringstream o;
  const Frame f = FrameFor(c.parts.size());
  o << Open(c.title, f.height);
  double y_hi = 0;
  for (const auto& [label, values] : c.bars) {
    double sum = 0;
    for (double v : values) sum += std::isfinite(v) ? std::max(0.0, v) : 0.0;
    y_hi = std::max(y_hi, sum);
  }
  std::vector<double> yt;
  const double top = YAxis(o, y_hi * 1.05, f.plot_bottom, c.y_label, &yt);
  auto py = [&](double y) { return f.plot_bottom - (f.plot_bottom - kPlotTop) * (y / top); };
  const double slot = (kPlotRight - kPlotLeft) / std::max<double>(1, c.bars.size());
  const double width = std::min(90.0, slot * 0.6);
  for (size_t b = 0; b < c.bars.size(); ++b) {
    const double x = kPlotLeft + slot * (b + 0.5) - width / 2;
    double base = 0;
    const auto& values = c.bars[b].second;
    for (size_t p = 0; p < values.size(); ++p) {
      const double v = std::isfinite(values[p]) ? std::max(0.0, values[p]) : 0.0;
      if (v <= 0) continue;
      const double y0 = py(base), y1 = py(base + v);
      o << "<rect x=\"" << Num(x) << "\" y=\"" << Num(y1) << "\" width=\"" << Num(width)
        << "\" height=\"" << Num(std::max(0.5, y0 - y1)) << "\" fill=\""
        << kPalette[p % kPaletteSize] << "\"><title>"
        << Escape(c.bars[b].first + ", " + (p < c.parts.size() ? c.parts[p] : "?") + ": " +
                  TickLabel(v))
        << "</title></rect>\n";
      base += v;
    }
    o << Text(x + width / 2, f.plot_bottom + 18, c.bars[b].first);
  }
  o << Line(kPlotLeft, f.plot_bottom, kPlotRight, f.plot_bottom, "#333333");
  for (size_t p = 0; p < c.parts.size(); ++p)
    LegendEntry(o, static_cast<int>(p), c.parts[p], kPalette[p % kPaletteSize], false, true);
  o << "</svg>\n";
  return o.str();
}

namespace {

const char kStyle[] = R"(
body { font-family: sans-serif; margin: 24px auto; padding: 0 16px; max-width: 1100px; color: #222; }
h1 { font-size: 24px; margin-bottom: 4px; }
h2 { font-size: 19px; border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
table { border-collapse: collapse; margin: 10px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
caption { text-align: left; font-weight: bold; padding: 4px 0; }
.pass { background: #d9f2d9; } .FAIL { background: #f8d0d0; font-weight: bold; }
.skipped { background: #f1f1f1; color: #555; } .failed { color: #b00; font-weight: bold; }
.meta { color: #555; font-size: 13px; } .note { color: #444; font-size: 13px; margin: 4px 0; }
svg.chart { display: block; margin: 12px 0; border: 1px solid #eee; }
code { font-size: 12px; } details { margin: 8px 0; font-size: 13px; }
)";

bool Numeric(const std::string& s) {
  if (s.empty()) return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end != nullptr && (*end == '\0' || *end == 'x' || *end == '%');
}

void RenderTable(std::ostringstream& o, const Table& t) {
  o << "<table>";
  if (!t.caption.empty()) o << "<caption>" << Escape(t.caption) << "</caption>";
  o << "<tr>";
  for (const std::string& h : t.header) o << "<th>" << Escape(h) << "</th>";
  o << "</tr>\n";
  for (const auto& row : t.rows) {
    o << "<tr>";
    for (const std::string& cell : row)
      o << (Numeric(cell) ? "<td class=\"num\">" : "<td>") << Escape(cell) << "</td>";
    o << "</tr>\n";
  }
  o << "</table>\n";
}

}  // namespace

std::string RenderPage(const Report& r) {
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
    << "<title>strata report: " << Escape(r.device) << "</title>\n<style>" << kStyle
    << "</style>\n</head>\n<body>\n";
  o << "<h1>strata report</h1>\n<p class=\"meta\">" << Escape(r.device) << " &middot; strata "
    << Escape(r.version) << " &middot; started " << Escape(r.started_utc) << " UTC &middot; "
    << Fixed(r.elapsed_s, 0) << " s of a " << Fixed(r.time_limit_s, 0) << " s limit"
    << (r.quick ? " &middot; --quick" : "") << "<br><code>" << Escape(r.command) << "</code></p>\n";
  // Checks first: the page answers "is this machine healthy" at a glance.
  o << "<h2>Checks</h2>\n<table><tr><th>check</th><th>target</th><th>measured</th>"
    << "<th>result</th><th>what</th></tr>\n";
  for (const Check& c : r.checks) {
    const char* state = CheckStateName(c.state);
    o << "<tr><td>" << Escape(c.name) << "</td><td>" << Escape(c.target)
      << "</td><td class=\"num\">" << Fixed(c.measured, 3) << "</td><td class=\"" << state << "\">"
      << state << (c.state == CheckState::kSkipped ? ": " + Escape(c.reason) : std::string())
      << "</td><td>" << Escape(c.detail) << "</td></tr>\n";
  }
  o << "</table>\n";
  const std::vector<std::string> skipped = SkippedParts(r);
  if (!skipped.empty()) {
    o << "<p class=\"note\"><b>Skipped:</b></p><ul class=\"note\">";
    for (const std::string& s : skipped) o << "<li>" << Escape(s) << "</li>";
    o << "</ul>\n";
  }
  for (const Section& s : r.sections) {
    o << "<h2 id=\"" << Escape(s.id) << "\">" << Escape(s.title) << "</h2>\n";
    if (!s.device.empty()) o << "<p class=\"meta\">device: " << Escape(s.device) << "</p>\n";
    if (s.state != SectionState::kOk)
      o << "<p class=\"" << SectionStateName(s.state) << "\">" << SectionStateName(s.state) << ": "
        << Escape(s.reason) << "</p>\n";
    for (const std::string& n : s.notes) o << "<p class=\"note\">" << Escape(n) << "</p>\n";
    for (const std::string& p : s.skipped)
      o << "<p class=\"note\">skipped: " << Escape(p) << "</p>\n";
    for (const Table& t : s.tables) RenderTable(o, t);
    for (const std::string& svg : s.charts) o << svg;
    if (!s.figures.empty()) {
      o << "<details><summary>" << s.figures.size()
        << " figures, each with the command that reruns it</summary>\n<table><tr><th>figure</th>"
        << "<th>value</th><th>unit</th><th>device</th><th>command</th></tr>\n";
      for (const Figure& f : s.figures)
        o << "<tr><td>" << Escape(f.name) << "</td><td class=\"num\">" << TickLabel(f.value)
          << "</td><td>" << Escape(f.unit) << "</td><td>" << Escape(f.device) << "</td><td><code>"
          << Escape(f.command) << "</code></td></tr>\n";
      o << "</table></details>\n";
    }
  }
  o << "</body>\n</html>\n";
  return o.str();
}

}  // namespace strata::cli::report
