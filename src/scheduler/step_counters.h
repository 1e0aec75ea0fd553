// src/scheduler/step_counters.h — StepCounters, the statistics of a step window (the time
// between two Step() calls): busy times and bytes per link, the union of the
// intervals with NVMe requests in flight, hook timing, fetch hits/misses, and
// the Chrome-trace timeline. EndWindow() turns them into the public
// StepStats and starts the next window.
//
// Device time, not host time: a copy is bracketed by two timing events on
// its stream, and its busy time is the device's elapsed time between them
// (cudaEventElapsedTime on CUDA), collected by polling on the main thread;
// no host function is put on a stream (it would stall the stream until the
// driver's one callback thread ran it). Events are placed on the host clock
// through one reference event synchronized at StartDeviceClock. With a
// framework that computes on the device's compute stream, its busy time is
// measured the same way, between the hooks.
//
// Thread-safety: the Add*/Note* calls may come from any thread (the main
// thread, the gradient worker, the optimizer thread); TimedCopy, the hook,
// window and device-clock calls are the caller's (main) thread only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "src/common/thread_annotations.h"
#include "src/gpu/device.h"
#include "src/scheduler/timeline.h"
#include "strata/engine.h"

namespace strata::scheduler {

enum class Link { kH2D, kD2H };

class StepCounters {
 public:
  explicit StepCounters(bool timeline_enabled) : timeline_(timeline_enabled) {}

  Timeline& timeline() { return timeline_; }
  const Timeline& timeline() const { return timeline_; }

  // Records the reference event that puts device events on the host clock
  // (synchronizes the device's compute stream once). Without it, TimedCopy
  // counts bytes only.
  Status StartDeviceClock(gpu::Device* device);

  // ---- Main thread ----
  // Enqueues `work` (a copy over `link`) on `stream` between two timing
  // events: its device busy time and `bytes` count for the link, and it
  // appears on the timeline as `name`, once Collect() finds it complete.
  Status TimedCopy(gpu::Stream& stream, Link link, std::string name, int64_t bytes,
                   const std::function<Status()>& work);
  // Takes the busy time of every timed span that has completed (never blocks).
  Status Collect();

  // ---- Any thread ----
  void AddCopyBytes(Link link, int64_t bytes);
  // An NVMe request from start_ns to end_ns (NowNanos clock).
  void NoteNvme(int64_t start_ns, int64_t end_ns, int64_t bytes, bool write,
                const std::string& name) EXCLUDES(mu_);
  void AddNvmeInterval(int64_t start_ns, int64_t end_ns) EXCLUDES(mu_);
  void AddNvmeWritten(int64_t bytes) { nvme_written_bytes_ += bytes; }
  void AddGradBusy(int64_t ns) { grad_busy_ns_ += ns; }
  void AddOptimizerBusy(int64_t ns) { optimizer_ns_ += ns; }

  // ---- Main thread ----
  // Hook entry/exit: the time between a hook's exit and the next hook's entry
  // is the framework's compute: host time when the framework computes on the
  // calling thread (the host device), else the device time of the work it
  // enqueued on `compute` in between (timing events at each exit and entry).
  void set_compute_stream(gpu::Stream* compute) { compute_stream_ = compute; }
  void HookEntry();
  void HookExit();
  void AddFetchWait(int64_t ns) { fetch_wait_ns_ += ns; }
  void AddOptimizerWait(int64_t ns) { optimizer_wait_ns_ += ns; }
  int64_t optimizer_wait_ns() const { return optimizer_wait_ns_; }
  void CountPrefetchHit() { ++prefetch_hits_; }
  void CountUpdatedHandover() { ++updated_handovers_; }
  void CountFetchMiss() { ++fetch_misses_; }
  void StartWindow(int64_t now_ns) { window_start_ns_ = now_ns; }
  // The rates of the step bound (StepStats::*_gbytes_per_s): the pinned link
  // rates (rate_probes.h) and a first NVMe rate; later windows raise the
  // NVMe rate to the best they see.
  void SetLinkRates(double h2d_gbytes_per_s, double d2h_gbytes_per_s) {
    h2d_rate_ = h2d_gbytes_per_s;
    d2h_rate_ = d2h_gbytes_per_s;
  }
  void NoteNvmeRate(double gbytes_per_s) { nvme_rate_ = std::max(nvme_rate_, gbytes_per_s); }
  // The disk's sequential rates, measured once (Plan); 0 when not measured.
  double nvme_read_rate() const { return nvme_read_rate_; }
  double nvme_write_rate() const { return nvme_write_rate_; }
  void SetNvmeDiskRates(double read_gbytes_per_s, double write_gbytes_per_s) {
    nvme_read_rate_ = read_gbytes_per_s;
    nvme_write_rate_ = write_gbytes_per_s;
  }

  // Fills the time, byte, fetch, rate and bound fields of *st for the window
  // ending at now_ns (after a Collect()), and starts the next window. overlap_efficiency is
  // max(busy of compute, PCIe + gradient offload, CPU optimizer, NVMe) / step
  // time; the bound is BoundOf(*st).
  void EndWindow(int64_t now_ns, StepStats* st) EXCLUDES(mu_);

  // Total length covered by a set of [begin, end) intervals (overlaps once).
  static int64_t UnionLength(std::vector<std::pair<int64_t, int64_t>> intervals);

 private:
  Timeline timeline_;
  Mutex mu_;
  std::vector<std::pair<int64_t, int64_t>> nvme_intervals_ GUARDED_BY(mu_);
  std::atomic<int64_t> h2d_busy_ns_{0}, d2h_busy_ns_{0}, grad_busy_ns_{0}, optimizer_ns_{0};
  std::atomic<int64_t> h2d_bytes_{0}, d2h_bytes_{0};
  std::atomic<int64_t> nvme_read_bytes_{0}, nvme_written_bytes_{0};
  // Main thread only.
  enum class SpanKind { kH2D, kD2H, kCompute };
  struct Span {
    std::unique_ptr<gpu::Event> start, end;
    SpanKind kind;
    std::string name;
    int64_t bytes = 0;
  };
  StatusOr<std::unique_ptr<gpu::Event>> TimingEvent();
  Status Record(gpu::Stream& stream, std::unique_ptr<gpu::Event>* event);
  gpu::Device* device_ = nullptr;
  std::unique_ptr<gpu::Event> clock_ref_;  // completed at clock_ref_ns_
  int64_t clock_ref_ns_ = 0;
  std::vector<Span> pending_;
  std::vector<std::unique_ptr<gpu::Event>> free_events_;
  gpu::Stream* compute_stream_ = nullptr;
  std::unique_ptr<gpu::Event> compute_start_;  // recorded at the last hook exit
  int64_t window_start_ns_ = 0;
  int64_t last_hook_exit_ns_ = -1;
  int64_t compute_ns_ = 0;
  int64_t fetch_wait_ns_ = 0;
  int64_t optimizer_wait_ns_ = 0;
  int64_t prefetch_hits_ = 0, fetch_misses_ = 0, updated_handovers_ = 0;
  double h2d_rate_ = 0, d2h_rate_ = 0, nvme_rate_ = 0;  // GB/s
  double nvme_read_rate_ = 0, nvme_write_rate_ = 0;     // GB/s, the disk's
};

// The JSON object of Engine::StatsJson.
std::string StepStatsJson(const StepStats& s, const std::string& device);

}  // namespace strata::scheduler
