// src/scheduler/plan.h — the tier plan: what each tier (HBM, pinned DRAM,
// NVMe, pageable DRAM) must hold for a placement, against what it has.
// Pure functions of the layout's sizes, the config's placement and the
// machine's tier facts, so the planner is tested on hand-made inputs without
// an Engine; MeasureTierFacts is the only part that asks the machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/scheduler/layout.h"
#include "strata/config.h"
#include "strata/engine.h"

namespace strata::scheduler {

// The parts of the config the plan depends on.
struct Placement {
  OffloadDevice optimizer = OffloadDevice::kNone;  // zero_optimization.offload_optimizer.device
  OffloadDevice params = OffloadDevice::kNone;     // zero_optimization.offload_param.device
  bool pin_optimizer_states = false;               // offload_optimizer.pin_memory
  bool pin_param_copies = false;                   // offload_param.pin_memory (else: by budget)
  int64_t optimizer_buffer_count = 4;              // offload_optimizer.buffer_count
  int64_t param_buffer_count = 5;                  // offload_param.buffer_count
  int64_t max_live_parameters = 1'000'000'000;     // stage3_max_live_parameters (elements)
  bool overlap_optimizer = true;                   // strata.overlap_optimizer
  bool delayed_param_update = false;               // strata.delayed_param_update
  // offload_optimizer none on a GPU: the gradient accumulator is in HBM and
  // the optimizer runs there (DeviceOptimizer); set by the engine.
  bool device_optimizer = false;
  int stage = 0;
  int64_t sub_group_size = 0;

  static Placement FromConfig(const Config& config);
};

// The layout's sizes the plan depends on (Layout::Sizes, or hand-made).
struct LayoutSizes {
  int64_t total_elems = 0;
  int64_t total_param_bytes = 0;
  int64_t persistent_param_bytes = 0;
  int64_t max_module_bytes = 0;
  int64_t max_group_elems = 0;
  int64_t grad_staging_bytes = 0;
  int64_t num_groups = 0;
  int64_t num_modules = 0;

  static LayoutSizes Of(const Layout& layout);
};

// What the machine offers. 0 means "unknown / unlimited" for dram and nvme.
struct TierFacts {
  int64_t hbm_budget = 0;
  int64_t pinned_budget = 0;
  int64_t dram_available = 0;           // MemAvailable-like
  std::vector<std::string> nvme_paths;  // the directories the NVMe tier uses
  int64_t nvme_available = 0;           // free bytes on them, summed
};

// Gradient staging chunks in flight (one pool of this many chunk buffers).
inline constexpr int64_t kGradStagingBuffers = 4;

struct TierPlan {
  std::vector<TierBudget> budgets;  // hbm, pinned, [nvme], dram; detail says what each holds
  bool fits = true;
  // The host parameter copies the device copies from every step (the
  // updated parameters, with the host copy or mirror they swap with) are
  // page-locked: always with offload_param.pin_memory, else when they fit in
  // what the pinned budget leaves after the staging pools (0: no limit).
  bool pin_param_copies = false;
  int64_t param_copy_bytes = 0;
  // Device slots (the largest module's bytes each) for parameter copies and
  // gradient buffers, allocated once (ParamFetcher).
  int64_t device_slots = 0;
  int64_t slot_bytes = 0;
  // The NVMe capacity the swap store is opened with (0: no NVMe tier).
  int64_t nvme_bytes() const;
};

// Every tier's needed bytes and what they are made of. Pinned placement:
// the staging pools and pinned optimizer states (pin_memory) must fit the
// pinned budget; then what crosses PCIe every step (the parameter copies) is
// pinned if the rest of the budget holds it, else left pageable in DRAM and
// the pinned row says why. Optimizer states and the gradient accumulator
// never cross PCIe and are pinned only on request.
TierPlan ComputeTierPlan(const Placement& placement, const LayoutSizes& sizes,
                         const TierFacts& facts);

// The ResourceExhausted message of a plan that does not fit: one row per tier
// (needed, available, what it holds, "<-- over" where it does not fit), then a
// line naming the placement.
std::string OverBudgetTable(const TierPlan& plan, const Placement& placement,
                            const LayoutSizes& sizes);

// The NVMe directories a config uses, optimizer's first, without duplicates
// (empty when nothing is placed on NVMe).
std::vector<std::string> UsedNvmePaths(const Config& config);

// Free space of the directories (statvfs) and the machine's available pages.
TierFacts MeasureTierFacts(int64_t hbm_budget, int64_t pinned_budget,
                           std::vector<std::string> nvme_paths);

}  // namespace strata::scheduler
