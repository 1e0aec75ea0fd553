// The order in which a training step fetches modules' parameters, recorded
// on the first step and followed on later ones (ZeRO-3's prefetch trace).
//
// Every fetch (before_forward / before_backward) is Observe()d. While no
// trace is recorded, the step's order becomes the trace at EndStep(). Once one
// is recorded, each fetch is checked against it: a fetch that differs from the
// recorded module at that position (a different path through the model)
// invalidates the trace for the rest of the step — Lookahead() returns nothing,
// so nothing wrong is prefetched — and the step's actual order is recorded
// instead at EndStep(). A step that ends early or runs long re-records too.
//
// Not thread-safe; driven by the engine's calling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace strata {

class FetchTrace {
 public:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  // `module_elems[m]` is the number of parameter elements of module m.
  explicit FetchTrace(std::vector<int64_t> module_elems) : elems_(std::move(module_elems)) {}

  void BeginStep();
  // Records a fetch of `module`. Returns true when it matches the recorded
  // trace (false while recording, or on divergence).
  bool Observe(int module);
  void EndStep();

  // True when a trace exists and this step has followed it so far.
  bool following() const { return following_; }
  const std::vector<int>& trace() const { return trace_; }
  // How many times a step's order differed from the recorded trace.
  int64_t rerecords() const { return rerecords_; }

  // The modules expected after the current fetch, in order, without
  // duplicates and without the current one, until their elements would exceed `budget_elems` (the
  // first one is returned only if it fits). Empty unless following().
  std::vector<int> Lookahead(int64_t budget_elems) const;
  // Elements fetched between the current fetch and the next use of the same
  // module in the trace; kNever if it is not used again this step (or when not
  // following).
  int64_t ReuseDistance() const;

 private:
  std::vector<int64_t> elems_;
  std::vector<int> trace_;    // recorded order of the last complete step
  std::vector<int> current_;  // this step's fetches so far
  bool following_ = false;
  bool diverged_ = false;
  int64_t rerecords_ = 0;
};

}  // namespace strata
