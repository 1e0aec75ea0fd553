// A Chrome-trace / Perfetto timeline of what the engine did: every transfer,
// I/O, kernel and optimizer batch as a complete event ("ph":"X") on a named
// track (one per stream or thread). Open the file in ui.perfetto.dev or
// chrome://tracing.
//
// Thread-safe: any thread may add events. Disabled timelines cost one branch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "src/common/thread_annotations.h"
#include "strata/status.h"

namespace strata {

class Timeline {
 public:
  Timeline() = default;
  explicit Timeline(bool enabled) : enabled_(enabled) {}

  bool enabled() const { return enabled_; }
  // An event on `track` from `start_ns` (NowNanos clock) lasting `dur_ns`.
  // `bytes` (if > 0) is shown as an argument.
  void Add(const std::string& track, const std::string& name, const char* category,
           int64_t start_ns, int64_t dur_ns, int64_t bytes = 0) EXCLUDES(mu_);
  size_t size() const EXCLUDES(mu_);
  // Writes {"traceEvents": [...]} with a thread_name entry per track.
  Status WriteJson(const std::string& path) const EXCLUDES(mu_);

 private:
  struct Event {
    int track;
    std::string name;
    const char* category;
    int64_t start_ns, dur_ns, bytes;
  };
  bool enabled_ = false;
  mutable Mutex mu_;
  std::map<std::string, int> tracks_ GUARDED_BY(mu_);
  std::vector<Event> events_ GUARDED_BY(mu_);
  int64_t origin_ns_ GUARDED_BY(mu_) = -1;  // the first event's start
};

}  // namespace strata
