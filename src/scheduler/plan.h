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
  // The optimizer states' format (strata.optimizer_states): their bytes per
  // element in every row that holds them (StateArrayBytes).
  OptimizerStates optimizer_states = OptimizerStates::kFp32;
  OffloadDevice params = OffloadDevice::kNone;  // zero_optimization.offload_param.device
  bool pin_optimizer_states = false;            // offload_optimizer.pin_memory
  bool pin_param_copies = false;                // offload_param.pin_memory (else: by budget)
  int64_t optimizer_buffer_count = 4;           // offload_optimizer.buffer_count
  int64_t param_buffer_count = 5;               // offload_param.buffer_count
  int64_t max_live_parameters = 1'000'000'000;  // stage3_max_live_parameters (elements)
  bool overlap_optimizer = true;                // strata.overlap_optimizer
  bool delayed_param_update = false;            // strata.delayed_param_update
  // strata.speculative_step: -1 auto, 0 off, 1 on (FromConfig; a Placement
  // made by hand has it off).
  int speculative_step = 0;
  // offload_optimizer none on a GPU: the gradient accumulator is in HBM and
  // the optimizer runs there (DeviceOptimizer); set by the engine.
  bool device_optimizer = false;
  int64_t gradient_accumulation_steps = 1;  // micro-batches per window
  // The gradient path (GradPath below): -1 the plan decides, 0 never fold,
  // 1 fold wherever it is possible (EngineTestHooks::fold_override, a
  // developer switch for A/B measurements; set by the engine).
  int fold_override = -1;
  // strata.grad_accumulator: where the window's gradients are summed.
  GradAccumulatorPlace grad_accumulator = GradAccumulatorPlace::kAuto;
  // strata.grad_tier: where the window's gradient sums are kept when the
  // optimizer states are on NVMe.
  GradTier grad_tier = GradTier::kAuto;
  // The host device (set by the engine): device work runs on the
  // framework's thread.
  bool host_device = false;
  int stage = 0;
  int64_t sub_group_size = 0;
  // Data parallelism (set by the engine): the ranks, and the device bytes of
  // the collectives' staging buffer (DataParallel::StagingBytes).
  int world_size = 1;
  int64_t collective_staging_bytes = 0;
  // zero_optimization.offload_optimizer.ratio (the fraction stepped on the
  // CPU; "auto": cpu_ratio_auto) and whether optimizer.type is one the
  // device Adam runs (Adam, AdamW).
  double cpu_ratio = 1.0;
  bool cpu_ratio_auto = false;
  bool device_adam = true;
  // Decided by ComputeTierPlan (TierPlan::device_step_groups): the first
  // sub-groups whose states are in HBM and stepped by the device Adam.
  int64_t device_step_groups = 0;

  // ---- Policies decided from the fields above (one place for each) ----
  // The optimizer step runs beside the next forward pass, and the next
  // fetches read its new parameters (StepProgress): strata.overlap_optimizer
  // where it applies, with one rank or at stage 3 with offload_param cpu
  // (each module gathered from the ranks as their steps finish it); never
  // with the device optimizer. Elsewhere the step runs inline (a
  // delayed_param_update step runs beside the next window either way).
  bool overlap_step() const {
    return overlap_optimizer && !device_optimizer &&
           (world_size <= 1 || (stage == 3 && params == OffloadDevice::kCpu));
  }
  // offload_param none with overlap_step(): modules are uploaded into the
  // device block as the step finishes them, and with the optimizer states
  // on NVMe a host mirror of the block undoes a step that fails half-way
  // (states there have two versions and such a step is rolled back). States
  // in memory are updated in place: a step that has finished a module has
  // advanced and is committed, so no upload is ever undone and no mirror is
  // kept.
  bool param_mirror() const {
    return params == OffloadDevice::kNone && optimizer == OffloadDevice::kNvme && overlap_step();
  }
  // The CPU step during the window's last backward pass (strata.
  // speculative_step; HostOptimizer): where it applies, the optimizer on the
  // CPU with its states in memory (saved to a spare first) or on NVMe (whole
  // sub-groups into their inactive versions; the window's sums in DRAM or on
  // NVMe, not in HBM: TierPlan::speculation_elems), the new parameters into the copy-out
  // array, or with offload_param nvme to the modules' inactive versions,
  // current only at the commit; one rank, no delayed_param_update; on when
  // asked, and with auto except on the host device (the backward pass runs
  // on the same cores).
  bool speculate() const {
    if (speculative_step == 0 || device_optimizer || delayed_param_update || world_size > 1)
      return false;
    return speculative_step == 1 || !host_device;
  }

  static Placement FromConfig(const Config& config);
};

// The layout's sizes the plan depends on (Layout::Sizes, or hand-made).
struct LayoutSizes {
  int64_t total_elems = 0;
  int64_t total_param_bytes = 0;  // with every module's page alignment
  // The modules' own byte extents summed (what a module's copy over PCIe
  // moves; 0: total_param_bytes).
  int64_t module_param_bytes = 0;
  int64_t persistent_param_bytes = 0;
  int64_t max_module_bytes = 0;
  int64_t max_group_elems = 0;
  int64_t grad_staging_bytes = 0;
  int64_t num_groups = 0;
  int64_t num_modules = 0;
  // The elements and sub-groups whose optimizer states this rank keeps (data
  // parallelism: its partition; one rank: all of them).
  int64_t state_elems = 0;
  int64_t state_groups = 0;
  int64_t param_elems = 0;  // the parameters' elements (0: total_elems)
  // Stage 3 with several ranks: the bytes of this rank's part of the
  // parameters, which the host copies (cpu), the device block (none) or
  // its NVMe pieces (nvme, two versions) hold; the modules are gathered into
  // pinned buffers (cpu, nvme) or device slots and buffers (none). 0: not
  // partitioned.
  int64_t partitioned_param_bytes = 0;

  static LayoutSizes Of(const Layout& layout);
};

// What the machine offers. 0 means "unknown / unlimited" for dram and nvme.
struct TierFacts {
  int64_t hbm_budget = 0;
  int64_t pinned_budget = 0;
  int64_t dram_available = 0;           // MemAvailable-like
  std::vector<std::string> nvme_paths;  // the directories the NVMe tier uses
  int64_t nvme_available = 0;           // free bytes on them, summed
  // Measured rates (GB/s; 0: not measured): device-to-host copies into
  // pinned and into pageable memory, and the CPU optimizer's gradient
  // accumulation (fp32 += bf16, bytes moved per second). The gradient path
  // is chosen from them.
  double d2h_pinned_gbps = 0;
  double d2h_pageable_gbps = 0;
  double accumulate_gbps = 0;
  // The rest of the step prediction's rates (StepRates), from which
  // offload_optimizer.ratio "auto" picks its split: host-to-device copies,
  // the CPU optimizer's elements per second, the device's copy bandwidth
  // (LinkRates::d2d_gbytes_per_s).
  double h2d_gbps = 0;
  double adam_elems_per_s = 0;
  double device_copy_gbps = 0;
};

// Gradient staging chunks in flight (one pool of this many chunk buffers).
inline constexpr int64_t kGradStagingBuffers = 4;
// Gradients on NVMe: sub-groups whose sums are held in DRAM at once (one
// being added into, one being written out).
inline constexpr int64_t kGradCacheSlots = 2;
// TierPlan::grads_in_hbm: the host buffers the sums are copied into (one
// being stepped, one being filled), and the largest chunk (a multiple of
// kNormBlockElems: the global checks' blocks stay those of the sums in DRAM).
inline constexpr int64_t kSumBuffers = 2;
inline constexpr int64_t kSumChunkElems = int64_t{1} << 24;

// offload_param nvme: module-sized buffers the optimizer copies the updated
// parameters into and writes to NVMe from (one being filled, the others'
// writes in flight).
inline constexpr int64_t kParamWriteBuffers = 4;

struct TierPlan {
  // The placement the plan was computed for, with its decided policies:
  // what the store allocates and the back-ends do.
  Placement placement;
  std::vector<TierBudget> budgets;  // hbm, pinned, [nvme], dram; detail says what each holds
  bool fits = true;
  // The host parameter copies the device copies from every step (the
  // updated parameters, with the host copy or mirror they swap with) are
  // page-locked: always with offload_param.pin_memory, else when they fit in
  // what the pinned budget leaves after the staging pools (0: no limit).
  bool pin_param_copies = false;
  int64_t param_copy_bytes = 0;
  // The gradient path. Accumulate: every micro-batch's gradients are staged
  // and added into the fp32 accumulator (GradOffloader), the optimizer reads
  // the sum. Fold: the window's last micro-batch lands whole in a landing
  // buffer of the parameters' dtype (total_param_bytes) and is never
  // accumulated; the global checks and the optimizer's pass read it beside
  // the accumulator (cpu_adam's ShardStep::fold), which saves per element
  // and window the accumulation pass (8 + G bytes, G the gradient's size),
  // with one micro-batch also the accumulator's read by the checks and the
  // step and its zeroing (12), less the G bytes the checks and the step
  // each read in its place. Chosen when the time that saves at the measured
  // accumulation rate exceeds what a pageable landing buffer would add to
  // the device-to-host copy (none when it is pinned), and DRAM holds it.
  // Not with the device optimizer (gradients stay in HBM) nor
  // delayed_param_update (the next window would overwrite the buffer while
  // the step reads it). The plan table's pinned or dram row says which.
  bool fold_last_micro_batch = false;
  // The window's gradients summed in an fp32 accumulator in HBM
  // (device_accumulator_bytes), copied to the host once per window: with
  // more than one micro-batch, the optimizer offloaded and not
  // delayed_param_update; strata.grad_accumulator device, or auto when the
  // copies and accumulation passes it saves take longer at the measured
  // rates than the one fp32 copy and pass it adds, and the accumulator fits
  // in the HBM budget with at least half of the budget left for the
  // framework's workspaces; auto never on the host device, where the adds
  // would run on the framework's thread instead of the CPU optimizer's. It
  // replaces the fold (the window's last micro-batch is summed in HBM too).
  bool device_grad_accumulator = false;
  int64_t device_accumulator_bytes = 0;
  // With device_grad_accumulator: the host's fp32 accumulator page-locked,
  // when the pinned budget left holds it, so that each module's window sum
  // is copied straight into it (no staging, no adds, and the step need not
  // zero it after reading it). Else the sums go through the staging
  // buffers and are added into a pageable accumulator.
  bool pin_grad_accumulator = false;
  bool pin_grad_landing = false;
  int64_t grad_landing_bytes = 0;  // 0 unless folding
  std::string grad_path;           // the choice and its reason, in words
  // Gradients on NVMe (offload_optimizer nvme; strata.grad_tier nvme, or
  // auto when the DRAM budget cannot hold the fp32 accumulator beside the
  // rest of the plan): the window's sums live in one fp32 shard per
  // sub-group on NVMe (grad_nvme_bytes), kGradCacheSlots sub-groups of them
  // in DRAM (grad_cache_bytes), and the optimizer pipeline's buffers carry a
  // sub-group's gradients after its states (16 bytes per element instead of
  // 12). No fold and no all-parameter accumulator then.
  bool grads_on_nvme = false;
  int64_t grad_cache_bytes = 0;
  int64_t grad_nvme_bytes = 0;
  // The window's sums in HBM until the step (strata.grad_tier hbm, or auto
  // with offload_optimizer cpu on one rank, no delayed_param_update, when the
  // DRAM budget cannot hold the fp32 accumulator beside the rest of the plan
  // and the HBM budget holds it): every micro-batch's gradients are added
  // into an fp32 array in HBM (the hbm row), and the global checks and then
  // the step copy each sub-group's sums to the host in chunks of
  // grad_chunk_elems through kSumBuffers pinned buffers (DeviceSums). No
  // host accumulator, no fold, no speculation; the same bits as the sums in
  // DRAM.
  bool grads_in_hbm = false;
  int64_t grad_chunk_elems = 0;
  // Bytes of one optimizer pipeline buffer (offload_optimizer nvme).
  int64_t optimizer_buffer_bytes = 0;
  // offload_optimizer nvme with a pinned budget that does not hold
  // buffer_count buffers of the largest sub-group beside the fixed pools
  // (gradient staging, parameter fetch, gather and write-back): each
  // buffer holds a piece of a sub-group of this many elements (the largest
  // multiple of kStatePieceQuantum that fits, at least one; the pinned row
  // is over when even that does not), and the pipeline streams the
  // sub-groups a piece at a time (Layout::set_state_piece_elems). 0: whole
  // sub-groups.
  int64_t state_piece_elems = 0;
  // offload_param nvme: the updated parameters are copied out into
  // kParamWriteBuffers module-sized buffers and written to NVMe from there
  // (no array over every parameter).
  int64_t param_write_bytes = 0;
  // Placement::speculate(): the optimizer states (12 bytes per element) of
  // the last speculation_elems elements are saved into a pageable spare
  // before they are stepped speculatively; as many as the DRAM budget
  // holds after the rest of the plan (0: none, speculation off). States on
  // NVMe need no spare: every element (with the window's sums on NVMe too,
  // each sub-group's are read once backward is past it: GradStore::Peek).
  // The window's sums in HBM reach the host only at the step: 0.
  int64_t speculation_elems = 0;
  // offload_optimizer.ratio below 1, or "auto" (one rank, stage 3,
  // offload_optimizer cpu, offload_param none or cpu (their parameters
  // through a device buffer then), no delayed_param_update, the
  // window's sums in DRAM, Adam or AdamW with fp32 or bf16 states): the
  // first device_step_groups sub-groups (device_step_elems elements) keep
  // their states in HBM (the hbm row, with their fp32 gradient sums) and
  // are stepped by the device Adam right after the global checks, while the
  // CPU steps the rest. Whole sub-groups, as DeepSpeed splits them: an
  // explicit ratio r gives the largest count at most (1 - r) of them;
  // "auto" as many as half the HBM budget holds beside the rest of the plan
  // (the other half is the framework's), up to all but one (none on the
  // host device, whose device Adam runs on the framework's thread).
  // device_step says what was decided and why.
  int64_t device_step_groups = 0;
  int64_t device_step_elems = 0;
  std::string device_step;
  // Host memory the plan allocates: pinned + dram, and on the host device
  // the hbm row too (its "device" memory is host memory).
  int64_t host_bytes = 0;
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

// The layout options of a config's zero_optimization section (what the
// engine's Plan() lays the parameters out with).
LayoutOptions LayoutOptionsFromConfig(const Config& config);

// The rates a step prediction uses (0: not measured; that term is left out).
struct StepRates {
  double h2d_gbps = 0;          // pinned host-to-device copies
  double d2h_gbps = 0;          // device-to-host copies into pinned memory
  double accumulate_gbps = 0;   // the CPU's gradient accumulation, bytes moved
  double adam_elems_per_s = 0;  // the CPU optimizer's step, elements
  double nvme_read_gbps = 0;    // the NVMe engine, sequential
  double nvme_write_gbps = 0;
  double device_gbps = 0;  // a copy within the device, read + write (the device Adam's bound)
};

// One optimizer step (a window of gradient_accumulation_steps micro-batches)
// as the engine moves its bytes, and the time each resource needs at the
// measured rates. Compute is not predicted (it depends on the model's
// kernels): the bound is that of the offload machinery.
struct StepPrediction {
  struct Term {
    std::string resource;  // "pcie_h2d", "pcie_d2h", "cpu_accumulate", "cpu_optimizer",
                           // "nvme_read", "nvme_write", "device_optimizer"
    double amount = 0;     // bytes (elements for cpu_optimizer)
    double seconds = 0;    // amount / rate; 0 when the rate is unknown
    std::string what;      // what the amount is made of
  };
  std::vector<Term> terms;
  // The busiest resource: PCIe directions, NVMe (read + write, one device),
  // the CPU (accumulation + optimizer, one pool of threads).
  double bound_s = 0;
  std::string bound_by;
};
// Counts per window (all micro-batches): the gradients' device-to-host
// copies, their accumulation (none for a folded last micro-batch), the
// parameters' fetches (forward and backward of every micro-batch for
// offloaded parameters, as with stage3_max_reuse_distance 0: an upper bound)
// and the updated parameters' upload, the optimizer's elements, the NVMe
// pipeline's state reads and writes and the parameters' NVMe traffic. The
// device optimizer (offload_optimizer none on a GPU) moves nothing; the
// sub-groups offload_optimizer.ratio steps on the device move their states,
// sums and parameters through the device's memory ("device_optimizer", at
// the device's copy bandwidth: the kernel's bound).
StepPrediction PredictStep(const Placement& placement, const LayoutSizes& sizes,
                           const TierPlan& plan, const StepRates& rates);

// The NVMe directories a config uses, optimizer's first, without duplicates
// (empty when nothing is placed on NVMe).
std::vector<std::string> UsedNvmePaths(const Config& config);

// Free space of the directories (statvfs), and the DRAM the plan may use:
// `dram_budget` when > 0, else DefaultDramBudget().
TierFacts MeasureTierFacts(int64_t hbm_budget, int64_t pinned_budget,
                           std::vector<std::string> nvme_paths, int64_t dram_budget = 0);
// Before a layout is built (it holds one entry per sub-group, in proportion
// to the model's elements): the parameters alone, sum of numel x dtype size
// before any gradient or optimizer state, against every tier together (HBM
// budget + pinned budget + DRAM available + NVMe free). More than that cannot
// fit whatever the placement: ResourceExhausted naming both, in bytes. With
// `world_size` ranks, one rank's share (1 / world_size) is what must fit. OK
// when the DRAM available is unknown (0).
Status CheckParamsCanFit(const std::vector<ParamRec>& params, const TierFacts& facts,
                         int world_size = 1);
// strata.dram_budget 0: MemAvailable less 10 % of it (at most 4 GiB);
// 0 when /proc/meminfo cannot be read (no limit).
int64_t DefaultDramBudget();

}  // namespace strata::scheduler
