// src/scheduler/grad_offloader.h — gradients from the device into the fp32
// accumulator in DRAM.
//
// Offload(m) enqueues module m's gradients, in chunks of the layout's
// grad_staging_bytes, as D2H copies into pinned staging buffers on the D2H
// stream (after the compute stream's `computed` event); a worker thread waits
// for each chunk's copy and adds it to the accumulator (fp16/bf16/fp32 →
// fp32) while the next chunks are still being copied. The adds run through
// the CPU optimizer's vectorized kernels on its pinned worker threads
// (CpuOptimizer::AccumulateMany: one add per element, so the same bits as a
// plain loop for any thread count), chunks in the order they were enqueued,
// so the sums are the same bits for every placement. Drain() waits for every chunk and returns the
// first error. With gradients on NVMe (SetNvmeStore) the adds go into the
// GradStore's cached sub-groups instead of an all-parameter accumulator. The accumulator is also
// where the global inf/nan check and the gradient norm read from (GlobalChecks).
//
// Fold (the plan's TierPlan::fold_last_micro_batch): the window's last
// micro-batch is not accumulated. Land(m) copies module m's gradients whole
// into the landing buffer (laid out like the parameters); the global checks
// and the optimizer read them beside the accumulator, per module as
// FoldModes() says: kFoldAcc (acc + landed, the module was also accumulated
// this window), kFoldZero (only landed: acc is zero there and stays so) or
// kAccOnly (not landed). A module landed twice in one window (a module used
// twice in a micro-batch) has its first gradients added into the accumulator
// before the second land, so the float additions are those of the plain
// path, in its order.
//
// Direct (Start's pin_accumulator, with the window's sums in HBM): the
// accumulator is page-locked and a module's first OffloadFp32 of a window
// copies its sums straight into it, replacing what it held (no staging and
// no adds); a second one in the same window (a module whose backward ran
// again) goes through the staging path and adds. The step does not zero the
// accumulator after reading it (direct()); instead ZeroUnsent, once the
// previous step has ended, zeroes the modules no sums were copied into this
// window.
//
// Checks ahead (set_precompute_checks, one rank, direct): once every module
// overlapping a block of the global checks has been copied in, the worker
// computes that block's sum of squares (NormBlocks: the same bits) while
// the copies of the other modules are still in flight, so that
// GlobalChecks at the window's end only computes what is left; an add into
// a module afterwards (its second sum) drops its blocks' results.
//
// With delayed_param_update there are two accumulators: the step started at
// the end of a window consumes one (SwapForStep) while the next window
// accumulates into the other.
//
// Threading: every method is for the engine's (main) thread; the worker is
// internal. The accumulator pointers handed out are read and zeroed by the
// optimizer thread only while a step consumes them.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "src/common/thread_annotations.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/scheduler/fold_mode.h"
#include "src/scheduler/grad_store.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/step_counters.h"

namespace strata::scheduler {

class GradOffloader {
 public:
  GradOffloader(gpu::Device* device, const Layout* layout, cpu_adam::CpuOptimizer* adam,
                StepCounters* counters);
  ~GradOffloader();  // drains the queue and stops the worker

  // Allocates the accumulator(s) (zeroed; none when !host_accumulator: the
  // gradients stay on the device) and the staging pool, and starts the
  // worker. ResourceExhausted when the thread cannot be created. Adds the
  // pool's bytes to *pinned_bytes.
  // landing_bytes > 0: the fold's landing buffer (the parameters' bytes),
  // page-locked with the device when pin_landing.
  // pin_accumulator: page-lock the accumulator for the direct copies (not
  // with a second accumulator); when pinning fails, the staging path.
  Status Start(bool second_accumulator, int64_t* pinned_bytes, bool host_accumulator = true,
               int64_t landing_bytes = 0, bool pin_landing = false, bool pin_accumulator = false);
  // The window's fp32 sums are copied straight into the accumulator, which
  // the step then need not zero (see above).
  bool direct() const { return direct_; }
  // Checks ahead (see above); only where the accumulator holds the window's
  // final sums when GlobalChecks runs (one rank). REQUIRES: drained.
  void set_precompute_checks(bool on) { precompute_ = on; }
  // Sub-groups stepped on the device (offload_optimizer.ratio): the
  // elements below `elem` never reach the accumulator; ZeroUnsent leaves the
  // modules that lie wholly there alone.
  void set_device_stepped(int64_t elem) { device_stepped_ = elem; }
  gpu::PinnedPool* staging_pool() { return pool_.get(); }

  // Enqueues the D2H copies of module m's gradients (device_grad: the
  // module's gradient buffer, laid out like its parameters) after `computed`
  // and hands each chunk to the worker. The buffer may be freed once the D2H
  // stream has passed this point.
  Status Offload(int m, const void* device_grad, gpu::Event& computed) EXCLUDES(mu_);
  // The same for module m's fp32 sums (the device accumulator's part for
  // the module, m's elements from its first): added into the accumulator in
  // fp32 (a zeroed accumulator takes their bits); direct(): the first of the
  // window copied into it.
  Status OffloadFp32(int m, const float* device_sum, gpu::Event& computed) EXCLUDES(mu_);
  // Fold: copies module m's gradients into its part of the landing buffer
  // (D2H stream, after `computed`), not accumulated. REQUIRES: a landing
  // buffer (Start). Drain() waits for the copies.
  Status Land(int m, const void* device_grad, gpu::Event& computed) EXCLUDES(mu_);
  // The window's fold modes, one per module (empty when nothing was landed:
  // the plain path), and the landing buffer the optimizer reads them from.
  // The modes of the Land and Offload calls so far; a module's is final
  // once the window has no more backward passes of it (the step's copy is
  // taken when drained). The modes are forgotten by Zero/ZeroAll and ForgetWindow.
  std::vector<uint8_t> FoldModes() const;
  const uint8_t* landing() const { return static_cast<const uint8_t*>(landing_.data()); }
  // A step has taken the window (its FoldModes): the next window starts.
  void ForgetWindow();
  // Waits until every chunk has been accumulated (and every direct copy has
  // landed); returns (and forgets) the first error since the last Drain.
  Status Drain() EXCLUDES(mu_);
  // direct(): zeroes the accumulator of every module that got no sums this
  // window (the previous window's are still there). REQUIRES: drained, and
  // no step still reading the accumulator; before anything reads the
  // window's sums.
  void ZeroUnsent();
  // Tickets: how many chunks have been queued so far (main thread), and
  // whether the first `ticket` of them have been accumulated (the worker
  // takes them in queue order; a failed one counts, its error is Drain's).
  int64_t queued() const { return queued_; }
  bool Accumulated(int64_t ticket) EXCLUDES(mu_);
  // Blocks until Accumulated(ticket); returns the first error so far (kept
  // for Drain too).
  Status WaitAccumulated(int64_t ticket) EXCLUDES(mu_);

  // Gradients on NVMe (TierPlan::grads_on_nvme): the window's sums go to
  // `store` instead of the accumulator (Start with host_accumulator false).
  // Before the first gradients.
  void SetNvmeStore(std::unique_ptr<GradStore> store) { nvme_ = std::move(store); }
  GradStore* nvme_store() { return nvme_.get(); }

  // The accumulator of the current window (null with gradients on NVMe).
  float* accumulator() { return acc_.as<float>(); }
  // delayed_param_update: the current accumulator becomes the step's, and the
  // other one (zeroed by the previous step as it consumed it) the current.
  float* SwapForStep();
  // Zeroes the current accumulator / both (REQUIRES: drained).
  void Zero();
  void ZeroAll();
  // Inf/nan anywhere in the window's gradients, and their sum of squares, in
  // fixed blocks added in order (the same bits for any thread count). With
  // landed modules the element is acc + landed (or 0 + landed), computed as
  // the accumulation would, without writing it: the same bits as the plain
  // path's pass over the accumulator. REQUIRES: drained.
  // With gradients on NVMe: GradStore::GlobalChecks (the same blocks).
  Status GlobalChecks(bool* overflow, double* sumsq) const;
  // The blocks GlobalChecks adds, over the sub-groups [first_group,
  // end_group) (data parallelism: a rank's partition): each block's sum of
  // squares and whether it holds an inf/nan, in order. Not with gradients on
  // NVMe. REQUIRES: drained.
  Status BlockChecks(size_t first_group, size_t end_group, std::vector<double>* partial,
                     std::vector<uint8_t>* bad) const;

 private:
  // One D2H'd chunk of gradients waiting to be accumulated.
  struct Job {
    gpu::PinnedBuffer staging;
    std::unique_ptr<gpu::Event> done;
    int module = 0;
    int64_t byte_begin = 0, byte_end = 0;  // in the flat parameter-byte space
    bool fp32 = false;                     // OffloadFp32: elements, not bytes
    int64_t elem_begin = 0, elem_end = 0;  // fp32: in the flat element space
    bool copied_in = false;                // direct: module's sums copied in (`done`); checks ahead
  };
  // Checks ahead: the worker's part after module m's copy landed / an add
  // into module m.
  void ChecksAfterCopy(int m);
  void DropChecksOf(int m);
  // The blocks (in BlockChecks' order) overlapping module m.
  std::pair<size_t, size_t> BlocksOf(int m) const;
  // Stages `bytes` of `src` (device) into a staging buffer on the D2H stream
  // and queues `job` for the worker; waits for a buffer when all are taken.
  Status Enqueue(Job job, const void* src, int64_t bytes) EXCLUDES(mu_);
  // Hands `job` (its `done` recorded) to the worker.
  void Push(Job job) EXCLUDES(mu_);
  void Worker() EXCLUDES(mu_);
  // acc += the staged chunk (module m's bytes [byte_begin, byte_end)).
  Status Accumulate(const Job& job);
  // The same into the GradStore, sub-group by sub-group.
  Status AccumulateNvme(const Job& job);
  // acc += what module m has in `src` (laid out like the parameters, from
  // the module's first byte): a staged chunk or the landing buffer.
  Status AccumulateBytes(int m, const uint8_t* src, int64_t byte_begin, int64_t byte_end);
  // Waits until the worker has accumulated every queued chunk (errors stay
  // for Drain).
  void WaitIdle() EXCLUDES(mu_);

  gpu::Device* dev_;
  const Layout* layout_;
  cpu_adam::CpuOptimizer* adam_;
  StepCounters* counters_;
  HostArray acc_, alt_;
  std::unique_ptr<GradStore> nvme_;
  // Fold (main thread only): the landing buffer, the event after the last
  // landing copy, and per module whether it was landed / accumulated in
  // this window.
  HostArray landing_;
  std::unique_ptr<gpu::Event> landed_event_;
  bool landing_in_flight_ = false;
  std::vector<uint8_t> landed_, accumulated_;
  // Direct (main thread only): the event after the latest direct copy, and
  // whether one is in flight.
  bool direct_ = false;
  std::unique_ptr<gpu::Event> direct_event_;
  bool direct_in_flight_ = false;
  int64_t device_stepped_ = 0;  // set_device_stepped
  // Checks ahead: every sub-group's blocks in order, and per block its
  // result and whether it holds one (the worker writes them while jobs run;
  // the main thread reads and resets them when drained); per module
  // whether its sums were copied in this window (the worker's).
  bool precompute_ = false;
  std::vector<std::pair<int64_t, int64_t>> blocks_;
  std::vector<double> pre_partial_;
  std::vector<uint8_t> pre_bad_, pre_done_, copied_;
  std::unique_ptr<gpu::PinnedPool> pool_;
  std::thread worker_;

  Mutex mu_;
  CondVar cv_;
  std::deque<Job> queue_ GUARDED_BY(mu_);
  int64_t pending_ GUARDED_BY(mu_) = 0;  // queued + running
  int64_t queued_ = 0;                   // main thread
  int64_t chunks_done_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  Status error_ GUARDED_BY(mu_);
};

}  // namespace strata::scheduler
