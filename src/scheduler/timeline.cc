#include "src/scheduler/timeline.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "src/common/status_util.h"

namespace strata {

void Timeline::Add(const std::string& track, const std::string& name, const char* category,
                   int64_t start_ns, int64_t dur_ns, int64_t bytes) {
  if (!enabled_) return;
  MutexLock lock(&mu_);
  auto [it, inserted] = tracks_.emplace(track, static_cast<int>(tracks_.size()) + 1);
  if (origin_ns_ < 0 || start_ns < origin_ns_) origin_ns_ = start_ns;
  events_.push_back({it->second, name, category, start_ns, std::max<int64_t>(dur_ns, 0), bytes});
}

size_t Timeline::size() const {
  MutexLock lock(&mu_);
  return events_.size();
}

Status Timeline::WriteJson(const std::string& path) const {
  MutexLock lock(&mu_);
  nlohmann::json events = nlohmann::json::array();
  for (const auto& [name, tid] : tracks_) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"name", name}}}});
  }
  for (const Event& e : events_) {
    nlohmann::json j = {{"ph", "X"},
                        {"name", e.name},
                        {"cat", e.category},
                        {"pid", 1},
                        {"tid", e.track},
                        {"ts", static_cast<double>(e.start_ns - origin_ns_) / 1e3},
                        {"dur", static_cast<double>(e.dur_ns) / 1e3}};
    if (e.bytes > 0) j["args"] = {{"bytes", e.bytes}};
    events.push_back(std::move(j));
  }
  const std::string text =
      nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return ErrnoError("timeline: open " + path + " for writing", errno);
  const size_t n = std::fwrite(text.data(), 1, text.size(), f);
  const int close_rc = std::fclose(f);
  if (n != text.size() || close_rc != 0) return ErrnoError("timeline: write " + path, errno);
  return Status();
}

}  // namespace strata
