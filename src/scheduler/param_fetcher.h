// src/scheduler/param_fetcher.h — parameters onto the device ahead of use.
//
// Per module (offload_param cpu/nvme) a residency state machine:
//   absent → reading (NVMe → pinned staging) → copying (H2D in flight, the
//   module's `ready` event recorded) → resident,
// device buffers taken from a slot pool laid out once by the plan (evicting
// cached modules whose next use is furthest away when every slot is taken), prefetch of the modules
// the recorded trace says come next (within stage3_prefetch_bucket_size and
// stage3_max_live_parameters; a positive limit counts as at least the two
// largest offloaded modules, the one in use and the next, as the plan
// reserves slots for), release after use unless reused soon
// (stage3_max_reuse_distance), and frees deferred until the device has passed
// the last use. It also hands out the modules' gradient buffers.
//
// Device memory by purpose, fixed at Init: one block for the persistent
// modules (each at its own offset, filled on first use and kept), and one
// block cut into `device_slots` slots of the largest module's size for the
// other modules' copies and every gradient buffer. Nothing the fetcher
// allocates afterwards comes from the arena, so a plan that fits cannot fail
// later because the arena is fragmented: a fetch waits for or evicts a slot
// instead. (Workspaces of the framework come from the rest of the arena.)
//
// While an optimizer step runs (not delayed), a module it has finished is
// copied from the step's copy-out target (its new values) instead of its
// host/NVMe copy, and a prefetch stops at the first module the step has not
// reached: the StepGate says which.
//
// Threading: the engine's (main) thread only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/fetch_trace.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_stats.h"
#include "strata/engine.h"

namespace strata::scheduler {

// What the fetcher needs to know of an optimizer step in flight.
class StepGate {
 public:
  virtual ~StepGate() = default;
  // A step is running whose new parameters the next fetches must read.
  virtual bool reading_next_params() const = 0;
  // That step has finished module m (its new parameters are final).
  virtual bool module_ready(int m) const = 0;
};

struct FetchOptions {
  int64_t prefetch_bucket_elems = 0;  // stage3_prefetch_bucket_size
  int64_t max_live_elems = 0;         // stage3_max_live_parameters (floor: see above)
  int64_t max_reuse_distance = 0;     // stage3_max_reuse_distance (elements)
  // Device slots (TierPlan::device_slots); 0: as many as the arena's largest
  // free block holds, at least 2.
  int64_t device_slots = 0;
};

// Fixed-size pieces of one device block, handed out and returned without
// touching the arena. Main thread only; must outlive its handles.
class SlotPool {
 public:
  class Handle {
   public:
    Handle() = default;
    Handle(Handle&& o) noexcept { *this = std::move(o); }
    Handle& operator=(Handle&& o) noexcept;
    ~Handle() { Reset(); }
    uint8_t* data() const { return ptr_; }
    explicit operator bool() const { return ptr_ != nullptr; }
    void Reset();

   private:
    friend class SlotPool;
    SlotPool* pool_ = nullptr;
    int index_ = -1;
    uint8_t* ptr_ = nullptr;
  };

  // One arena block of count x slot_bytes (slot_bytes rounded up to the
  // device alignment).
  Status Init(gpu::Device* device, int64_t slot_bytes, int64_t count);
  // A free slot, or ResourceExhausted naming how many there are.
  StatusOr<Handle> Acquire();
  int64_t free_count() const { return static_cast<int64_t>(free_.size()); }
  int64_t count() const { return count_; }
  int64_t slot_bytes() const { return slot_bytes_; }

 private:
  gpu::DeviceBuffer block_;
  int64_t slot_bytes_ = 0;
  int64_t count_ = 0;
  std::vector<int> free_;
};

enum class Residency { kAbsent, kReading, kCopying, kResident };

class ParamFetcher {
 public:
  ParamFetcher(gpu::Device* device, const Layout* layout, StateStore* store, StepCounters* counters,
               const StepGate* gate, FetchOptions options);
  ~ParamFetcher();  // waits for NVMe reads in flight

  // Creates the modules' events, the fetch trace, the persistent block and
  // the slot pool.
  Status Init();
  FetchTrace& trace() { return *trace_; }
  bool params_offloaded() const { return store_->param_place() != OffloadDevice::kNone; }

  // Advances NVMe reads that have completed into their H2D copies.
  Status Pump();
  // Makes module m's parameters usable by work on the compute stream (on the
  // host device: by the caller, now), fetching on demand.
  Status WaitResident(int m);
  void MarkInUse(int m) { slots_[static_cast<size_t>(m)].in_use = true; }
  // Starts fetching the modules the trace expects next, within the budgets.
  Status Prefetch();
  // The framework is done with module m: release its device copy unless it
  // is reused soon.
  Status FinishUse(int m);
  // Drops every device copy (the parameters changed), after the device is idle.
  Status InvalidateAll();

  // Device pointers of module m's parameters (and gradient buffers).
  ModuleView View(int m, bool with_grads);
  // Module m's gradient buffer (same layout as its parameters).
  Status AllocateGrad(int m);
  bool has_grad(int m) const { return static_cast<bool>(slots_[static_cast<size_t>(m)].grad); }
  bool any_grad() const;
  const void* grad(int m) const { return slots_[static_cast<size_t>(m)].grad.data(); }
  int64_t free_device_slots() const { return pool_.free_count(); }
  int64_t device_slots() const { return pool_.count(); }
  gpu::Event& computed(int m) { return *slots_[static_cast<size_t>(m)].computed; }
  // Recorded after the last copy of module m's parameters to the device.
  gpu::Event& ready(int m) { return *slots_[static_cast<size_t>(m)].ready; }
  // Frees module m's gradient buffer once the D2H stream (or `stream`) has
  // passed this point.
  Status ReleaseGradAfterD2H(int m) { return ReleaseGradAfter(m, dev_->d2h()); }
  Status ReleaseGradAfter(int m, gpu::Stream& stream);

  // A device slot, evicting cached modules (not `keep_module`) and waiting
  // for deferred frees when none is free.
  StatusOr<SlotPool::Handle> AcquireSlot(int keep_module);
  // Frees deferred buffers whose last use has completed (all: waiting).
  Status ReclaimDeferred(bool wait_all);

  Residency residency(int m) const { return slots_[static_cast<size_t>(m)].residency; }

 private:
  struct Slot {
    Residency residency = Residency::kAbsent;
    uint8_t* data = nullptr;  // the device copy: in `slot`, or in the persistent block
    SlotPool::Handle slot;
    std::unique_ptr<gpu::Event> ready;
    // Recorded on the compute stream when the module's gradients are
    // complete; the D2H stream waits on it.
    std::unique_ptr<gpu::Event> computed;
    gpu::PinnedBuffer staging;
    nvme::IoHandle read;
    int64_t read_issued_ns = 0;
    bool in_use = false;
    bool prefetched = false;  // fetch started by a prefetch, not by demand
    SlotPool::Handle grad;
  };
  struct DeferredFree {
    SlotPool::Handle buf;
    std::unique_ptr<gpu::Event> after;
  };
  // A staging buffer an H2D copy still reads (returned when `after` is done:
  // polled, never from a host function on the stream).
  struct StagingInFlight {
    gpu::PinnedBuffer buf;
    std::unique_ptr<gpu::Event> after;
  };
  Status ReclaimStaging(bool wait_all);

  Status Fetch(int m, bool prefetch);
  Status StartCopy(int m);
  Status MakeRoom(int keep_module);
  void Release(int m);
  int64_t live_elems() const;

  gpu::Device* dev_;
  const Layout* layout_;
  StateStore* store_;
  StepCounters* counters_;
  const StepGate* gate_;
  FetchOptions opts_;
  int64_t max_live_elems_ = 0;  // opts_.max_live_elems with its floor (Init)
  // Declared before what holds its handles (destroyed after them).
  SlotPool pool_;
  gpu::DeviceBuffer persistent_;
  std::vector<int64_t> persistent_offset_;  // per module, -1: not persistent
  std::vector<Slot> slots_;
  std::unique_ptr<FetchTrace> trace_;
  std::vector<DeferredFree> deferred_;
  std::vector<StagingInFlight> staging_in_flight_;
};

}  // namespace strata::scheduler
