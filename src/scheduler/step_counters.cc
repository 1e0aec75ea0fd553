#include "src/scheduler/step_counters.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>

#include "src/common/aligned_buffer.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {

Status StepCounters::StartDeviceClock(gpu::Device* device) {
  device_ = device;
  ASSIGN_OR_RETURN(clock_ref_, TimingEvent());
  RETURN_IF_ERROR(device->compute().Record(*clock_ref_));
  RETURN_IF_ERROR(clock_ref_->Synchronize());
  clock_ref_ns_ = NowNanos();
  return Status();
}

StatusOr<std::unique_ptr<gpu::Event>> StepCounters::TimingEvent() {
  if (!free_events_.empty()) {
    std::unique_ptr<gpu::Event> e = std::move(free_events_.back());
    free_events_.pop_back();
    return e;
  }
  gpu::EventOptions o;
  o.timing = true;
  return device_->CreateEvent(o);
}

Status StepCounters::Record(gpu::Stream& stream, std::unique_ptr<gpu::Event>* event) {
  ASSIGN_OR_RETURN(*event, TimingEvent());
  return stream.Record(**event);
}

Status StepCounters::TimedCopy(gpu::Stream& stream, Link link, std::string name, int64_t bytes,
                               const std::function<Status()>& work) {
  if (clock_ref_ == nullptr) {
    RETURN_IF_ERROR(work());
    AddCopyBytes(link, bytes);
    return Status();
  }
  Span span;
  span.kind = link == Link::kH2D ? SpanKind::kH2D : SpanKind::kD2H;
  span.name = std::move(name);
  span.bytes = bytes;
  RETURN_IF_ERROR(Record(stream, &span.start));
  RETURN_IF_ERROR(work());
  RETURN_IF_ERROR(Record(stream, &span.end));
  pending_.push_back(std::move(span));
  AddCopyBytes(link, bytes);
  return Status();
}

Status StepCounters::Collect() {
  if (clock_ref_ == nullptr) return Status();
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Span& sp = pending_[i];
    ASSIGN_OR_RETURN(bool done, sp.end->Query());
    if (!done) {
      if (kept != i) pending_[kept] = std::move(sp);
      ++kept;
      continue;
    }
    ASSIGN_OR_RETURN(double secs, device_->ElapsedSeconds(*sp.start, *sp.end));
    ASSIGN_OR_RETURN(double from_ref, device_->ElapsedSeconds(*clock_ref_, *sp.start));
    const int64_t dur = static_cast<int64_t>(std::max(0.0, secs) * 1e9);
    const int64_t t0 = clock_ref_ns_ + static_cast<int64_t>(from_ref * 1e9);
    switch (sp.kind) {
      case SpanKind::kH2D:
        h2d_busy_ns_ += dur;
        timeline_.Add("pcie h2d", sp.name, "pcie", t0, dur, sp.bytes);
        break;
      case SpanKind::kD2H:
        d2h_busy_ns_ += dur;
        timeline_.Add("pcie d2h", sp.name, "pcie", t0, dur, sp.bytes);
        break;
      case SpanKind::kCompute:
        compute_ns_ += dur;
        timeline_.Add("compute", sp.name, "compute", t0, dur, 0);
        break;
    }
    free_events_.push_back(std::move(sp.start));
    free_events_.push_back(std::move(sp.end));
  }
  pending_.resize(kept);
  return Status();
}

void StepCounters::AddCopyBytes(Link link, int64_t bytes) {
  (link == Link::kH2D ? h2d_bytes_ : d2h_bytes_) += bytes;
}

void StepCounters::NoteNvme(int64_t start_ns, int64_t end_ns, int64_t bytes, bool write,
                            const std::string& name) {
  AddNvmeInterval(start_ns, end_ns);
  (write ? nvme_written_bytes_ : nvme_read_bytes_) += bytes;
  timeline_.Add(write ? "nvme write" : "nvme read", name, "nvme", start_ns, end_ns - start_ns,
                bytes);
}

void StepCounters::AddNvmeInterval(int64_t start_ns, int64_t end_ns) {
  MutexLock lock(&mu_);
  nvme_intervals_.emplace_back(start_ns, end_ns);
}

void StepCounters::HookEntry() {
  if (compute_stream_ != nullptr && clock_ref_ != nullptr) {
    // The framework's work since the last hook exit, on the device.
    if (compute_start_ != nullptr) {
      Span span;
      span.kind = SpanKind::kCompute;
      span.name = "framework";
      span.start = std::move(compute_start_);
      if (Record(*compute_stream_, &span.end).ok()) pending_.push_back(std::move(span));
    }
    return;
  }
  const int64_t now = NowNanos();
  if (last_hook_exit_ns_ >= 0) compute_ns_ += now - last_hook_exit_ns_;
}

void StepCounters::HookExit() {
  if (compute_stream_ != nullptr && clock_ref_ != nullptr) {
    if (!Record(*compute_stream_, &compute_start_).ok()) compute_start_.reset();
    Collect().IgnoreError();
    return;
  }
  last_hook_exit_ns_ = NowNanos();
}

int64_t StepCounters::UnionLength(std::vector<std::pair<int64_t, int64_t>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  int64_t busy = 0, cur_b = -1, cur_e = -1;
  for (auto [b, e] : intervals) {
    if (b > cur_e) {
      if (cur_e > cur_b) busy += cur_e - cur_b;
      cur_b = b;
      cur_e = e;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  if (cur_e > cur_b) busy += cur_e - cur_b;
  return busy;
}

void StepCounters::EndWindow(int64_t now, StepStats* st) {
  Collect().IgnoreError();  // what is still running counts in a later window
  st->step_time_s = static_cast<double>(now - window_start_ns_) * 1e-9;
  st->fetch_wait_s = static_cast<double>(fetch_wait_ns_) * 1e-9;
  st->optimizer_wait_s = static_cast<double>(optimizer_wait_ns_) * 1e-9;
  st->compute_s = static_cast<double>(compute_ns_) * 1e-9;
  st->grad_offload_s =
      static_cast<double>(grad_busy_ns_.exchange(0) + d2h_busy_ns_.exchange(0)) * 1e-9;
  st->optimizer_s = static_cast<double>(optimizer_ns_.exchange(0)) * 1e-9;
  // NVMe busy: the union of the intervals with requests in flight (those of
  // a step still running count in the window they end in).
  std::vector<std::pair<int64_t, int64_t>> intervals;
  {
    MutexLock lock(&mu_);
    intervals.swap(nvme_intervals_);
  }
  st->nvme_busy_s = static_cast<double>(UnionLength(std::move(intervals))) * 1e-9;
  st->pcie_busy_s = static_cast<double>(h2d_busy_ns_.exchange(0)) * 1e-9;
  st->nvme_read_bytes = nvme_read_bytes_.exchange(0);
  st->nvme_written_bytes = nvme_written_bytes_.exchange(0);
  st->pcie_h2d_bytes = h2d_bytes_.exchange(0);
  st->pcie_d2h_bytes = d2h_bytes_.exchange(0);
  st->prefetched_modules = prefetch_hits_;
  st->updated_from_memory = updated_handovers_;
  st->fetch_misses = fetch_misses_;
  const double busiest = std::max(
      {st->compute_s, st->pcie_busy_s + st->grad_offload_s, st->optimizer_s, st->nvme_busy_s});
  st->overlap_efficiency = st->step_time_s > 0 ? std::min(1.0, busiest / st->step_time_s) : 0;
  const int64_t nvme_bytes = st->nvme_read_bytes + st->nvme_written_bytes;
  if (st->nvme_busy_s > 1e-3 && nvme_bytes > 0)
    NoteNvmeRate(static_cast<double>(nvme_bytes) / st->nvme_busy_s * 1e-9);
  st->h2d_gbytes_per_s = h2d_rate_;
  st->d2h_gbytes_per_s = d2h_rate_;
  st->nvme_gbytes_per_s = nvme_rate_;
  st->nvme_read_gbytes_per_s = nvme_read_rate_;
  st->nvme_write_gbytes_per_s = nvme_write_rate_;
  const StepBound bound = BoundOf(*st);
  st->bound_s = bound.seconds;
  st->bound_by = bound.by;
  st->bound_efficiency = st->step_time_s > 0 ? std::min(1.0, bound.seconds / st->step_time_s) : 0;
  compute_ns_ = fetch_wait_ns_ = optimizer_wait_ns_ = 0;
  prefetch_hits_ = fetch_misses_ = updated_handovers_ = 0;
  window_start_ns_ = now;
}

std::string StepStatsJson(const StepStats& s, const std::string& device) {
  nlohmann::json j = {{"step", s.step},
                      {"applied", s.applied},
                      {"overflow", s.overflow},
                      {"lr", s.lr},
                      {"loss_scale", s.loss_scale},
                      {"grad_norm", s.grad_norm},
                      {"clip_coef", s.clip_coef},
                      {"step_time_s", s.step_time_s},
                      {"fetch_wait_s", s.fetch_wait_s},
                      {"compute_s", s.compute_s},
                      {"grad_offload_s", s.grad_offload_s},
                      {"optimizer_s", s.optimizer_s},
                      {"optimizer_wall_s", s.optimizer_wall_s},
                      {"optimizer_wait_s", s.optimizer_wait_s},
                      {"nvme_busy_s", s.nvme_busy_s},
                      {"pcie_busy_s", s.pcie_busy_s},
                      {"nvme_read_bytes", s.nvme_read_bytes},
                      {"nvme_written_bytes", s.nvme_written_bytes},
                      {"pcie_h2d_bytes", s.pcie_h2d_bytes},
                      {"pcie_d2h_bytes", s.pcie_d2h_bytes},
                      {"hbm_high_water_bytes", s.hbm_high_water_bytes},
                      {"pinned_high_water_bytes", s.pinned_high_water_bytes},
                      {"prefetched_modules", s.prefetched_modules},
                      {"updated_from_memory", s.updated_from_memory},
                      {"fetch_misses", s.fetch_misses},
                      {"trace_rerecords", s.trace_rerecords},
                      {"sub_groups_speculated", s.sub_groups_speculated},
                      {"sub_groups_redone", s.sub_groups_redone},
                      {"overlap_efficiency", s.overlap_efficiency},
                      {"h2d_gbytes_per_s", s.h2d_gbytes_per_s},
                      {"d2h_gbytes_per_s", s.d2h_gbytes_per_s},
                      {"nvme_gbytes_per_s", s.nvme_gbytes_per_s},
                      {"nvme_read_gbytes_per_s", s.nvme_read_gbytes_per_s},
                      {"nvme_write_gbytes_per_s", s.nvme_write_gbytes_per_s},
                      {"bound_s", s.bound_s},
                      {"bound_efficiency", s.bound_efficiency},
                      {"bound_by", s.bound_by},
                      {"device", device}};
  if (s.world_size > 1) {
    j["rank"] = s.rank;
    j["world_size"] = s.world_size;
    j["comm_reduced_bytes"] = s.comm_reduced_bytes;
    j["comm_overlapped_bytes"] = s.comm_overlapped_bytes;
    j["comm_gathered_bytes"] = s.comm_gathered_bytes;
    j["comm_s"] = s.comm_s;
    j["comm_busy_s"] = s.comm_busy_s;
    j["comm_ring_bytes"] = s.comm_ring_bytes;
    j["comm_gbytes_per_s"] = s.comm_gbytes_per_s;
  }
  if (!s.group_lrs.empty()) j["group_lrs"] = s.group_lrs;
  return j.dump();
}

}  // namespace strata::scheduler

namespace strata {

StepBound BoundOf(const StepStats& s) {
  StepBound b{s.compute_s, "compute"};
  auto consider = [&](double seconds, const char* by) {
    if (seconds > b.seconds) b = {seconds, by};
  };
  if (s.h2d_gbytes_per_s > 0)
    consider(static_cast<double>(s.pcie_h2d_bytes) / (s.h2d_gbytes_per_s * 1e9), "pcie_h2d");
  if (s.d2h_gbytes_per_s > 0)
    consider(static_cast<double>(s.pcie_d2h_bytes) / (s.d2h_gbytes_per_s * 1e9), "pcie_d2h");
  consider(s.optimizer_s, "cpu_optimizer");
  if (s.nvme_read_gbytes_per_s > 0 && s.nvme_write_gbytes_per_s > 0)
    consider(static_cast<double>(s.nvme_read_bytes) / (s.nvme_read_gbytes_per_s * 1e9) +
                 static_cast<double>(s.nvme_written_bytes) / (s.nvme_write_gbytes_per_s * 1e9),
             "nvme");
  else if (s.nvme_gbytes_per_s > 0)
    consider(
        static_cast<double>(s.nvme_read_bytes + s.nvme_written_bytes) / (s.nvme_gbytes_per_s * 1e9),
        "nvme");
  // Data parallelism: the ring algorithm's bytes at the bus bandwidth
  // measured at Plan (the network, or loopback); unmeasured, the time the
  // step waited for collectives. (Their device busy time, comm_busy_s, also
  // counts the waits for a late peer.)
  if (s.comm_gbytes_per_s > 0)
    consider(s.comm_ring_bytes / (s.comm_gbytes_per_s * 1e9), "network");
  else
    consider(s.comm_s, "network");
  return b;
}

}  // namespace strata
