// src/scheduler/rate_probes.h — short measurements the plan takes when the
// engine plans (and `strata plan` without an engine): the pinned and
// pageable PCIe copy rates (for the step bound and the gradient path), the
// CPU's gradient accumulation rate (whether folding the last micro-batch
// pays), the CPU optimizer's rate and the disk's sequential rates (the
// predicted step and the bound).
//
// Threading: the caller's thread; the device's copy streams are used alone.
#pragma once

#include <cstdint>
#include <string>

#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/nvme/nvme_bench.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata::scheduler {

struct LinkRates {
  double h2d_gbytes_per_s = 0;
  double d2h_gbytes_per_s = 0;
  double d2h_pageable_gbytes_per_s = 0;  // into pageable memory
  // A copy within the device's memory, bytes read + written per second (the
  // HBM bandwidth the device Adam runs at); 0 on the host device, whose
  // device Adam is a scalar loop on the framework's thread.
  double d2d_gbytes_per_s = 0;
};
// Times pinned host<->device copies of `bytes` on the device's copy streams
// (best of a few, each direction alone), a device-to-host copy into
// pageable memory and (GPU only) a copy of half the buffer into its other
// half. Needs `bytes` free in the arena.
StatusOr<LinkRates> MeasureLinkRates(gpu::Device* device, int64_t bytes);
// The CPU optimizer's gradient accumulation rate (fp32 += bf16 over `elems`
// elements, best of three): bytes moved per second, in GB/s.
StatusOr<double> MeasureAccumulateRate(cpu_adam::CpuOptimizer* adam, int64_t elems);

// The CPU optimizer's AdamW step over `elems` elements with fp32 gradients,
// its states in `states`, and a bf16 copy-out (best of three): elements per
// second.
StatusOr<double> MeasureAdamRate(cpu_adam::CpuOptimizer* adam, int64_t elems,
                                 cpu_adam::StateFormat states = cpu_adam::StateFormat::kFp32);

// The probes a plan takes.
struct PlanRates {
  LinkRates link;               // all 0 when the arena has no room for a probe
  double accumulate_gbps = 0;   // with `cpu`
  double adam_elems_per_s = 0;  // with `cpu`
};
// MeasureLinkRates with up to 16 MiB (half the arena's largest free block,
// skipped below 64 KiB, or with a null `device`: a GPU only described), and with `cpu` (the
// optimizer runs on the CPU) MeasureAccumulateRate and MeasureAdamRate over `elems` elements,
// clamped to [2^18, 2^23].
StatusOr<PlanRates> MeasurePlanRates(gpu::Device* device, cpu_adam::CpuOptimizer* adam,
                                     int64_t elems, bool cpu,
                                     cpu_adam::StateFormat states = cpu_adam::StateFormat::kFp32);

// The disk's sequential rates on `path` with the config's NVMe engine
// options: RunEngineBench writing then reading `bytes` rounded down to whole
// MiB (at least 1 MiB, at most 256 MiB).
StatusOr<nvme::NvmeBenchResult> MeasureDiskRates(const Config& config, const std::string& path,
                                                 uint64_t bytes);

}  // namespace strata::scheduler
