// The report's page: inline SVG charts drawn here (line charts over sizes or
// threads, stacked bars per placement) and one self-contained HTML page of a
// Report: no script, no network, no external file. Pure functions.
//
// Every chart keeps its legend in a column right of the plot area, so no
// legend entry covers a point or a bar; the axes start at the data's first x
// (a step, a thread count, a size), y at 0.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "apps/strata/report/report.h"

namespace strata::cli::report {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), any order
  bool dashed = false;
  int color = -1;  // index into the palette; -1: the series' index
};

enum class AxisFormat { kNumber, kBytes };

struct LineChart {
  std::string title;
  std::string x_label, y_label;
  bool log2_x = false;  // sizes: one tick per power of two (thinned)
  AxisFormat x_format = AxisFormat::kNumber;
  std::vector<Series> series;
};

struct StackedBarChart {
  std::string title;
  std::string y_label;
  std::vector<std::string> parts;                                 // legend, bottom part first
  std::vector<std::pair<std::string, std::vector<double>>> bars;  // label, one value per part
};

// Chart geometry, exposed for the tests: the plot area's right edge and the
// legend's left edge (the legend never starts left of the plot's edge).
inline constexpr int kChartWidth = 820;
inline constexpr int kPlotLeft = 72;
inline constexpr int kPlotRight = 590;
inline constexpr int kLegendLeft = 610;

std::string RenderLineChart(const LineChart& c);
std::string RenderStackedBars(const StackedBarChart& c);

// "64K", "1M", "2G" (powers of 1024), else the number of bytes.
std::string BytesLabel(double bytes);
// Tick values from lo to hi, 1/2/5 × 10^k steps, about `n` of them.
std::vector<double> NiceTicks(double lo, double hi, int n);

// The whole page.
std::string RenderPage(const Report& r);

// &, <, >, " escaped.
std::string Escape(const std::string& s);

}  // namespace strata::cli::report
