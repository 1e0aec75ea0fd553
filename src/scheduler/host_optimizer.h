// src/scheduler/host_optimizer.h — the optimizer back-end on the CPU
// (offload_optimizer cpu or nvme, and none on the host device): gradients go
// into the fp32 accumulator in DRAM (GradOffloader), and the step runs over
// every sub-group on the CPU optimizer (OptimizerStep).
//
// A launched step runs in the background (strata.overlap_optimizer,
// delayed_param_update) or inline. While it runs, the next window's fetches
// read the modules it has finished (StepProgress); the next Step(), or an
// error it reports, joins it: the StateStore commits it, or it is rolled back
// (states and parameters those of the previous step, steps() and the loss
// scaler restored, the window's gradients dropped). With states on NVMe the
// first sub-groups' states are read while the window's last backward pass
// runs (PrepareStep).
//
// Speculation (Options::speculate; docs/design.md, "The speculative step"):
// from the window's last backward pass on, the modules that have handed
// over their last gradients, from the last module down as long as they are
// contiguous, are stepped by a speculative OptimizerStep as soon as those
// gradients have landed, while the earlier modules' backward goes on. Their
// states are copied first into a spare array (the plan's DRAM row), so only
// the modules the spare holds are speculated. Drain stops it after the
// range in progress. Launch keeps what it stepped when the real
// hyperparameters are those it assumed (no clipping, the same loss scale
// and learning rates) and no module's backward ran again after it was
// handed over; else the saved states are copied back and every element is
// stepped again. Either way the bits are those of the step after backward.
//
// Sub-groups stepped on the device (offload_optimizer.ratio below 1:
// Options::device_step_elems, Partition::device_groups): the window's
// gradients of the elements below the split are added into an fp32 array in
// HBM on the compute stream and never reach the host; the global checks add
// their sum of squares to the host part's; Launch starts the CPU step of the
// rest, then runs the device Adam over the first sub-groups on the compute
// stream, writing their parameters into the device block in place (the next
// forward pass is ordered after it), or with offload_param cpu into a
// device buffer copied to the host copy-out array (fetches of those modules
// wait for that copy). Those sub-groups' states are updated in place: a
// launched step is committed even when the CPU part fails.
//
// With the window's sums in HBM (Options::sums_in_hbm) every micro-batch's
// gradients are added into DeviceSums' array on the compute stream; the
// checks and the step read it from there (device_sums.h).
//
// Threading: the engine's (main) thread; the step's and the gradient
// worker's threads are internal.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "src/scheduler/data_parallel.h"
#include "src/scheduler/device_sums.h"
#include "src/scheduler/grad_offloader.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/optimizer_backend.h"
#include "src/scheduler/optimizer_step.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_counters.h"

namespace strata::scheduler {

class HostOptimizer final : public OptimizerBackend {
 public:
  struct Options {
    bool second_accumulator = false;  // delayed_param_update: one per window in flight
    bool fold = false;                // TierPlan::fold_last_micro_batch
    int64_t landing_bytes = 0;        // TierPlan::grad_landing_bytes
    bool pin_landing = false;
    // TierPlan::device_grad_accumulator: the window's gradients are summed
    // in an fp32 array in HBM and each module's sum is offloaded once, at
    // its last micro-batch (the others at Drain).
    bool device_accumulator = false;
    // TierPlan::pin_grad_accumulator: the host accumulator pinned, each
    // module's sum copied straight into it.
    bool pin_accumulator = false;
    // TierPlan::grads_on_nvme: the window's sums in a GradStore on NVMe
    // instead of an all-parameter accumulator in DRAM.
    bool grads_on_nvme = false;
    // TierPlan::grads_in_hbm: the window's sums stay in an fp32 array in HBM
    // (DeviceSums, chunks of sums_chunk_elems, the host buffers pinned when
    // pin_sums); the checks and the step copy them to the host.
    bool sums_in_hbm = false;
    int64_t sums_chunk_elems = 0;
    bool pin_sums = true;
    int64_t buffer_count = 4;  // offload_optimizer.buffer_count
    // Called on the step's thread before it steps sub-group g (tests).
    std::function<void(size_t g)> before_sub_group;
    // Data parallelism: the ranks' collectives (null: one rank).
    // GlobalChecks reduces the ranks' gradients first and combines the
    // checks; the step covers this rank's sub-groups (the store's
    // Partition); unless the parameters are partitioned, Join gathers every
    // rank's updated parameters before the commit.
    DataParallel* dp = nullptr;
    // zero_optimization.overlap_comm with several ranks (and the host
    // accumulator): the window's sums are reduced while the last
    // micro-batch's backward goes on (DataParallel::ReduceFrom). A module's
    // elements count as final once the backward order so far is the previous
    // window's, and that order was strictly descending: every module above
    // has had its last backward. The first window, and a window after one
    // whose order was not descending, reduce at the end. A module whose
    // backward comes again after its sums were reduced fails the step.
    bool overlap_comm = false;
    // strata.speculative_step where the plan applies it (TierPlan::
    // speculation_elems): the spare holds the states of the last
    // `spare_elems` elements.
    bool speculate = false;
    int64_t spare_elems = 0;
    // EngineTestHooks::speculation_steps_all_handed_over.
    bool speculation_steps_all = false;
    // strata.speculative_step auto: after a window whose speculation was
    // rolled back, the next 1, 2, 4, ... 64 windows (doubling while they
    // keep being rolled back, reset by one that is kept) step after
    // backward, so that a run that clips every step pays for a redo only in
    // a few of them.
    bool speculation_backoff = false;
    // TierPlan::device_step_elems: the first elements, whose sub-groups'
    // states are in HBM and stepped by the device Adam (one rank).
    int64_t device_step_elems = 0;
  };
  HostOptimizer(gpu::Device* device, const Layout* layout, cpu_adam::CpuOptimizer* adam,
                StepCounters* counters, LossScaler* scaler, GradientWindow* window,
                Options options);
  ~HostOptimizer() override;  // a step in flight ends uncommitted

  // Starts the gradient path (accumulators, staging pool, worker); adds its
  // page-locked bytes to *pinned_bytes. Before the store opens: the staging
  // buffers are registered with its I/O engine (io_buffers).
  Status Start(int64_t* pinned_bytes);
  std::vector<gpu::PinnedPool::Region> io_buffers() const;
  // The store the steps read and commit into. With gradients on NVMe the
  // GradStore opens here (its shards are the store's).
  Status Bind(StateStore* store);
  void set_device_copies(DeviceCopies* copies) override { copies_ = copies; }

  // StepProgress.
  bool reading_next_params() const override {
    return inflight_ && !inflight_->run->params().delayed;
  }
  bool module_ready(int m) const override {
    return inflight_->run->ModuleReady(m) && SplitParamsLanded(m);
  }
  Status AwaitModule(int m) override;
  gpu::PinnedBuffer TakeUpdatedModule(int m) override {
    return reading_next_params() ? inflight_->run->TakeUpdated(m) : gpu::PinnedBuffer();
  }

  // OptimizerBackend.
  Status AddGradients(int m, const void* device_grad, gpu::Event& computed, bool last) override;
  gpu::Stream& gradients_read_on() override { return dev_->d2h(); }
  Status PrepareStep(const std::function<LaunchParams()>& speculative) override;
  Status CancelSpeculation() override;
  SpeculationCounts TakeSpeculationCounts() override;
  Status Drain() override;
  Status GlobalChecks(bool* overflow, double* sumsq) override;
  Status ZeroGrad() override;
  void DiscardWindow() override;
  Status Launch(const LaunchParams& p) override;
  Status Poll() override;
  Status Join() override;
  Status Abandon() override;
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  // The step in flight and what the main thread keeps beside it.
  struct InFlight {
    std::unique_ptr<OptimizerStep> run;
    LossScaler scaler_before;
    // offload_param none: modules whose new parameters were uploaded into the
    // device block during the step.
    std::vector<uint8_t> uploaded;
    // The sub-groups stepped on the device were (their states moved).
    bool device_stepped = false;
  };
  StepDeps Deps() const;
  // The device accumulator: module m's sum offloaded and its part zeroed
  // (on the D2H stream, after the copies).
  Status OffloadDeviceSum(int m);
  // Later compute-stream work on the device accumulator follows its zeroing.
  Status SettleDeviceSum();
  // The window is dropped: the whole device accumulator zeroed.
  Status ZeroDeviceSum();
  void Rollback(InFlight& job);
  // overlap_comm: module m's gradients of the last micro-batch were queued.
  Status OverlapAfter(int m);
  // The window ends (or is dropped): its order becomes the previous one.
  void EndOverlapWindow(bool keep_order);
  // Speculation: before / after module m's last gradients are handed over;
  // the speculative step stopped (Drain); dropped, its states restored.
  Status StartSpeculation();  // Bind: the spare, the events, the module order
  // The elements from `from` on get their saved states back.
  Status RestoreSpeculated(int64_t from);
  // Sub-groups with elements from `from` on (StepStats' counts).
  int64_t GroupsFrom(int64_t from) const;
  Status SpeculationBefore(int m);
  Status SpeculationAfter(int m);
  Status StopSpeculation();
  Status DropSpeculation();
  // Sub-groups stepped on the device: module m's gradients below the split
  // added into split_sums_ (compute stream); the checks of the split's
  // elements and the host's; the device Adam over them (compute stream),
  // then their sums zeroed; the host accumulator's elements below the split
  // (a module across it handed over whole) zeroed.
  Status AddSplitSums(int m, const void* device_grad);
  Status SplitChecks(bool* overflow, double* sumsq);
  Status StepDeviceGroups(const LaunchParams& lp);
  void ZeroBelowSplit(float* acc);
  // The gradients of the window, handed over (AddGradients less the
  // speculation's part).
  Status HandOver(int m, const void* device_grad, gpu::Event& computed, bool last);

  gpu::Device* dev_;
  const Layout* layout_;
  cpu_adam::CpuOptimizer* adam_;
  StepCounters* counters_;
  LossScaler* scaler_;
  GradientWindow* window_;
  Options opts_;
  StateStore* store_ = nullptr;
  DeviceCopies* copies_ = nullptr;
  std::unique_ptr<GradOffloader> grads_;
  StateReadAhead read_ahead_;
  std::unique_ptr<InFlight> inflight_;
  std::unique_ptr<gpu::Event> upload_ready_;  // offload_param none: AwaitModule's uploads
  // The device accumulator (Options::device_accumulator): the fp32 sums,
  // per module whether it holds a sum not offloaded yet, and the events
  // after the adds and after the last zeroing.
  gpu::DeviceBuffer device_sum_;
  std::unique_ptr<DeviceSums> sums_;  // Options::sums_in_hbm
  // Options::device_step_elems: the split, the sums below it, the sum of
  // squares' slot and the event after the adds.
  int64_t split_ = 0;
  gpu::DeviceBuffer split_sums_, split_sumsq_;
  std::unique_ptr<gpu::Event> split_summed_;
  // offload_param cpu: the device step's copy-out (the parameter bytes
  // below the split), copied into the store's next_params() on the D2H
  // stream; the event after that copy.
  gpu::DeviceBuffer split_params_;
  std::unique_ptr<gpu::Event> split_copied_;
  // offload_param cpu: whether module m's bytes below the split have landed
  // in next_params() (true for a module wholly above it); Await blocks.
  bool SplitParamsLanded(int m) const;
  Status AwaitSplitParams(int m);
  std::vector<uint8_t> sum_pending_;
  std::unique_ptr<gpu::Event> summed_, zeroed_;
  bool zero_in_flight_ = false;
  int64_t steps_ = 0;
  // overlap_comm (main thread): this window's last-micro-batch backward
  // order, the previous window's (when strictly descending), whether this
  // window overlaps, and the elements known final.
  struct Overlap {
    std::vector<int> order, previous;
    bool on = false;
    int64_t final_from = 0;
  } ov_;
  // Speculation (main thread): the spare (master | exp_avg | exp_avg_sq of
  // the elements from spare_first_ on), the modules the spare holds whole
  // in element order (spec_modules_[i] from spec_first_module_ on) with an
  // event each, recorded when a range ending with it is handed over; the
  // window's speculative step, and the counts of the last window for
  // StepStats.
  HostArray spare_;
  int64_t spare_first_ = 0;
  StateArrays spare_states_;  // spare_'s arrays in the states' format
  std::vector<int> spec_modules_;
  size_t spec_first_module_ = 0;
  std::vector<std::unique_ptr<gpu::Event>> spec_events_;
  struct Speculation {
    SpeculationFeed feed;
    std::unique_ptr<OptimizerStep> run;
    cpu_adam::HyperParams hp;
    std::vector<cpu_adam::HyperParams> group_hp;
    std::vector<uint8_t> module_done;  // last gradients handed over
    size_t next_module = 0;            // spec_modules_ from here on are handed over
    int64_t next_elem = 0;             // the elements from here on are handed over
    bool stopped = false;              // the step has been joined
    bool invalid = false;              // handed-over sums changed
    int64_t from = 0;                  // stopped: the first element stepped
    Status status;                     // stopped: the step's
    std::vector<int> written;          // stopped, offload_param nvme: modules written
    std::vector<OpenModule> open;      // stopped, offload_param nvme: stepped in part
  };
  std::unique_ptr<Speculation> spec_;
  SpeculationCounts spec_counts_;
  // Options::speculation_backoff: windows still to run without speculation,
  // and how many the next rollback skips.
  int64_t spec_skip_ = 0, spec_backoff_ = 0;
  // A window ends: whether it speculated, and whether that was kept.
  void NoteSpeculationOutcome(bool speculated, bool kept);
};

}  // namespace strata::scheduler
