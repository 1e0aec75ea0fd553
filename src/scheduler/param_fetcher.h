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
// Stage 3 with partitioned parameters (several ranks): modules come into
// slots as offloaded ones do, and a fetch gathers the module from the ranks
// first. The modules the trace expects next are gathered ahead on the collectives' stream, up to
// offload_param.buffer_count
// - 1 of them and within the same two budgets, into pinned buffers (cpu,
// nvme: this rank's piece read from NVMe first) or device buffers (none);
// the gathered bytes are copied into the module's slot at its fetch. A
// fetch on demand with none gathers straight into the slot.
//
// While an optimizer step runs (not delayed), a module it has finished is
// copied from the step's copy-out target (its new values) instead of its
// host/NVMe copy, and a prefetch stops at the first module the step has not
// reached: the optimizer back-end's StepProgress says which, and waits for
// the part of the step a module needs.
//
// The engine drives it with a few calls per module and phase:
//   Acquire(m, phase)    before the module's forward or backward: its
//                        parameters resident (and a gradient buffer for
//                        backward), the next modules prefetched; its view
//   Release(m)           after its forward
//   ReleaseGrad(m, s)    after its backward, once its gradients were handed
//                        over (the buffer is reused when stream s has read it)
//   InvalidateAll()      the parameters changed: every device copy dropped
//   NextStep()           at the step's end: the recorded order moves on
//
// Threading: the engine's (main) thread only.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/fetch_trace.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_counters.h"
#include "src/scheduler/step_progress.h"
#include "strata/engine.h"

namespace strata::scheduler {

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

enum class Phase { kForward, kBackward };

class ParamFetcher final : public DeviceCopies {
 public:
  // `gatherer`: the ranks' gathers of partitioned parameters (required when
  // store->partition().params_partitioned(), else unused).
  ParamFetcher(gpu::Device* device, const Layout* layout, StateStore* store,
               ParamGatherer* gatherer, StepCounters* counters, StepProgress* progress,
               FetchOptions options);
  ~ParamFetcher() override;  // waits for NVMe reads in flight

  // Creates the modules' events, the fetch trace, the persistent block and
  // the slot pool.
  Status Init();

  // Makes module m's parameters usable by work on the compute stream (on the
  // host device: by the caller, now): the step in flight's new values if it
  // produces them, fetched on demand if no prefetch brought them. kBackward
  // also gives the module a gradient buffer. Then starts fetching the modules
  // the recorded order expects next, within the budgets. The view holds the
  // device pointers of the module's parameters (and gradient buffers).
  StatusOr<ModuleView> Acquire(int m, Phase phase);
  // The framework is done with module m's forward: its device copy is
  // released unless it is reused soon.
  Status Release(int m);
  // Module m's backward is done and its gradients were handed over: the
  // gradient buffer is reused once `read_by` has passed this point, and the
  // device copy is released as by Release.
  Status ReleaseGrad(int m, gpu::Stream& read_by);
  // Drops every device copy (the parameters changed), after the work that
  // uses one is done: fetch copies in flight and the compute stream.
  Status InvalidateAll() override;
  // The step ends: the fetch order it took is recorded or confirmed, and the
  // next step's begins. Returns how often a step's order differed so far.
  int64_t NextStep();

  // Module m's gradient buffer (laid out like its parameters), and the event
  // recorded when its gradients are complete.
  bool has_grad(int m) const { return static_cast<bool>(slots_[static_cast<size_t>(m)].grad); }
  bool any_grad() const;
  const void* grad(int m) const { return slots_[static_cast<size_t>(m)].grad.data(); }
  gpu::Event& computed(int m) { return *slots_[static_cast<size_t>(m)].computed; }

  // Observers (tests, statistics).
  Residency residency(int m) const { return slots_[static_cast<size_t>(m)].residency; }
  int64_t free_device_slots() const { return pool_.free_count(); }
  int64_t device_slots() const { return pool_.count(); }
  const FetchTrace& trace() const { return *trace_; }
  // Frees deferred buffers whose last use has completed (all: waiting).
  Status ReclaimDeferred(bool wait_all);

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

  // Modules come into slots (offload_param cpu or nvme, or partitioned),
  // or live in the store's device block (offload_param none).
  bool params_offloaded() const {
    return store_->param_place() != OffloadDevice::kNone || partitioned();
  }
  bool partitioned() const { return store_->partition().params_partitioned(); }
  // Partitioned: module m gathered from the ranks into dst (device memory
  // when the store gathers_on_device(), else pinned host memory), now; or
  // issued, `done` recorded after it, this rank's part kept in *piece
  // until then.
  Status GatherNow(int m, uint8_t* dst, bool updated);
  Status IssueGather(int m, uint8_t* dst, bool updated, gpu::Event* done, AlignedBuffer* piece);
  // Advances NVMe reads that have completed into their H2D copies.
  Status Pump();
  // Module m resident for work on the compute stream, fetched on demand.
  Status WaitResident(int m);
  // Starts fetching the modules the trace expects next, within the budgets.
  Status Prefetch();
  // Module m's device copy released unless it is reused soon.
  Status FinishUse(int m);
  ModuleView View(int m, bool with_grads);
  // A device slot, evicting cached modules (not `keep_module`) and waiting
  // for deferred frees when none is free.
  StatusOr<SlotPool::Handle> AcquireSlot(int keep_module);
  Status Fetch(int m, bool prefetch);
  // Module m's fetch in flight (its read, then its copy) made resident, or
  // absent after a failed read: the framework's compute is ordered after the
  // copy, or with `host_waits` the caller waits for it (the slot is reused).
  Status CompleteFetch(int m, bool host_waits);
  Status StartCopy(int m);
  // Partitioned parameters: module m's fetch (its slot or persistent place
  // set) from what was gathered ahead for it, or gathered now.
  Status FetchGathered(int m);
  // Stage 3's partitioned parameters: the modules the trace expects next
  // gathered from the ranks ahead of their use, into pinned or device
  // buffers (copied into the module's slot at the fetch).
  Status PrefetchGathers();
  // A pinned buffer of the parameter pool for `bytes` (waiting for staging
  // buffers whose copies are in flight when none is free).
  StatusOr<gpu::PinnedBuffer> AcquireParamBuffer(int64_t bytes);
  // Partitioned in device memory: a device gather buffer (waiting for the
  // copy that last read it), and its return (`after_copy`: once the copy
  // just issued on the copy stream has read it).
  StatusOr<int> AcquireDeviceBuffer();
  Status ReleaseDeviceBuffer(int b, bool after_copy);
  // Waits for the gathers issued ahead and drops them.
  void DropGathers();
  Status MakeRoom(int keep_module);
  void DropCopy(int m);  // the device copy goes once the compute stream is past it
  int64_t live_elems() const;

  gpu::Device* dev_;
  const Layout* layout_;
  StateStore* store_;
  ParamGatherer* gatherer_;
  StepCounters* counters_;
  StepProgress* progress_;
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
  // Modules gathered ahead (PrefetchGathers), by module: the buffer the
  // gather writes and the event recorded after it on the collectives'
  // stream. What is gathered ahead depends only on the trace, the budgets
  // and the modules' residency, which follow the program's calls, never on
  // timing (as free slots do): so every rank issues the same gathers in the
  // same order, as collectives need.
  struct Gathered {
    gpu::PinnedBuffer buf;  // in host memory
    int device_buf = -1;    // or device_gather_[device_buf]
    std::unique_ptr<gpu::Event> done;
    AlignedBuffer piece;  // offload_param nvme: this rank's piece, sent from here
  };
  std::map<int, Gathered> gathered_;
  // Partitioned in device memory (offload_param none): the buffers modules
  // are gathered ahead into, offload_param.buffer_count - 1 of the largest
  // module's bytes, allocated at Init; a module's fetch copies its buffer
  // into its slot.
  struct DeviceGatherBuffer {
    gpu::DeviceBuffer buf;
    std::unique_ptr<gpu::Event> read;  // recorded after the copy out of it
    bool read_pending = false;
  };
  std::vector<DeviceGatherBuffer> device_gather_;
  std::deque<int> device_gather_free_;
};

}  // namespace strata::scheduler
