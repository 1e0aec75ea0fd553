// strata/plan.h — the tier plan without an engine: what Engine::Plan() would
// need in HBM, pinned DRAM, NVMe and DRAM for a config and a model's
// parameters, and the optimizer step it predicts at this machine's rates.
// No state is allocated, so a model far larger than the machine is planned
// in seconds; this is what `strata plan` runs.
//
//   StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(config);  // measures, once
//   std::vector<PlanParam> params = {{"embed.w", 256 * 384, DType::kBf16, 0}, ...};
//   StatusOr<PlanResult> plan = (*planner)->Plan(params);  // arithmetic only
//   if (!plan->fits) ...;  // plan->budgets says which tier is over and by how much
//
// Create() does what Engine::Plan() does before it allocates: it creates the
// device of strata.device (its arena is the HBM budget), reads the free
// space of the config's NVMe directories and the DRAM budget, and measures
// the rates the plan uses (pinned and pageable PCIe copies, the CPU's
// gradient accumulation and Adam, and the disk). Plan() is then a pure
// function of the parameters, so one Planner answers many questions (the
// largest model that fits, say) at the cost of one measurement.
//
// The plan is a single process's: the data-parallel ranks of torchrun's
// variables are not read (with several ranks each plans its own partition).
//
// Threading: a Planner is used by one thread at a time (External
// synchronization). Errors are Status; nothing throws.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/dtype.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata {

// One parameter tensor as the plan sees it: a ParamSpec without its values.
struct PlanParam {
  std::string name;
  int64_t numel = 0;  // >= 1
  DType dtype = DType::kBf16;
  int module = 0;  // owning module id (0-based), as Engine::RegisterParameter
};

struct PlanOptions {
  // The disk's rates: the NVMe engine writes then reads this many bytes
  // (whole MiB, at most 256 MiB) on the config's first NVMe directory, as
  // Engine::Plan() does. 0: not measured (the prediction then leaves out the
  // NVMe terms). Unused without an NVMe tier.
  int64_t nvme_probe_bytes = int64_t{256} << 20;
  // The elements the CPU probes (gradient accumulation and Adam) run over,
  // clamped to [2^18, 2^23]: Engine::Plan() takes its parameters' elements.
  // 0: 2^23. Unused when the optimizer runs on the device.
  int64_t cpu_probe_elements = 0;
  // Plan for a GPU that is described, not opened: a preset's name (h100,
  // h100-pcie, h200, a100-80g, a100-40g, l40s, a10, rtx4090; datasheet
  // memory, PCIe link and memory bandwidth), whatever this machine has.
  // Empty: the device strata.device names; where that is "cuda" and no
  // CUDA device can be opened here (none, no driver, a CPU-only build), a
  // described GPU of strata.hbm_budget bytes on a PCIe 4.0 x16 link (no
  // budget: InvalidArgument naming strata.hbm_budget and the presets).
  // A described GPU's budget is strata.hbm_budget, else the preset's
  // memory less the CUDA device's headroom (5 %, at most 1 GiB); its
  // link and device-copy rates are nominal (PlanRates::nominal).
  std::string gpu;
};

// The rates a Planner measured, 0 for one it did not.
struct PlanRates {
  double h2d_gbytes_per_s = 0;           // pinned host-to-device copies
  double d2h_gbytes_per_s = 0;           // device-to-host copies into pinned memory
  double d2h_pageable_gbytes_per_s = 0;  // ... into pageable memory
  double accumulate_gbytes_per_s = 0;    // the CPU's gradient accumulation, bytes moved
  double cpu_adam_elements_per_s = 0;    // the CPU optimizer's step
  double nvme_read_gbytes_per_s = 0;     // the NVMe engine, sequential
  double nvme_write_gbytes_per_s = 0;
  // A copy within the device's memory, bytes read + written per second (the
  // device Adam's bound for offload_optimizer.ratio); 0 on the host device.
  double device_copy_gbytes_per_s = 0;
  // The NVMe directory the disk's rates are for (the config's first; "" with
  // no NVMe tier), and the I/O engine that measured them ("uring" or
  // "posix"; "" when not measured).
  std::string nvme_path;
  std::string nvme_engine;
  // The figures that are nominal rather than measured here: for a
  // described GPU "hbm_budget" (from the preset, when strata.hbm_budget is
  // not set), "h2d", "d2h", "d2h_pageable" and "device_copy"; "nvme" when
  // the config's NVMe directory does not exist here (its rates and free
  // space are then not known: the NVMe terms are left out). Empty when
  // every figure was measured on this machine. With a described GPU the
  // CPU's rates are this machine's, not the GPU machine's.
  std::vector<std::string> nominal;
};

// The plan for one set of parameters.
struct PlanResult {
  // Whether every tier holds what it must (no budget row has needed_bytes
  // above a non-zero available_bytes). Engine::Plan() fails with
  // ResourceExhausted where this is false.
  bool fits = true;
  // As Engine::Budgets() after Plan(): hbm, pinned, [nvme], dram; `detail`
  // says what each holds (and, on the pinned or dram row, the gradient path).
  std::vector<TierBudget> budgets;
  // Host memory the plan allocates: pinned + dram, and on the host device
  // the hbm row too (its "device" memory is host memory).
  int64_t host_bytes = 0;
  // The gradient path chosen and why, in words.
  std::string gradient_path;
  // offload_optimizer.ratio below 1 or "auto": the sub-groups stepped on
  // the device, or why none are (empty: ratio 1), and the predicted bound
  // of the same step with every sub-group on the CPU (0: no split).
  std::string device_step;
  double bound_all_on_cpu_s = 0;
  // As Engine::PredictedStep(): one optimizer step (a window of
  // gradient_accumulation_steps micro-batches) per resource at the measured
  // rates; parameter fetches counted for forward and backward of every
  // micro-batch (an upper bound); compute not predicted.
  std::vector<PredictedTerm> step;
  // The busiest resource of `step` (PCIe directions, NVMe read + write, the
  // CPU's accumulation + optimizer) and its seconds.
  double bound_s = 0;
  std::string bound_by;
};

class Planner {
 public:
  // Creates the device and measures (see the top of this file): a few
  // seconds, plus the disk probe with an NVMe tier. The config is validated
  // as Engine::Create validates it. The NVMe directories must exist; their
  // free space is read as it is (Engine::Plan() first removes the leftover
  // swap files of killed runs from them; a caller that wants the same
  // figure does that first).
  static StatusOr<std::unique_ptr<Planner>> Create(const Config& config,
                                                   const PlanOptions& options = {});
  virtual ~Planner() = default;

  // Lays `params` out as the engine would (modules in id order, parameters
  // in the order given within a module) and computes each tier's needs and
  // the predicted step. Allocates nothing but the result. InvalidArgument
  // for an empty list, a numel below 1 or a negative module id.
  virtual StatusOr<PlanResult> Plan(std::span<const PlanParam> params) const = 0;

  // "cuda:0 (NVIDIA H100 ...)" or "host ...", as Engine::DeviceName(); a
  // described GPU: "cuda (described, not opened: NVIDIA H100 SXM5 80GB)".
  virtual std::string DeviceName() const = 0;
  virtual bool DeviceIsHost() const = 0;
  // offload_optimizer none on a GPU: the optimizer steps in HBM (nothing
  // crosses PCIe for it, and the CPU probes are not taken).
  virtual bool OptimizerOnDevice() const = 0;
  virtual const PlanRates& Rates() const = 0;
};

}  // namespace strata
