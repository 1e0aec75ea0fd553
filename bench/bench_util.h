// bench/bench_util.h — what the plain-main GPU benchmarks share: stop on a
// failed call with the file, line and message; unwrap a StatusOr or exit
// naming the program and the call; the median of a sample.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "strata/status.h"

#define BENCH_CHECK_OK(expr)                                                                     \
  do {                                                                                           \
    const ::strata::Status s_ = (expr);                                                          \
    if (!s_.ok()) {                                                                              \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, s_.ToString().c_str()); \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

namespace strata::bench {

// v's value, or exit 1 with "<program>: <what>: <error>".
template <typename T>
T ValueOrExit(StatusOr<T> v, const char* program, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s: %s\n", program, what, v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(v).value();
}

// The upper median (the middle element after sorting). REQUIRES: non-empty.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace strata::bench
