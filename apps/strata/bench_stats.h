// Small helpers the `strata bench` commands share: the median of repeated
// timings, the machine's load average to print beside them (the machines are
// shared: a figure says how busy its machine was), the error exit, the
// deterministic values the benchmarks fill their arrays with, and the
// message sizes of --sizes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"

namespace strata::cli {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

// The q-quantile (0 <= q <= 1) of v, linear between the order statistics
// (numpy's default): Quantile(v, 0.5) is Median(v).
inline double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

// The 1-minute load average, -1 if /proc/loadavg cannot be read.
inline double LoadAverage() {
  std::ifstream f("/proc/loadavg");
  double load = -1;
  f >> load;
  return load;
}

// Prints "strata <command>: <msg>" to stderr and returns the usage error's
// exit code: a message without a Status is about the command line.
inline int Fail(const char* command, const std::string& msg) {
  std::fprintf(stderr, "strata %s: %s\n", command, msg.c_str());
  return kExitUsage;
}
// Prints "strata <command>: <status>" and returns its exit code
// (exit_codes.h); InvalidArgument is about the command line's values.
inline int Fail(const char* command, const Status& s) {
  std::fprintf(stderr, "strata %s: %s\n", command, s.ToString().c_str());
  return s.code() == StatusCode::kInvalidArgument ? kExitUsage : ExitCodeOf(s);
}

// The NVMe engine's O_DIRECT unit: aio.block_size (and the bench flags that
// set it) must be a multiple of it. The config check accepts any multiple of
// 512 (DeepSpeed's rule), so a message about it says both.
inline constexpr char kBlockSizeRule[] =
    "is not a multiple of 4096 between 4096 and 1 GiB (the NVMe engine's O_DIRECT unit; a "
    "config's aio.block_size must be one as well, although the config check accepts any "
    "multiple of 512)";

// Deterministic non-zero pseudo-random values in (0, 1] (fast enough for 100M
// elements): element i of the sequence `salt`.
inline float Hash01(uint64_t i, uint64_t salt) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ salt;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>((x >> 40) + 1) * 0x1p-24f;
}

// --sizes: "LO..HI" (x4 steps, HI last) or "A,B,C". `range` and `list`
// are examples for the error ("4K..64M", "4K, 1M, 64M").
inline bool ParseSizes(const std::string& text, std::vector<size_t>* out, std::string* err,
                       const char* range, const char* list) {
  out->clear();
  const size_t dots = text.find("..");
  if (dots != std::string::npos) {
    uint64_t lo = 0, hi = 0;
    if (!ParseByteSize(text.substr(0, dots), &lo) || !ParseByteSize(text.substr(dots + 2), &hi) ||
        lo == 0 || hi < lo) {
      *err = "--sizes: \"" + text + "\" is not a range like " + range;
      return false;
    }
    for (uint64_t s = lo; s <= hi; s *= 4) out->push_back(s);
    if (out->back() != hi) out->push_back(hi);
    return true;
  }
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    uint64_t v = 0;
    if (!ParseByteSize(item, &v) || v == 0) {
      *err = "--sizes: \"" + item + "\" is not a size (e.g. " + list + ")";
      return false;
    }
    out->push_back(v);
  }
  if (out->empty()) {
    *err = "--sizes: empty";
    return false;
  }
  return true;
}

// 64K, 1M, 2G, or the bytes.
inline std::string SizeLabel(size_t b) {
  if (b >= (size_t{1} << 30) && b % (size_t{1} << 30) == 0) return std::to_string(b >> 30) + "G";
  if (b >= (size_t{1} << 20) && b % (size_t{1} << 20) == 0) return std::to_string(b >> 20) + "M";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + "K";
  return std::to_string(b);
}

// A bench asked for a device this machine does not have (Unavailable or
// NotSupported): not an error, nothing measured. Prints it when `print`
// (one JSON object with --json) and returns true; any other status returns
// false.
inline bool ReportNoDevice(const char* command, const Status& s, bool as_json, const char* hint,
                           bool print = true) {
  if (s.code() != StatusCode::kUnavailable && s.code() != StatusCode::kNotSupported) return false;
  const std::string reason(s.message());
  if (!print) return true;
  if (as_json) {
    std::printf("{\"device\":\"none\",\"reason\":%s}\n", nlohmann::json(reason).dump().c_str());
  } else {
    std::printf("%s: no CUDA device (%s); nothing measured. %s\n", command, reason.c_str(), hint);
  }
  return true;
}

}  // namespace strata::cli
