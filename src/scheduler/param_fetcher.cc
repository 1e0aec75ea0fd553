#include "src/scheduler/param_fetcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>

#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {

ParamFetcher::ParamFetcher(gpu::Device* device, const Layout* layout, StateStore* store,
                           StepCounters* counters, const StepGate* gate, FetchOptions options)
    : dev_(device),
      layout_(layout),
      store_(store),
      counters_(counters),
      gate_(gate),
      opts_(options),
      slots_(static_cast<size_t>(layout->num_modules())) {}

ParamFetcher::~ParamFetcher() {
  for (Slot& s : slots_)
    if (s.read.valid()) s.read.Wait().IgnoreError();
}

Status ParamFetcher::Init() {
  std::vector<int64_t> module_elems;
  for (Slot& s : slots_) {
    ASSIGN_OR_RETURN(s.ready, dev_->CreateEvent());
    ASSIGN_OR_RETURN(s.computed, dev_->CreateEvent());
  }
  for (const ModuleExtent& m : layout_->modules()) module_elems.push_back(m.elems());
  trace_ = std::make_unique<FetchTrace>(std::move(module_elems));
  return Status();
}

int64_t ParamFetcher::live_elems() const {
  int64_t live = 0;
  for (int m = 0; m < layout_->num_modules(); ++m)
    if (!layout_->module(m).persistent && slots_[static_cast<size_t>(m)].residency != Residency::kAbsent)
      live += layout_->module(m).elems();
  return live;
}

bool ParamFetcher::any_grad() const {
  for (const Slot& s : slots_)
    if (s.grad) return true;
  return false;
}

Status ParamFetcher::ReclaimDeferred(bool wait_all) {
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    bool done = wait_all;
    if (wait_all) {
      RETURN_IF_ERROR(it->after->Synchronize());
    } else {
      ASSIGN_OR_RETURN(done, it->after->Query());
    }
    it = done ? deferred_.erase(it) : it + 1;
  }
  return Status();
}

void ParamFetcher::Release(int m) {
  Slot& s = slots_[static_cast<size_t>(m)];
  // The device copy may still be read by work on the compute stream.
  auto ev = dev_->CreateEvent();
  if (ev.ok() && dev_->compute().Record(**ev).ok()) {
    deferred_.push_back({std::move(s.buf), std::move(*ev)});
  } else {
    dev_->compute().Synchronize().IgnoreError();
    s.buf.Reset();
  }
  s.residency = Residency::kAbsent;
  s.prefetched = false;
}

Status ParamFetcher::MakeRoom(int64_t bytes, int keep_module) {
  // Evict cached (resident, not in use, not persistent) modules, those whose
  // next use is furthest first (here: the ones not in the lookahead).
  RETURN_IF_ERROR(ReclaimDeferred(false));
  if (static_cast<int64_t>(dev_->Stats().largest_free_bytes) >= bytes) return Status();
  std::vector<int> upcoming = trace_ ? trace_->Lookahead(INT64_MAX) : std::vector<int>{};
  auto rank = [&](int m) {
    auto it = std::find(upcoming.begin(), upcoming.end(), m);
    return it == upcoming.end() ? INT32_MAX : static_cast<int>(it - upcoming.begin());
  };
  std::vector<int> candidates;
  for (int i = 0; i < layout_->num_modules(); ++i) {
    const Slot& s = slots_[static_cast<size_t>(i)];
    if (i != keep_module && !layout_->module(i).persistent && !s.in_use &&
        s.residency == Residency::kResident)
      candidates.push_back(i);
  }
  std::sort(candidates.begin(), candidates.end(), [&](int a, int b) { return rank(a) > rank(b); });
  for (int i : candidates) {
    Release(i);
    RETURN_IF_ERROR(ReclaimDeferred(true));
    if (static_cast<int64_t>(dev_->Stats().largest_free_bytes) >= bytes) return Status();
  }
  return ReclaimDeferred(true);
}

StatusOr<gpu::DeviceBuffer> ParamFetcher::Allocate(int64_t bytes, int keep_module) {
  StatusOr<gpu::DeviceBuffer> b = dev_->Allocate(static_cast<size_t>(bytes));
  if (b.ok() || b.status().code() != StatusCode::kResourceExhausted) return b;
  RETURN_IF_ERROR(MakeRoom(bytes, keep_module));
  return dev_->Allocate(static_cast<size_t>(bytes));
}

Status ParamFetcher::StartCopy(int m) {
  Slot& s = slots_[static_cast<size_t>(m)];
  const bool updated = gate_->reading_next_params();
  const void* src = store_->FetchSource(m, updated);
  if (src == nullptr) src = s.staging.data();
  const int64_t bytes = layout_->module(m).bytes();
  RETURN_IF_ERROR(counters_->TimedCopy(
      dev_->h2d(), Link::kH2D, fmt::format("fetch module {}", m), bytes,
      [&] { return dev_->CopyH2D(s.buf.data(), src, static_cast<size_t>(bytes), dev_->h2d()); }));
  RETURN_IF_ERROR(dev_->h2d().Record(*s.ready));
  if (s.staging) {
    // The staging buffer goes back to the pool once the copy has read it.
    auto held = std::make_shared<gpu::PinnedBuffer>(std::move(s.staging));
    RETURN_IF_ERROR(dev_->h2d().EnqueueHostCallback([held] { held->Reset(); }));
  }
  s.residency = Residency::kCopying;
  return Status();
}

Status ParamFetcher::Pump() {
  for (int i = 0; i < layout_->num_modules(); ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    if (s.residency != Residency::kReading || !s.read.Poll()) continue;
    Status st = s.read.status();
    counters_->NoteNvme(s.read_issued_ns, NowNanos(), IoBytes(layout_->module(i).bytes()), false,
                        fmt::format("read module {}", i));
    s.read = nvme::IoHandle();
    if (!st.ok()) {
      s.staging.Reset();
      s.buf.Reset();
      s.residency = Residency::kAbsent;
      return st.WithContext(fmt::format("fetching module {} from NVMe", i));
    }
    RETURN_IF_ERROR(StartCopy(i));
  }
  return Status();
}

Status ParamFetcher::Fetch(int m, bool prefetch) {
  Slot& s = slots_[static_cast<size_t>(m)];
  if (!params_offloaded() || s.residency != Residency::kAbsent) return Status();
  const int64_t bytes = layout_->module(m).bytes();
  if (prefetch) {
    // A prefetch never evicts and never waits: it uses what is free.
    StatusOr<gpu::DeviceBuffer> b = dev_->Allocate(static_cast<size_t>(bytes));
    if (!b.ok()) return b.status().code() == StatusCode::kResourceExhausted ? Status() : b.status();
    s.buf = std::move(*b);
  } else {
    ASSIGN_OR_RETURN(s.buf, Allocate(bytes, m));
  }
  s.prefetched = prefetch;
  if (store_->param_place() == OffloadDevice::kCpu || gate_->reading_next_params())
    return StartCopy(m);
  // NVMe → pinned staging → HBM.
  gpu::PinnedPool* pool = store_->param_pool();
  StatusOr<gpu::PinnedBuffer> staging = pool->Acquire(static_cast<size_t>(IoBytes(bytes)));
  while (!staging.ok() && staging.status().code() == StatusCode::kResourceExhausted) {
    if (prefetch) {
      s.buf.Reset();
      return Status();
    }
    // Wait for the oldest read in flight to land and free its staging buffer.
    bool waited = false;
    for (Slot& other : slots_) {
      if (other.residency == Residency::kReading) {
        other.read.Wait().IgnoreError();
        waited = true;
        break;
      }
    }
    RETURN_IF_ERROR(Pump());
    RETURN_IF_ERROR(dev_->h2d().Synchronize());  // staging returns after its H2D
    staging = pool->Acquire(static_cast<size_t>(IoBytes(bytes)));
    if (!waited && !staging.ok()) break;
  }
  if (!staging.ok()) {
    s.buf.Reset();
    return staging.status().WithContext(fmt::format("fetching module {}", m));
  }
  s.staging = std::move(*staging);
  s.read_issued_ns = NowNanos();
  s.read = store_->ReadModule(m, s.staging.data());
  s.residency = Residency::kReading;
  return Status();
}

Status ParamFetcher::WaitResident(int m) {
  if (!params_offloaded()) {
    if (gpu::Event* uploaded = store_->params_uploaded()) {
      if (dev_->is_host()) {
        RETURN_IF_ERROR(uploaded->Synchronize());
      } else {
        RETURN_IF_ERROR(dev_->compute().Wait(*uploaded));
      }
    }
    return Status();
  }
  Slot& s = slots_[static_cast<size_t>(m)];
  if (s.residency == Residency::kAbsent) {
    counters_->CountFetchMiss();
    RETURN_IF_ERROR(Fetch(m, false));
  } else if (s.prefetched) {
    counters_->CountPrefetchHit();
  }
  if (s.residency == Residency::kReading) {
    s.read.Wait().IgnoreError();  // the status is taken by Pump
    RETURN_IF_ERROR(Pump());
  }
  if (s.residency == Residency::kCopying) {
    if (dev_->is_host()) {
      RETURN_IF_ERROR(s.ready->Synchronize());  // the framework computes on this thread
    } else {
      RETURN_IF_ERROR(dev_->compute().Wait(*s.ready));
    }
    s.residency = Residency::kResident;
  }
  return Status();
}

Status ParamFetcher::Prefetch() {
  if (!params_offloaded() || !trace_->following()) return Status();
  int64_t live = live_elems();
  for (int next : trace_->Lookahead(opts_.prefetch_bucket_elems)) {
    const ModuleExtent& me = layout_->module(next);
    Slot& s = slots_[static_cast<size_t>(next)];
    if (s.residency != Residency::kAbsent) continue;
    if (gate_->reading_next_params() && !gate_->module_ready(next)) break;  // not reached yet
    if (!me.persistent && live + me.elems() > opts_.max_live_elems) break;
    RETURN_IF_ERROR(Fetch(next, true));
    if (s.residency == Residency::kAbsent) break;  // no room now: stop here
    live += me.persistent ? 0 : me.elems();
  }
  return Status();
}

Status ParamFetcher::FinishUse(int m) {
  Slot& s = slots_[static_cast<size_t>(m)];
  s.in_use = false;
  if (!params_offloaded() || layout_->module(m).persistent) return Status();
  if (trace_->following() && trace_->ReuseDistance() <= opts_.max_reuse_distance) return Status();
  Release(m);
  return Status();
}

Status ParamFetcher::InvalidateAll() {
  RETURN_IF_ERROR(dev_->Synchronize());
  for (Slot& s : slots_) {
    if (s.residency == Residency::kReading) s.read.Wait().IgnoreError();
    s.read = nvme::IoHandle();
    s.staging.Reset();
    s.buf.Reset();
    s.residency = Residency::kAbsent;
    s.prefetched = false;
    s.in_use = false;
  }
  return Status();
}

ModuleView ParamFetcher::View(int m, bool with_grads) {
  Slot& s = slots_[static_cast<size_t>(m)];
  const ModuleExtent& me = layout_->module(m);
  ModuleView v;
  uint8_t* base = params_offloaded() ? s.buf.as<uint8_t>() : store_->device_params() + me.byte_begin;
  for (int id : me.params) {
    const int64_t off = layout_->param(id).byte_off - me.byte_begin;
    v.params.push_back(base + off);
    if (with_grads) v.grads.push_back(s.grad.as<uint8_t>() + off);
  }
  return v;
}

Status ParamFetcher::AllocateGrad(int m) {
  ASSIGN_OR_RETURN(slots_[static_cast<size_t>(m)].grad, Allocate(layout_->module(m).bytes(), m));
  return Status();
}

Status ParamFetcher::ReleaseGradAfterD2H(int m) {
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::Event> copied, dev_->CreateEvent());
  RETURN_IF_ERROR(dev_->d2h().Record(*copied));
  deferred_.push_back({std::move(slots_[static_cast<size_t>(m)].grad), std::move(copied)});
  return Status();
}

}  // namespace strata::scheduler
