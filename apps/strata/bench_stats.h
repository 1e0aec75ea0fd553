// Small statistics the `strata bench` commands share: the median of repeated
// timings, and the machine's load average to print beside them (the machines
// are shared: a figure says how busy its machine was).
#pragma once

#include <algorithm>
#include <fstream>
#include <vector>

namespace strata::cli {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

// The 1-minute load average, -1 if /proc/loadavg cannot be read.
inline double LoadAverage() {
  std::ifstream f("/proc/loadavg");
  double load = -1;
  f >> load;
  return load;
}

}  // namespace strata::cli
