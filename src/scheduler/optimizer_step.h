// src/scheduler/optimizer_step.h — one optimizer step over every sub-group,
// on its own thread (strata.overlap_optimizer, delayed_param_update) or
// inline, and the read-ahead of the first sub-groups' NVMe states.
//
// Sub-groups are stepped in order. For states in memory each sub-group is one
// StepMany (with the window's sums in HBM, one per chunk of them as they
// arrive: DeviceSums); for states on NVMe a StateRing streams them through the pinned
// optimizer pool, a buffer's piece at a time (StateUnits: whole sub-groups
// unless the pinned budget cut them): read the active version (and, with
// gradients on NVMe, the piece's gradient sums from the GradStore) → CPU
// Adam → write the inactive version, reads running ahead into buffers that
// are free. After
// sub-group g the step zeroes its gradients (or hands them back to the
// GradStore) and publishes its progress, so that the main thread may use the
// new parameters of the modules it completed (ModuleReady / WaitModule)
// before the step has ended.
//
// offload_param nvme: the updated parameters are copied out into the store's
// write-back buffers, one per module (a sub-group's shards are stepped in
// batches when its modules need more buffers than are free), and each module
// is written to its inactive NVMe version as soon as its last element has
// been stepped; the module is ready once that write has landed. Fetches then
// take the buffer it was written from while the step still holds it
// (TakeUpdated), else read the new version from NVMe.
//
// Speculative (strata.speculative_step, docs/design.md "The speculative
// step"): launched at the window's last backward pass, before the global
// checks, the step takes ranges of whole modules from a SpeculationFeed as
// their gradients become final (from the last element down, contiguous)
// and steps each with the hyperparameters of an unclipped, finite window,
// after copying its states into a spare array; it zeroes no gradients and
// publishes nothing. The step launched after the checks then either takes
// those elements as done (StepParams::speculated_from: it steps the rest of
// a sub-group they cut) or, after their states were copied back, steps
// every element again. With the states on NVMe there is no spare: the
// speculative step waits until a whole sub-group has been handed over, reads
// its active version (and with the window's sums on NVMe its sums:
// GradStore::Peek, which leaves them to the window), steps it and writes the
// inactive one, which only the commit makes current; a redo reads the
// untouched active version again. A range is stepped as the
// same per-parameter shards as its sub-groups' (ranges end at parameter boundaries), so the bits do
// not depend on where speculation stopped.
//
// A step never makes its results current: Join() returns a StepOutcome that
// the StateStore commits or the engine rolls back. It reads the layout and
// writes only the store's inactive NVMe versions, next_params() and (states in
// memory) the states themselves.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "src/common/thread_annotations.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/scheduler/device_sums.h"
#include "src/scheduler/fold_mode.h"
#include "src/scheduler/grad_store.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_counters.h"

namespace strata::scheduler {

class ParamWriter;

// Sub-groups handed to a speculative step (the main thread pushes, the
// step's thread takes). Thread-safe.
class SpeculationFeed {
 public:
  struct Item {
    // The elements [elem_begin, elem_end): whole modules, ending where the
    // previous item began (the first at the partition's end).
    int64_t elem_begin = 0, elem_end = 0;
    // Blocks until the sub-group's gradients are in place (its adds and
    // copies have landed); an error stops the speculation.
    std::function<Status()> wait;
    // The window's fold modes (GradOffloader::FoldModes): final for every
    // module of the range.
    std::vector<uint8_t> fold_modes;
  };
  void Push(Item item) EXCLUDES(mu_);
  // The next item, blocking; nullopt once the feed is closed (and, closed
  // with keep_pending, has no items left).
  std::optional<Item> Next() EXCLUDES(mu_);
  // No more items; those not taken yet are dropped unless keep_pending.
  void Close(bool keep_pending = false) EXCLUDES(mu_);

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<Item> items_ GUARDED_BY(mu_);
  bool closed_ GUARDED_BY(mu_) = false;
};

struct StepDeps {
  const Layout* layout = nullptr;
  StateStore* store = nullptr;
  cpu_adam::CpuOptimizer* adam = nullptr;
  StepCounters* counters = nullptr;
  int64_t buffer_count = 4;  // offload_optimizer.buffer_count: the NVMe ring's buffers
  // Gradients on NVMe (TierPlan::grads_on_nvme): where the ring reads each
  // sub-group's sums; StepParams::grads is null then.
  GradStore* grads = nullptr;
  // Gradient sums in HBM (TierPlan::grads_in_hbm; states in memory): each
  // sub-group's sums are copied to the host a chunk at a time as it is
  // stepped (DeviceSums::Stream), which also zeroes them; StepParams::grads
  // is null then.
  DeviceSums* sums = nullptr;
  // Called on the step's thread before it steps sub-group g (tests).
  std::function<void(size_t g)> before_sub_group;
};

// One optimizer pipeline buffer's worth of states on NVMe: piece `piece` of
// sub-group g (Layout::StatePieces; the whole sub-group unless the pinned
// budget cut it).
struct StateUnit {
  size_t g = 0;
  StatePiece piece;
  bool last = true;          // g's last piece
  bool cut = false;          // g has more than one
  std::string Name() const;  // "g", or "g [begin, end)" for a piece
};
// The pieces of sub-groups [g0, g1), in element order.
std::vector<StateUnit> StateUnits(const Layout& layout, size_t g0, size_t g1);

// The first pieces' NVMe states, read while the window's last backward pass
// runs (they do not depend on the gradients): exactly the reads the ring
// would issue first (units 0.., into buffers 0..). Main thread only.
class StateReadAhead {
 public:
  StateReadAhead() = default;
  StateReadAhead(StateReadAhead&&) = default;
  StateReadAhead& operator=(StateReadAhead&&) = default;
  ~StateReadAhead() { WaitAll(); }
  // Starts the reads (as many as the pool gives buffers for, at most
  // max_buffers).
  void Start(const StepDeps& deps, size_t max_buffers = SIZE_MAX);
  bool started() const { return !buffers_.empty(); }
  void WaitAll();

 private:
  friend class StateRing;
  std::vector<gpu::PinnedBuffer> buffers_;
  std::vector<nvme::IoHandle> reads_;
  std::vector<int64_t> issue_ns_;
};

// How many sub-groups ahead of the one being stepped the ring reads, with
// `buffers` buffers: none that holds the sub-group being stepped or the one
// being written behind it (with one buffer: no read-ahead at all).
inline size_t StateLookahead(size_t buffers) { return buffers >= 3 ? buffers - 2 : buffers - 1; }

// offload_param nvme: a module stepped in part, its write-back buffer
// holding the new parameters of the elements stepped so far.
struct OpenModule {
  int module = 0;
  int64_t remaining = 0;  // its elements not stepped yet
  gpu::PinnedBuffer buf;
};

struct StepParams {
  cpu_adam::HyperParams hp;
  // Per optimizer parameter group (ParamRec::group); empty: `hp` for all.
  std::vector<cpu_adam::HyperParams> group_hp;
  int64_t step = 0;         // the optimizer step it computes (1-based)
  bool delayed = false;     // DPU: its parameters are used from the next Step() on
  bool background = false;  // on its own thread (else run inside Launch)
  float* grads = nullptr;   // the accumulator it consumes (zeroed as it goes, unless keep_grads)
  // Fold (GradOffloader::FoldModes): per module how its gradients are read —
  // accumulator only, accumulator + landed, or landed only (its accumulator
  // part is zero and is not rewritten). Empty: the accumulator only.
  std::vector<uint8_t> fold_modes;
  const uint8_t* landing = nullptr;  // the landed gradients, laid out like the parameters
  // The accumulator is not zeroed as it is consumed (GradOffloader::direct():
  // the next window's sums are copied over it).
  bool keep_grads = false;
  // Speculative: the element ranges come from `feed` (one rank). States in
  // memory: each range's states are copied first into `spare` (the states'
  // format, for the elements from spare.first on; the feed gives only
  // ranges inside that). States on NVMe: no spare (null arrays); whole
  // sub-groups are stepped into their inactive versions through the
  // optimizer pipeline's buffers the pool has free.
  SpeculationFeed* feed = nullptr;
  StateArrays spare;
  // The elements from this one on were stepped by a speculative step that
  // is being committed: this step steps only the elements before it, and
  // zeroes the gradients of and publishes every sub-group, in order.
  int64_t speculated_from = INT64_MAX;
  // offload_param nvme: the modules that speculative step wrote to their
  // inactive NVMe versions (ready at once; flipped with the commit), and
  // the module it stepped in part (states on NVMe: whole sub-groups, one of
  // which may cut a module), whose buffer this step completes and writes.
  std::vector<int> speculated_written;
  std::shared_ptr<std::vector<OpenModule>> speculated_open;
};

class OptimizerStep {
 public:
  // Starts the step. `read_ahead` (may be null) hands over its reads. With
  // params.background the step runs on a new thread (ResourceExhausted if
  // none can be created: nothing has changed then); else it has run to its
  // end when Launch returns.
  static StatusOr<std::unique_ptr<OptimizerStep>> Launch(const StepDeps& deps,
                                                         const StepParams& params,
                                                         StateReadAhead* read_ahead);
  ~OptimizerStep();  // joins the thread (the outcome is dropped)
  OptimizerStep(const OptimizerStep&) = delete;
  OptimizerStep& operator=(const OptimizerStep&) = delete;

  const StepParams& params() const { return params_; }
  // Any thread: module m's new parameters can be read: the sub-group holding
  // its last element has been stepped (they are in next_params()), or with
  // offload_param nvme their NVMe write has landed (ReadModule(updated)).
  bool ModuleReady(int m) const;
  // Main thread: the step has ended (*ok: without error).
  bool Finished(bool* ok) const EXCLUDES(mu_);
  // Blocks until ModuleReady(m) or the step has ended; returns ModuleReady(m).
  bool WaitModule(int m) EXCLUDES(mu_);
  // Main thread, offload_param nvme, REQUIRES ModuleReady(m): the write-back
  // buffer module m was written from, if the step still holds it (it keeps
  // written buffers until it needs them for other modules); empty otherwise.
  gpu::PinnedBuffer TakeUpdated(int m);
  // Waits for the end of the step and returns what it did.
  StepOutcome Join();
  // Speculative, after Join: the first element it stepped (its states
  // saved in the spare; NVMe states: the first element of the lowest
  // sub-group written), or the partition's end when none; every element
  // from there to the end was stepped, unless the outcome is an error
  // (offload_param nvme: the modules written are the outcome's
  // param_written).
  int64_t speculated_from() const { return spec_from_; }
  // Speculative, after Join, offload_param nvme: the modules it stepped in
  // part (for StepParams::speculated_open).
  std::vector<OpenModule> TakeOpenModules();

 private:
  OptimizerStep(const StepDeps& deps, const StepParams& params);
  void Run() EXCLUDES(mu_);
  Status StepInMemory();
  Status StepSpeculative();
  // StepSpeculative with the states on NVMe.
  Status StepSpeculativeNvme();
  // offload_param nvme: adds the modules the committed speculative step
  // wrote (StepParams::speculated_written) to the outcome's param_written.
  void AddSpeculatedWritten(StepOutcome* outcome) const;
  // Its writes of updated modules (offload_param nvme) landed; `s` or the
  // first write error.
  Status FinishSpeculative(Status s);
  // The fold mode of a parameter's module (fold_mode.h).
  uint8_t FoldModeOf(int param) const;
  // After sub-group g: zero its gradients, publish progress.
  void GroupDone(size_t g) EXCLUDES(mu_);
  // offload_param nvme: module m's write has landed.
  void ModuleWritten(int m) EXCLUDES(mu_);
  // One ShardStep per parameter slice of the elements [lo, hi), with its
  // states in `states` and its gradients in the accumulator, or at `grads`
  // + (element - lo) when not null. The slice of each in *slices. Copy-out
  // into next_params(), or none yet with offload_param nvme (StepRange
  // sets it).
  std::vector<cpu_adam::ShardStep> ShardsIn(int64_t lo, int64_t hi, const StateArrays& states,
                                            const float* grads,
                                            std::vector<Layout::Slice>* slices) const;
  // Steps sub-group g (ShardsIn, then StepShards; with offload_param nvme in
  // batches through the write-back buffers).
  Status StepGroup(size_t g, const StateArrays& states, const float* grads);
  // The same for the elements [lo, hi) of sub-group g (with offload_param
  // nvme, the modules ending by hi are written).
  Status StepRange(size_t g, int64_t lo, int64_t hi, const StateArrays& states, const float* grads);
  // Steps the shards (timed on the counters and the timeline).
  Status StepShards(size_t g, std::span<const cpu_adam::ShardStep> shards);
  friend class StateRing;
  friend class ParamWriter;

  StepDeps deps_;
  StepParams params_;
  StateReadAhead read_ahead_;
  std::thread thread_;
  StepOutcome outcome_;                 // the step's thread until it has finished, then Join()
  std::atomic<size_t> groups_done_{0};  // sub-groups stepped, in order
  int64_t spec_from_ = INT64_MAX;       // speculative: the step's thread, then Join()
  // offload_param nvme: the write-back, and per module whether its new
  // version has landed.
  std::unique_ptr<ParamWriter> writer_;
  std::unique_ptr<std::atomic<bool>[]> written_;
  mutable Mutex mu_;
  CondVar cv_;
  bool finished_ GUARDED_BY(mu_) = false;
  bool ok_ GUARDED_BY(mu_) = true;
};

}  // namespace strata::scheduler
