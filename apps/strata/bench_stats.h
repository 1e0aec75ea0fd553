// Small helpers the `strata bench` commands share: the median of repeated
// timings, the machine's load average to print beside them (the machines are
// shared: a figure says how busy its machine was), the error exit, the
// deterministic values the benchmarks fill their arrays with, and the
// message sizes of --sizes.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
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

// ---- A kernel against its bound, measured in pairs ------------------------
//
// Timing a bound's kernel and the measured one as separate whole-array runs
// and dividing their medians drifted with the shared machine's load (one VM
// read 0.89 to 1.20 within an hour). PairedBound steps the arrays slab by
// slab (slabs of at least kPairSlabElems elements, far larger than any
// cache), each slab with the bound and the measured kernel back to back,
// which one first alternating, so the two of a pair see the same memory
// bandwidth to within tens of milliseconds. Each pair gives one fraction
// (bound time / measured time, times `bytes_ratio` when the two move
// different bytes); the median is reported with the pairs' spread, and the
// involuntary context switches of the process during the pairs say whether
// its threads owned their cores.
constexpr size_t kPairSlabElems = size_t{16} << 20;
// Above this rate the timed threads were sharing their cores. Measured on
// the 2-core development VM with a 2-thread run: 30-90/s with a niced
// compile beside it, 280-300/s with one busy process (docs/perf.md).
constexpr double kContendedPerSecond = 100;

// Involuntary context switches of this process (all its threads): a thread
// that other runnable work pushed off its core.
inline int64_t InvoluntarySwitches() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_nivcsw;
}

struct PairedBound {
  size_t slabs = 1;
  std::vector<double> fraction;             // one per pair
  std::vector<double> bound_s, measured_s;  // per repetition: the slabs' sum
  int64_t involuntary_switches = 0;
  double seconds = 0;  // wall time of the pairs
  double switches_per_s() const { return seconds > 0 ? involuntary_switches / seconds : 0; }
  bool contended() const { return switches_per_s() > kContendedPerSecond; }

  // Appends another run's pairs and repetitions (the same slabs).
  void Append(const PairedBound& o) {
    slabs = o.slabs;
    fraction.insert(fraction.end(), o.fraction.begin(), o.fraction.end());
    bound_s.insert(bound_s.end(), o.bound_s.begin(), o.bound_s.end());
    measured_s.insert(measured_s.end(), o.measured_s.begin(), o.measured_s.end());
    involuntary_switches += o.involuntary_switches;
    seconds += o.seconds;
  }

  // Adds roofline_fraction (median) and its min/p25/p75/max, the pairs,
  // slabs, load average and context switches to j.
  void AddTo(nlohmann::json& j) const {
    j["roofline_fraction"] = Quantile(fraction, 0.5);
    j["roofline_fraction_min"] = Quantile(fraction, 0);
    j["roofline_fraction_p25"] = Quantile(fraction, 0.25);
    j["roofline_fraction_p75"] = Quantile(fraction, 0.75);
    j["roofline_fraction_max"] = Quantile(fraction, 1);
    j["pairs"] = fraction.size();
    j["slabs"] = slabs;
    j["load_average"] = LoadAverage();
    j["involuntary_context_switches"] = involuntary_switches;
    j["involuntary_context_switches_per_s"] = switches_per_s();
    // Threads that do not own their cores are bound by their share of the
    // CPUs, not by memory: the fraction then measures the scheduler.
    j["cores_contended"] = contended();
  }

  // The two lines the text output prints.
  void Print(const char* measured_name, int reps) const {
    std::printf(
        "  roofline_fraction %.3f (median of %zu roofline/%s pairs: %d repetitions x %zu "
        "slab(s); min %.3f, p25 %.3f, p75 %.3f, max %.3f)\n",
        Quantile(fraction, 0.5), fraction.size(), measured_name, reps, slabs, Quantile(fraction, 0),
        Quantile(fraction, 0.25), Quantile(fraction, 0.75), Quantile(fraction, 1));
    std::printf("  machine         load average %.2f, %.0f involuntary context switches/s%s\n",
                LoadAverage(), switches_per_s(),
                contended() ? ": the threads did not own their cores, so the fraction measures "
                              "the scheduler, not memory"
                            : "");
  }
};

// Runs `reps` repetitions over n elements: per slab [begin, end), bound(begin,
// end) and measured(begin, end), each returning its seconds, back to back.
// `between(r)` runs after each repetition's pairs (the comparisons that are
// not bounds; untimed here). Repetitions are numbered from `first_rep` (which
// of a pair runs first alternates with it), so that a caller interleaving
// several measurements one repetition at a time keeps the alternation.
template <class Bound, class Measured, class Between>
PairedBound MeasurePairs(size_t n, int reps, double bytes_ratio, Bound&& bound, Measured&& measured,
                         Between&& between, int first_rep = 0) {
  PairedBound p;
  p.slabs = std::max<size_t>(1, std::min<size_t>(8, n / kPairSlabElems));
  for (int r = first_rep; r < first_rep + reps; ++r) {
    const int64_t switches = InvoluntarySwitches();
    const auto t0 = std::chrono::steady_clock::now();
    double bound_sum = 0, measured_sum = 0;
    for (size_t k = 0; k < p.slabs; ++k) {
      const size_t begin = n * k / p.slabs, end = n * (k + 1) / p.slabs;
      double tb = 0, tm = 0;
      if ((static_cast<size_t>(r) + k) % 2 == 0) {
        tb = bound(begin, end);
        tm = measured(begin, end);
      } else {
        tm = measured(begin, end);
        tb = bound(begin, end);
      }
      p.fraction.push_back(tb / tm * bytes_ratio);
      bound_sum += tb;
      measured_sum += tm;
    }
    p.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    p.involuntary_switches += InvoluntarySwitches() - switches;
    p.bound_s.push_back(bound_sum);
    p.measured_s.push_back(measured_sum);
    between(r);
  }
  return p;
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
