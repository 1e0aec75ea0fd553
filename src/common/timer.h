// Wall-clock timing on the steady clock.
#pragma once

#include <chrono>
#include <cstdint>

namespace strata {

inline int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Starts on construction; Seconds() is the time since then (or since Reset()).
class Stopwatch {
 public:
  Stopwatch() : start_(NowNanos()) {}
  void Reset() { start_ = NowNanos(); }
  int64_t Nanos() const { return NowNanos() - start_; }
  double Seconds() const { return static_cast<double>(Nanos()) * 1e-9; }

 private:
  int64_t start_;
};

}  // namespace strata
