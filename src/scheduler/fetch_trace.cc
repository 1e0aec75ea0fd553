#include "src/scheduler/fetch_trace.h"

#include <unordered_set>

namespace strata {

void FetchTrace::BeginStep() {
  current_.clear();
  diverged_ = false;
  following_ = !trace_.empty();
}

bool FetchTrace::Observe(int module) {
  const size_t pos = current_.size();
  current_.push_back(module);
  if (!following_) return false;
  if (pos < trace_.size() && trace_[pos] == module) return true;
  following_ = false;  // a different path: stop prefetching, re-record
  diverged_ = true;
  return false;
}

void FetchTrace::EndStep() {
  const bool complete = following_ && current_.size() == trace_.size();
  if (!complete) {
    if (!trace_.empty() && (diverged_ || current_.size() != trace_.size())) ++rerecords_;
    trace_ = current_;
  }
  following_ = false;
}

std::vector<int> FetchTrace::Lookahead(int64_t budget_elems) const {
  std::vector<int> out;
  if (!following_) return out;
  std::unordered_set<int> seen;
  if (!current_.empty()) seen.insert(current_.back());  // in use now, not a prefetch
  int64_t used = 0;
  for (size_t i = current_.size(); i < trace_.size(); ++i) {
    const int m = trace_[i];
    if (!seen.insert(m).second) continue;
    const int64_t e = elems_[static_cast<size_t>(m)];
    if (used + e > budget_elems) break;
    used += e;
    out.push_back(m);
  }
  return out;
}

int64_t FetchTrace::ReuseDistance() const {
  if (!following_ || current_.empty()) return kNever;
  const int m = current_.back();
  int64_t between = 0;
  for (size_t i = current_.size(); i < trace_.size(); ++i) {
    if (trace_[i] == m) return between;
    between += elems_[static_cast<size_t>(trace_[i])];
  }
  return kNever;
}

}  // namespace strata
