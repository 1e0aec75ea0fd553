// src/scheduler/rate_probes.h — short measurements the plan takes when the
// engine plans: the pinned and pageable PCIe copy rates (for the step bound
// and the gradient path) and the CPU's gradient accumulation rate (whether
// folding the last micro-batch pays).
//
// Threading: the caller's thread; the device's copy streams are used alone.
#pragma once

#include <cstdint>

#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "strata/status.h"

namespace strata::scheduler {

struct LinkRates {
  double h2d_gbytes_per_s = 0;
  double d2h_gbytes_per_s = 0;
  double d2h_pageable_gbytes_per_s = 0;  // into pageable memory
};
// Times pinned host<->device copies of `bytes` on the device's copy streams
// (best of a few, each direction alone), and a device-to-host copy into
// pageable memory. Needs `bytes` free in the arena.
StatusOr<LinkRates> MeasureLinkRates(gpu::Device* device, int64_t bytes);
// The CPU optimizer's gradient accumulation rate (fp32 += bf16 over `elems`
// elements, best of three): bytes moved per second, in GB/s.
StatusOr<double> MeasureAccumulateRate(cpu_adam::CpuOptimizer* adam, int64_t elems);

// The CPU optimizer's AdamW step over `elems` fp32 elements with a bf16
// copy-out (best of three): elements per second.
StatusOr<double> MeasureAdamRate(cpu_adam::CpuOptimizer* adam, int64_t elems);

}  // namespace strata::scheduler
