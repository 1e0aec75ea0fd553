#include "src/scheduler/param_fetcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>

#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/common/units.h"
#include "src/scheduler/fetch_trace.h"

namespace strata::scheduler {

// ---- SlotPool ------------------------------------------------------------------

SlotPool::Handle& SlotPool::Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = o.pool_;
    index_ = o.index_;
    ptr_ = o.ptr_;
    o.pool_ = nullptr;
    o.index_ = -1;
    o.ptr_ = nullptr;
  }
  return *this;
}

void SlotPool::Handle::Reset() {
  if (pool_ != nullptr) pool_->free_.push_back(index_);
  pool_ = nullptr;
  index_ = -1;
  ptr_ = nullptr;
}

Status SlotPool::Init(gpu::Device* device, int64_t slot_bytes, int64_t count) {
  const auto align = static_cast<int64_t>(gpu::kDeviceAlignment);
  slot_bytes_ = std::max<int64_t>(align, (slot_bytes + align - 1) / align * align);
  count_ = count;
  ASSIGN_OR_RETURN(block_, device->Allocate(static_cast<size_t>(slot_bytes_ * count_)));
  free_.clear();
  for (int64_t i = count_ - 1; i >= 0; --i) free_.push_back(static_cast<int>(i));
  return Status();
}

StatusOr<SlotPool::Handle> SlotPool::Acquire() {
  if (free_.empty())
    return ResourceExhaustedError(
        fmt::format("all {} device slots of {} are in use", count_, FormatBytes(slot_bytes_)));
  Handle h;
  h.pool_ = this;
  h.index_ = free_.back();
  h.ptr_ = block_.as<uint8_t>() + static_cast<int64_t>(h.index_) * slot_bytes_;
  free_.pop_back();
  return h;
}

// ---- ParamFetcher --------------------------------------------------------------

ParamFetcher::ParamFetcher(gpu::Device* device, const Layout* layout, StateStore* store,
                           ParamGatherer* gatherer, StepCounters* counters, StepProgress* progress,
                           FetchOptions options)
    : dev_(device),
      layout_(layout),
      store_(store),
      gatherer_(gatherer),
      counters_(counters),
      progress_(progress),
      opts_(options),
      slots_(static_cast<size_t>(layout->num_modules())) {}

ParamFetcher::~ParamFetcher() {
  for (Slot& s : slots_)
    if (s.read.valid()) s.read.Wait().IgnoreError();
  DropGathers();
}

Status ParamFetcher::Init() {
  if (partitioned() && gatherer_ == nullptr)
    return FailedPreconditionError("ParamFetcher: partitioned parameters without a gatherer");
  std::vector<int64_t> module_elems;
  for (Slot& s : slots_) {
    ASSIGN_OR_RETURN(s.ready, dev_->CreateEvent());
    ASSIGN_OR_RETURN(s.computed, dev_->CreateEvent());
  }
  for (const ModuleExtent& m : layout_->modules()) module_elems.push_back(m.elems());
  trace_ = std::make_unique<FetchTrace>(std::move(module_elems));
  // As the plan (ComputeTierPlan) reserves slots for: a positive live limit
  // counts as at least the two largest offloaded modules (one in use and the
  // next); below that no fetch could overlap a module's compute. 0 keeps
  // DeepSpeed's meaning: nothing is prefetched.
  int64_t largest = 0, second = 0;
  for (const ModuleExtent& me : layout_->modules()) {
    if (me.persistent) continue;
    if (me.elems() > largest) {
      second = largest;
      largest = me.elems();
    } else if (me.elems() > second) {
      second = me.elems();
    }
  }
  max_live_elems_ =
      opts_.max_live_elems == 0 ? 0 : std::max(opts_.max_live_elems, largest + second);
  // The persistent modules' block: each at its own offset.
  const auto align = static_cast<int64_t>(gpu::kDeviceAlignment);
  int64_t persistent = 0;
  persistent_offset_.assign(static_cast<size_t>(layout_->num_modules()), -1);
  if (params_offloaded()) {
    for (int m = 0; m < layout_->num_modules(); ++m) {
      const ModuleExtent& me = layout_->module(m);
      if (!me.persistent || me.bytes() == 0) continue;
      persistent_offset_[static_cast<size_t>(m)] = persistent;
      persistent += (me.bytes() + align - 1) / align * align;
    }
  }
  if (persistent > 0) {
    ASSIGN_OR_RETURN(persistent_, dev_->Allocate(static_cast<size_t>(persistent)));
  }
  // Partitioned in device memory: the buffers of the gathers ahead (before
  // the slots, which may take the rest of the arena).
  if (store_->gathers_on_device()) {
    const int64_t buffers = store_->param_buffers() - 1;
    for (int64_t b = 0; b < buffers; ++b) {
      DeviceGatherBuffer d;
      StatusOr<gpu::DeviceBuffer> buf = dev_->Allocate(
          static_cast<size_t>(std::max<int64_t>(layout_->max_module_bytes(), align)));
      if (!buf.ok())
        return buf.status().WithContext(fmt::format(
            "device buffers for gathering modules ahead (offload_param.buffer_count - 1 = {})",
            buffers));
      d.buf = std::move(*buf);
      ASSIGN_OR_RETURN(d.read, dev_->CreateEvent());
      device_gather_.push_back(std::move(d));
      device_gather_free_.push_back(static_cast<int>(b));
    }
  }
  // The slots: what the plan says, or what the arena holds.
  const int64_t slot_bytes = std::max<int64_t>(layout_->max_module_bytes(), align);
  int64_t count = opts_.device_slots;
  if (count <= 0)
    count = std::max<int64_t>(2, static_cast<int64_t>(dev_->Stats().largest_free_bytes) /
                                     ((slot_bytes + align - 1) / align * align));
  return pool_.Init(dev_, slot_bytes, count)
      .WithContext(fmt::format("device slots for parameters and gradients ({} x {})", count,
                               FormatBytes(slot_bytes)));
}

int64_t ParamFetcher::live_elems() const {
  int64_t live = 0;
  for (int m = 0; m < layout_->num_modules(); ++m)
    if (!layout_->module(m).persistent &&
        slots_[static_cast<size_t>(m)].residency != Residency::kAbsent)
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

void ParamFetcher::DropCopy(int m) {
  Slot& s = slots_[static_cast<size_t>(m)];
  // The device copy may still be read by work on the compute stream.
  auto ev = dev_->CreateEvent();
  if (ev.ok() && dev_->compute().Record(**ev).ok()) {
    deferred_.push_back({std::move(s.slot), std::move(*ev)});
  } else {
    dev_->compute().Synchronize().IgnoreError();
    s.slot.Reset();
  }
  s.data = nullptr;
  s.residency = Residency::kAbsent;
  s.prefetched = false;
}

Status ParamFetcher::MakeRoom(int keep_module) {
  // Slots held by finished work come back first; then cached (resident, not
  // in use, not persistent) modules are evicted, those whose next use is
  // furthest first (here: the ones not in the lookahead); then fetches in
  // flight that nothing uses yet (prefetches the order did not need now, in
  // the same order), completed first: their copies still write the slot.
  RETURN_IF_ERROR(ReclaimDeferred(false));
  if (pool_.free_count() > 0) return Status();
  if (!deferred_.empty()) {
    RETURN_IF_ERROR(ReclaimDeferred(true));
    if (pool_.free_count() > 0) return Status();
  }
  std::vector<int> upcoming = trace_ ? trace_->Lookahead(INT64_MAX) : std::vector<int>{};
  auto rank = [&](int m) {
    auto it = std::find(upcoming.begin(), upcoming.end(), m);
    return it == upcoming.end() ? INT32_MAX : static_cast<int>(it - upcoming.begin());
  };
  std::vector<int> cached, in_flight;
  for (int i = 0; i < layout_->num_modules(); ++i) {
    const Slot& s = slots_[static_cast<size_t>(i)];
    if (i == keep_module || layout_->module(i).persistent || s.in_use || !s.slot) continue;
    if (s.residency == Residency::kResident) cached.push_back(i);
    if (s.residency == Residency::kReading || s.residency == Residency::kCopying)
      in_flight.push_back(i);
  }
  auto furthest_first = [&](int a, int b) { return rank(a) > rank(b); };
  std::sort(cached.begin(), cached.end(), furthest_first);
  std::sort(in_flight.begin(), in_flight.end(), furthest_first);
  for (int i : cached) {
    DropCopy(i);
    RETURN_IF_ERROR(ReclaimDeferred(true));
    if (pool_.free_count() > 0) return Status();
  }
  for (int i : in_flight) {
    RETURN_IF_ERROR(CompleteFetch(i, /*host_waits=*/true));  // its slot is reused next
    if (slots_[static_cast<size_t>(i)].residency == Residency::kResident) DropCopy(i);
    RETURN_IF_ERROR(ReclaimDeferred(true));
    if (pool_.free_count() > 0) return Status();
  }
  return ReclaimDeferred(true);
}

Status ParamFetcher::CompleteFetch(int m, bool host_waits) {
  Slot& s = slots_[static_cast<size_t>(m)];
  if (s.residency == Residency::kReading) {
    s.read.Wait().IgnoreError();  // the status is taken by Pump
    RETURN_IF_ERROR(Pump());
  }
  if (s.residency == Residency::kCopying) {
    RETURN_IF_ERROR(host_waits ? s.ready->Synchronize() : dev_->OrderComputeAfter(*s.ready));
    s.residency = Residency::kResident;
  }
  return Status();
}

StatusOr<SlotPool::Handle> ParamFetcher::AcquireSlot(int keep_module) {
  if (pool_.free_count() == 0) RETURN_IF_ERROR(MakeRoom(keep_module));
  StatusOr<SlotPool::Handle> h = pool_.Acquire();
  if (!h.ok()) {
    int in_use = 0, in_flight = 0;
    for (const Slot& s : slots_) {
      in_use += s.in_use || static_cast<bool>(s.grad);
      in_flight += s.residency == Residency::kReading || s.residency == Residency::kCopying;
    }
    return Status(h.status())
        .WithContext(fmt::format(
            "module {}: {} module(s) in use or holding gradients, {} being fetched; raise "
            "strata.hbm_budget or lower stage3_max_live_parameters",
            keep_module, in_use, in_flight));
  }
  return h;
}

Status ParamFetcher::StartCopy(int m) {
  Slot& s = slots_[static_cast<size_t>(m)];
  const bool updated = progress_->reading_next_params();
  const void* src = store_->FetchSource(m, updated);
  if (src == nullptr) src = s.staging.data();
  const int64_t bytes = layout_->module(m).bytes();
  RETURN_IF_ERROR(counters_->TimedCopy(
      dev_->h2d(), Link::kH2D, fmt::format("fetch module {}", m), bytes,
      [&] { return dev_->CopyH2D(s.data, src, static_cast<size_t>(bytes), dev_->h2d()); }));
  RETURN_IF_ERROR(dev_->h2d().Record(*s.ready));
  if (s.staging) {
    // The staging buffer goes back to the pool once the copy has read it.
    StagingInFlight f;
    ASSIGN_OR_RETURN(f.after, dev_->CreateEvent());
    RETURN_IF_ERROR(dev_->h2d().Record(*f.after));
    f.buf = std::move(s.staging);
    staging_in_flight_.push_back(std::move(f));
  }
  s.residency = Residency::kCopying;
  return Status();
}

Status ParamFetcher::ReclaimStaging(bool wait_all) {
  for (auto it = staging_in_flight_.begin(); it != staging_in_flight_.end();) {
    bool done = wait_all;
    if (wait_all) {
      RETURN_IF_ERROR(it->after->Synchronize());
    } else {
      ASSIGN_OR_RETURN(done, it->after->Query());
    }
    it = done ? staging_in_flight_.erase(it) : it + 1;
  }
  return Status();
}

Status ParamFetcher::Pump() {
  RETURN_IF_ERROR(ReclaimStaging(false));
  for (int i = 0; i < layout_->num_modules(); ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    if (s.residency != Residency::kReading || !s.read.Poll()) continue;
    Status st = s.read.status();
    counters_->NoteNvme(s.read_issued_ns, NowNanos(), IoBytes(layout_->module(i).bytes()), false,
                        fmt::format("read module {}", i));
    s.read = nvme::IoHandle();
    if (!st.ok()) {
      s.staging.Reset();
      s.slot.Reset();
      s.data = nullptr;
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
  const int64_t persistent_at = persistent_offset_[static_cast<size_t>(m)];
  if (persistent_at >= 0) {
    s.data = persistent_.as<uint8_t>() + persistent_at;  // its own place, kept
  } else if (prefetch) {
    // A prefetch never evicts and never waits: it uses what is free.
    if (pool_.free_count() == 0) return Status();
    ASSIGN_OR_RETURN(s.slot, pool_.Acquire());
    s.data = s.slot.data();
  } else {
    ASSIGN_OR_RETURN(s.slot, AcquireSlot(m));
    s.data = s.slot.data();
  }
  s.prefetched = prefetch;
  if (partitioned()) {
    Status gathered = FetchGathered(m);
    if (!gathered.ok()) {
      s.staging.Reset();
      s.slot.Reset();
      s.data = nullptr;
      s.residency = Residency::kAbsent;
      return gathered.WithContext(fmt::format("fetching module {} from the ranks", m));
    }
    return Status();
  }
  if (store_->param_place() == OffloadDevice::kCpu) return StartCopy(m);
  if (progress_->reading_next_params()) {
    // The step's write-back buffer of the module, when it still holds it: no
    // NVMe read (the buffer returns to its pool after the copy).
    s.staging = progress_->TakeUpdatedModule(m);
    if (s.staging) {
      counters_->CountUpdatedHandover();
      return StartCopy(m);
    }
  }
  // NVMe → pinned staging → HBM.
  gpu::PinnedPool* pool = store_->param_pool();
  StatusOr<gpu::PinnedBuffer> staging = pool->Acquire(static_cast<size_t>(IoBytes(bytes)));
  while (!staging.ok() && staging.status().code() == StatusCode::kResourceExhausted) {
    if (prefetch) {
      s.slot.Reset();
      s.data = nullptr;
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
    RETURN_IF_ERROR(ReclaimStaging(true));  // staging returns after its H2D
    staging = pool->Acquire(static_cast<size_t>(IoBytes(bytes)));
    if (!waited && !staging.ok()) break;
  }
  if (!staging.ok()) {
    s.slot.Reset();
    s.data = nullptr;
    return staging.status().WithContext(fmt::format("fetching module {}", m));
  }
  s.staging = std::move(*staging);
  s.read_issued_ns = NowNanos();
  // A step in flight that has written the module (ModuleReady): its new
  // version.
  s.read = store_->ReadModule(m, s.staging.data(), progress_->reading_next_params());
  s.residency = Residency::kReading;
  return Status();
}

Status ParamFetcher::FetchGathered(int m) {
  Slot& s = slots_[static_cast<size_t>(m)];
  const int64_t bytes = layout_->module(m).bytes();
  auto ahead = gathered_.find(m);
  if (store_->gathers_on_device()) {
    if (ahead == gathered_.end()) {
      // Straight into the module's device copy (the gather waits).
      RETURN_IF_ERROR(GatherNow(m, s.data, /*updated=*/false));
      s.residency = Residency::kResident;
      return Status();
    }
    // Gathered ahead into a device buffer: copied into the module's copy on
    // the copy stream, which the compute stream then waits for.
    const int b = ahead->second.device_buf;
    Status waited = gatherer_->WaitGathered(*ahead->second.done);
    gathered_.erase(ahead);
    if (waited.ok())
      waited = dev_->CopyD2D(s.data, device_gather_[static_cast<size_t>(b)].buf.data(),
                             static_cast<size_t>(bytes), dev_->h2d());
    if (waited.ok()) waited = dev_->h2d().Record(*s.ready);
    if (waited.ok()) waited = ReleaseDeviceBuffer(b, /*after_copy=*/true);
    RETURN_IF_ERROR(waited);
    s.residency = Residency::kCopying;
    return Status();
  }
  // In host memory: gathered ahead into a pinned buffer (PrefetchGathers)
  // or now (a collective, in the program's order); then copied as a read.
  if (ahead != gathered_.end()) {
    s.staging = std::move(ahead->second.buf);
    Status waited = gatherer_->WaitGathered(*ahead->second.done);
    gathered_.erase(ahead);
    RETURN_IF_ERROR(waited);
  } else {
    ASSIGN_OR_RETURN(s.staging, AcquireParamBuffer(bytes));
    // (Acquire waited for the step in flight to finish this rank's piece.)
    RETURN_IF_ERROR(GatherNow(m, s.staging.as<uint8_t>(), progress_->reading_next_params()));
  }
  return StartCopy(m);
}

Status ParamFetcher::GatherNow(int m, uint8_t* dst, bool updated) {
  AlignedBuffer piece;
  ASSIGN_OR_RETURN(const PartBytes mine, store_->PartOf(m, updated, /*to_host=*/false, &piece));
  return gatherer_->GatherModule(m, mine, dst,
                                 store_->gathers_on_device() ? Memory::kDevice : Memory::kHost);
}

Status ParamFetcher::IssueGather(int m, uint8_t* dst, bool updated, gpu::Event* done,
                                 AlignedBuffer* piece) {
  ASSIGN_OR_RETURN(const PartBytes mine, store_->PartOf(m, updated, /*to_host=*/false, piece));
  return gatherer_->IssueGatherModule(
      m, mine, dst, store_->gathers_on_device() ? Memory::kDevice : Memory::kHost, done);
}

StatusOr<int> ParamFetcher::AcquireDeviceBuffer() {
  if (device_gather_free_.empty())
    return FailedPreconditionError("no device buffer free for a gather ahead");
  const int b = device_gather_free_.front();
  device_gather_free_.pop_front();
  DeviceGatherBuffer& d = device_gather_[static_cast<size_t>(b)];
  if (d.read_pending) {
    Status s = d.read->Synchronize();  // the copy out of it has ended
    if (!s.ok()) {
      device_gather_free_.push_front(b);
      return s;
    }
    d.read_pending = false;
  }
  return b;
}

Status ParamFetcher::ReleaseDeviceBuffer(int b, bool after_copy) {
  DeviceGatherBuffer& d = device_gather_[static_cast<size_t>(b)];
  if (after_copy) RETURN_IF_ERROR(dev_->h2d().Record(*d.read));
  d.read_pending = after_copy;
  device_gather_free_.push_back(b);  // the one read longest ago is reused first
  return Status();
}

Status ParamFetcher::WaitResident(int m) {
  if (!params_offloaded()) {
    if (gpu::Event* uploaded = store_->params_uploaded())
      RETURN_IF_ERROR(dev_->OrderComputeAfter(*uploaded));
    return Status();
  }
  Slot& s = slots_[static_cast<size_t>(m)];
  if (s.residency == Residency::kAbsent) {
    if (gathered_.count(m) != 0) {
      counters_->CountPrefetchHit();  // gathered ahead
    } else {
      counters_->CountFetchMiss();
    }
    RETURN_IF_ERROR(Fetch(m, false));
  } else if (s.prefetched) {
    counters_->CountPrefetchHit();
  }
  return CompleteFetch(m, /*host_waits=*/false);
}

StatusOr<gpu::PinnedBuffer> ParamFetcher::AcquireParamBuffer(int64_t bytes) {
  gpu::PinnedPool* pool = store_->param_pool();
  StatusOr<gpu::PinnedBuffer> buf = pool->Acquire(static_cast<size_t>(IoBytes(bytes)));
  if (!buf.ok()) {
    RETURN_IF_ERROR(ReclaimStaging(true));  // staging returns after its H2D
    buf = pool->Acquire(static_cast<size_t>(IoBytes(bytes)));
  }
  return buf;
}

Status ParamFetcher::PrefetchGathers() {
  // At most buffer_count - 1 ahead: a fetch on demand always finds a buffer
  // once the H2D copies in flight have read theirs. (A prefetch into a
  // device slot would depend on which slots are free, which is timing.)
  const int64_t ahead = store_->gathers_on_device() ? static_cast<int64_t>(device_gather_.size())
                                                    : store_->param_buffers() - 1;
  int64_t live = live_elems();
  for (const auto& [m, g] : gathered_)
    if (!layout_->module(m).persistent) live += layout_->module(m).elems();
  for (int next : trace_->Lookahead(opts_.prefetch_bucket_elems)) {
    const ModuleExtent& me = layout_->module(next);
    if (slots_[static_cast<size_t>(next)].residency != Residency::kAbsent ||
        gathered_.count(next) != 0)
      continue;
    if (!me.persistent && live + me.elems() > max_live_elems_) break;
    if (static_cast<int64_t>(gathered_.size()) >= ahead) break;
    // A step in flight (overlap_optimizer) must have finished this rank's
    // piece of the module: waited for, never skipped, so that every rank
    // issues the same gathers whatever its step's progress.
    RETURN_IF_ERROR(progress_->AwaitModule(next));
    Gathered g;
    ASSIGN_OR_RETURN(g.done, dev_->CreateEvent());
    uint8_t* dst = nullptr;
    if (store_->gathers_on_device()) {
      ASSIGN_OR_RETURN(g.device_buf, AcquireDeviceBuffer());
      dst = device_gather_[static_cast<size_t>(g.device_buf)].buf.as<uint8_t>();
    } else {
      ASSIGN_OR_RETURN(g.buf, AcquireParamBuffer(me.bytes()));
      dst = g.buf.as<uint8_t>();
    }
    Status issued =
        IssueGather(next, dst, progress_->reading_next_params(), g.done.get(), &g.piece);
    if (!issued.ok()) {
      if (g.device_buf >= 0) ReleaseDeviceBuffer(g.device_buf, false).IgnoreError();
      return issued.WithContext(fmt::format("gathering module {} ahead", next));
    }
    gathered_.emplace(next, std::move(g));
    live += me.persistent ? 0 : me.elems();
  }
  return Status();
}

void ParamFetcher::DropGathers() {
  // (Their buffers are written until the gathers end; a failure shows at
  // the next collective.)
  for (auto& [m, g] : gathered_) {
    g.done->Synchronize().IgnoreError();
    if (g.device_buf >= 0) ReleaseDeviceBuffer(g.device_buf, false).IgnoreError();
  }
  gathered_.clear();
}

Status ParamFetcher::Prefetch() {
  if (!params_offloaded() || !trace_->following()) return Status();
  if (partitioned()) return PrefetchGathers();
  int64_t live = live_elems();
  for (int next : trace_->Lookahead(opts_.prefetch_bucket_elems)) {
    const ModuleExtent& me = layout_->module(next);
    Slot& s = slots_[static_cast<size_t>(next)];
    if (s.residency != Residency::kAbsent) continue;
    if (progress_->reading_next_params() && !progress_->module_ready(next))
      break;  // not reached yet
    if (!me.persistent && live + me.elems() > max_live_elems_) break;
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
  DropCopy(m);
  return Status();
}

Status ParamFetcher::InvalidateAll() {
  // Every slot is dropped below. What may still use one: a fetch's H2D copy
  // writing it (its `ready` event, recorded on h2d after the copy) and the
  // framework's work on the compute stream reading a resident copy. Wait for
  // exactly those, not for the whole device (cudaDeviceSynchronize would
  // also wait for the d2h gradient copies, the optimizer's uploads and other
  // libraries' work, every step). Slots in `deferred_` keep their own events.
  DropGathers();  // gathered before the parameters changed
  for (Slot& s : slots_)
    if (s.residency == Residency::kCopying) RETURN_IF_ERROR(s.ready->Synchronize());
  RETURN_IF_ERROR(dev_->compute().Synchronize());
  RETURN_IF_ERROR(ReclaimStaging(true));
  for (Slot& s : slots_) {
    if (s.residency == Residency::kReading) s.read.Wait().IgnoreError();
    s.read = nvme::IoHandle();
    s.staging.Reset();
    s.slot.Reset();
    s.data = nullptr;
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
  uint8_t* base = params_offloaded() ? s.data : store_->device_params() + me.byte_begin;
  for (int id : me.params) {
    const int64_t off = layout_->param(id).byte_off - me.byte_begin;
    v.params.push_back(base + off);
    if (with_grads) v.grads.push_back(s.grad.data() + off);
  }
  return v;
}

// ---- The engine's calls --------------------------------------------------------

StatusOr<ModuleView> ParamFetcher::Acquire(int m, Phase phase) {
  RETURN_IF_ERROR(Pump());
  trace_->Observe(m);
  const int64_t t0 = NowNanos(), waited0 = counters_->optimizer_wait_ns();
  RETURN_IF_ERROR(progress_->AwaitModule(m));
  RETURN_IF_ERROR(WaitResident(m));
  counters_->AddFetchWait((NowNanos() - t0) - (counters_->optimizer_wait_ns() - waited0));
  Slot& s = slots_[static_cast<size_t>(m)];
  s.in_use = true;
  if (phase == Phase::kBackward) {
    ASSIGN_OR_RETURN(s.grad, AcquireSlot(m));
  }
  RETURN_IF_ERROR(Prefetch());
  return View(m, phase == Phase::kBackward);
}

Status ParamFetcher::Release(int m) {
  RETURN_IF_ERROR(FinishUse(m));
  return Pump();
}

Status ParamFetcher::ReleaseGrad(int m, gpu::Stream& read_by) {
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::Event> read, dev_->CreateEvent());
  RETURN_IF_ERROR(read_by.Record(*read));
  deferred_.push_back({std::move(slots_[static_cast<size_t>(m)].grad), std::move(read)});
  RETURN_IF_ERROR(FinishUse(m));
  RETURN_IF_ERROR(ReclaimDeferred(false));
  return Pump();
}

int64_t ParamFetcher::NextStep() {
  DropGathers();  // expected by a trace this step did not follow
  trace_->EndStep();
  const int64_t rerecords = trace_->rerecords();
  trace_->BeginStep();
  return rerecords;
}

}  // namespace strata::scheduler
