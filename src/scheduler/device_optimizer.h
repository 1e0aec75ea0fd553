// src/scheduler/device_optimizer.h — the optimizer back-end on the device
// (offload_optimizer none with offload_param none on a GPU): everything stays
// in HBM. Gradients are added into an fp32 accumulator in HBM on the compute
// stream as each module's backward ends (Device::AddToFp32); at the window's
// end one pass over it gives the inf/nan flag and the sum of squares (one
// small device-to-host copy per step), and one fused multi-tensor
// Device::AdamStep per step updates master, moments and the device parameter
// block in the same pass, on the compute stream: the next forward pass is
// ordered after it with no host round trip. A step is current as soon as it
// is launched: nothing is ever in flight between two Step() calls.
//
// The arithmetic is the CPU optimizer's (the host device's AdamStep is its
// scalar loop, the CUDA kernel rounds the same way); the global sum of
// squares is reduced in another order than the CPU path's, so results agree
// with the CPU placements to rounding, not bit for bit.
//
// Data parallelism (`dp`): each rank keeps the states of its partition only
// (the store's Partition). At the window's end the ranks' accumulators are
// averaged into each rank's partition (DataParallel::ReduceGradients on
// device memory: NCCL on a GPU), the checks are this partition's sum of
// squares added over the ranks in rank order, the step updates the
// partition's parameters in the device block, and the ranks all-gather the
// block (DataParallel::GatherParams). These collectives block the host until
// they have finished. Stage 3 with partitioned parameters
// (StateStore::gathers_on_device): the block is this rank's part, the step
// writes it and nothing is gathered after the step; the fetcher's device
// copies are dropped (DeviceCopies) and the modules gathered at their next
// fetch.
//
// Threading: the engine's (main) thread only.
#pragma once

#include <cstdint>

#include "src/gpu/device.h"
#include "src/scheduler/data_parallel.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/optimizer_backend.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_counters.h"

namespace strata::scheduler {

// The device Adam's hyperparameters for a CPU optimizer's (Adam or AdamW).
gpu::AdamHyperParams ToDeviceHyperParams(const cpu_adam::HyperParams& c);
// The device Adam's shard of elements [e, e + n) of `st` (states in the
// arena, any format): its arrays, index0 = e (the CPU optimizer's
// element_offset, so that a bf16 master rounds with the same stream).
// grad, copy_out and their dtypes are the caller's.
gpu::AdamShard DeviceStateShard(const StateArrays& st, int64_t e, int64_t n);

class DeviceOptimizer final : public OptimizerBackend {
 public:
  DeviceOptimizer(gpu::Device* device, const Layout* layout, StateStore* store,
                  StepCounters* counters, LossScaler* scaler, GradientWindow* window,
                  DataParallel* dp = nullptr)
      : dev_(device),
        layout_(layout),
        store_(store),
        counters_(counters),
        scaler_(scaler),
        window_(window),
        dp_(dp) {}

  // The accumulator (zeroed) and the two flags, from the arena.
  Status Init();
  // Partitioned parameters: the fetcher's copies, dropped before each step
  // (the step rewrites this rank's part of them in place).
  void set_device_copies(DeviceCopies* copies) override { copies_ = copies; }

  // StepProgress: a step is never in flight.
  bool reading_next_params() const override { return false; }
  bool module_ready(int) const override { return true; }
  Status AwaitModule(int) override { return Status(); }

  // OptimizerBackend.
  // acc += module m's gradients, on the compute stream after the work that
  // produced them.
  Status AddGradients(int m, const void* device_grad, gpu::Event& computed, bool last) override;
  gpu::Stream& gradients_read_on() override { return dev_->compute(); }
  Status Drain() override { return Status(); }
  // Waits for the compute stream.
  Status GlobalChecks(bool* overflow, double* sumsq) override;
  Status ZeroGrad() override;
  void DiscardWindow() override;
  // One Adam/AdamW step of every parameter with the accumulated gradients
  // (times hp.grad_scale), writing the updated parameters into the device
  // block, then zeroing the accumulator; on the compute stream (on the host
  // device: finished when it returns, the framework computes on this thread).
  Status Launch(const LaunchParams& p) override;
  Status Poll() override { return Status(); }
  Status Join() override { return Status(); }
  Status Abandon() override { return Status(); }
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  // Zeroes the accumulator (compute stream).
  Status Zero();

  gpu::Device* dev_;
  const Layout* layout_;
  StateStore* store_;
  StepCounters* counters_;
  LossScaler* scaler_;
  GradientWindow* window_;
  DataParallel* dp_;
  DeviceCopies* copies_ = nullptr;
  gpu::DeviceBuffer acc_;
  gpu::DeviceBuffer flags_;  // int32 found_inf, then (8-aligned) double sum of squares
  int64_t steps_ = 0;
};

}  // namespace strata::scheduler
