// src/scheduler/device_step.h — the optimizer on the device
// (offload_optimizer none with offload_param none on a GPU): everything stays
// in HBM. Gradients are added into an fp32 accumulator in HBM on the compute
// stream as each module's backward ends (Device::AddToFp32); at the window's
// end one pass over it gives the inf/nan flag and the sum of squares (one
// small device-to-host copy per step), and one fused multi-tensor
// Device::AdamStep per step updates master, moments and the device parameter
// block in the same pass, on the compute stream: the next forward pass is
// ordered after it with no host round trip.
//
// The arithmetic is the CPU optimizer's (the host device's AdamStep is its
// scalar loop, the CUDA kernel rounds the same way); the global sum of
// squares is reduced in another order than the CPU path's, so results agree
// with the CPU placements to rounding, not bit for bit.
//
// Threading: the engine's (main) thread only.
#pragma once

#include <cstdint>

#include "src/gpu/device.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/state_store.h"

namespace strata::scheduler {

class DeviceOptimizer {
 public:
  DeviceOptimizer(gpu::Device* device, const Layout* layout, StateStore* store)
      : dev_(device), layout_(layout), store_(store) {}

  // The accumulator (zeroed) and the two flags, from the arena.
  Status Init();
  // acc += module m's gradients (its device gradient buffer), on the
  // compute stream after the work that produced them.
  Status Accumulate(int m, const void* device_grad);
  // Any inf/nan in the accumulator, and its sum of squares (waits for the
  // compute stream).
  Status GlobalChecks(bool* overflow, double* sumsq);
  // One Adam/AdamW step of every parameter with the accumulated gradients
  // (times hp.grad_scale), writing the updated parameters into the device
  // block; then zeroes the accumulator. Enqueued on the compute stream.
  Status Step(const gpu::AdamHyperParams& hp);
  // Zeroes the accumulator (compute stream).
  Status Zero();

 private:
  gpu::Device* dev_;
  const Layout* layout_;
  StateStore* store_;
  gpu::DeviceBuffer acc_;
  gpu::DeviceBuffer flags_;  // int32 found_inf, then (8-aligned) double sum of squares
};

}  // namespace strata::scheduler
