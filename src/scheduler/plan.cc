#include "src/scheduler/plan.h"

#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <optional>

#include "src/common/host_memory.h"
#include "src/common/units.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/hyperparams.h"

namespace strata::scheduler {

Placement Placement::FromConfig(const Config& config) {
  const auto& zo = config.zero_optimization;
  Placement p;
  p.optimizer = zo.offload_optimizer.device;
  p.params = zo.offload_param.device;
  p.pin_optimizer_states = zo.offload_optimizer.pin_memory;
  p.pin_param_copies = zo.offload_param.pin_memory;
  p.optimizer_buffer_count = zo.offload_optimizer.buffer_count;
  p.param_buffer_count = zo.offload_param.buffer_count;
  p.max_live_parameters = zo.stage3_max_live_parameters;
  p.overlap_optimizer = config.strata.overlap_optimizer;
  p.delayed_param_update = config.strata.delayed_param_update;
  p.speculative_step =
      config.strata.speculative_step ? (*config.strata.speculative_step ? 1 : 0) : -1;
  p.gradient_accumulation_steps = std::max<int64_t>(1, config.gradient_accumulation_steps);
  p.grad_accumulator = config.strata.grad_accumulator;
  p.grad_tier = config.strata.grad_tier;
  p.optimizer_states = config.strata.optimizer_states;
  p.stage = zo.stage;
  p.sub_group_size = zo.sub_group_size;
  p.cpu_ratio = zo.offload_optimizer.ratio;
  p.cpu_ratio_auto = zo.offload_optimizer.ratio_auto;
  p.device_adam = config.optimizer.type == OptimizerType::kAdam ||
                  config.optimizer.type == OptimizerType::kAdamW;
  return p;
}

LayoutSizes LayoutSizes::Of(const Layout& layout) {
  LayoutSizes s;
  s.total_elems = layout.total_elems();
  s.total_param_bytes = layout.total_param_bytes();
  for (int m = 0; m < layout.num_modules(); ++m) s.module_param_bytes += layout.module(m).bytes();
  s.persistent_param_bytes = layout.persistent_param_bytes();
  s.max_module_bytes = layout.max_module_bytes();
  s.max_group_elems = layout.max_group_elems();
  s.grad_staging_bytes = layout.grad_staging_bytes();
  s.num_groups = static_cast<int64_t>(layout.num_groups());
  s.num_modules = layout.num_modules();
  s.state_elems = layout.partition_elems();
  s.param_elems = layout.param_elems();
  const auto [g0, g1] = layout.OwnedGroups(0);
  s.state_groups = static_cast<int64_t>(g1 - g0);
  return s;
}

int64_t TierPlan::nvme_bytes() const {
  for (const TierBudget& t : budgets)
    if (t.tier == "nvme") return t.needed_bytes;
  return 0;
}

namespace {

// Accumulates a tier's needed bytes with a description of each part.
struct TierSum {
  int64_t bytes = 0;
  std::vector<std::string> parts;
  void Add(int64_t b, std::string what) {
    bytes += b;
    parts.push_back(std::move(what));
  }
  TierBudget Budget(std::string tier, int64_t available) const {
    return {std::move(tier), bytes, available, fmt::format("{}", fmt::join(parts, " + "))};
  }
};

// Whether the window's gradients are summed in HBM (TierPlan::
// device_grad_accumulator), with `hbm_needed` bytes of HBM planned already.
void ChooseDeviceAccumulator(const Placement& pl, const LayoutSizes& s, const TierFacts& facts,
                             int64_t hbm_needed, TierPlan* plan) {
  plan->device_grad_accumulator = false;
  plan->device_accumulator_bytes = 0;
  if (pl.grad_accumulator == GradAccumulatorPlace::kHost || pl.device_optimizer ||
      pl.delayed_param_update || pl.gradient_accumulation_steps <= 1 || s.total_elems == 0)
    return;
  const int64_t bytes = kGradAccBytesPerElem * s.total_elems;
  auto choose = [&](std::string why) {
    plan->device_grad_accumulator = true;
    plan->device_accumulator_bytes = bytes;
    plan->grad_path =
        "the window's gradients summed in HBM, copied to the host once per window (" + why + ")";
  };
  if (pl.grad_accumulator == GradAccumulatorPlace::kDevice) {
    choose("strata.grad_accumulator device");
    return;
  }
  if (pl.host_device) return;  // the adds would run on the framework's thread
  if (facts.hbm_budget <= 0 || hbm_needed + bytes > facts.hbm_budget / 2) return;
  if (facts.d2h_pinned_gbps <= 0 || facts.accumulate_gbps <= 0) return;  // rates unknown
  // Per window: every micro-batch's gradients copied and added (8 + G bytes
  // per element each), against one fp32 copy and one fp32 pass (8 + 4).
  const auto e = static_cast<double>(s.total_elems);
  const double g = static_cast<double>(s.total_param_bytes) / e;
  const auto gas = static_cast<double>(pl.gradient_accumulation_steps);
  const double host_s =
      (gas * g * e / facts.d2h_pinned_gbps + gas * (8 + g) * e / facts.accumulate_gbps) * 1e-9;
  const double device_s = (4 * e / facts.d2h_pinned_gbps + 12 * e / facts.accumulate_gbps) * 1e-9;
  if (device_s < host_s)
    choose(
        fmt::format("{:.2f} ms of copies and accumulation per window instead of {:.2f} ms at "
                    "the measured rates",
                    device_s * 1e3, host_s * 1e3));
}

// The gradient path (plan.h, TierPlan::fold_last_micro_batch). `pinned_left`:
// the pinned budget left once the pools and parameter copies are placed.
void ChooseGradPath(const Placement& pl, const LayoutSizes& s, const TierFacts& facts,
                    int64_t pinned_left, TierPlan* plan) {
  plan->fold_last_micro_batch = false;
  plan->pin_grad_landing = false;
  plan->grad_landing_bytes = 0;
  if (plan->device_grad_accumulator) return;  // the sum is in HBM: nothing to fold
  if (pl.device_optimizer) {
    plan->grad_path = "gradients accumulate in HBM";
    return;
  }
  if (pl.delayed_param_update) {
    plan->grad_path = "delayed_param_update: the step reads the window's gradients during the next";
    return;
  }
  if (pl.fold_override == 0 || s.total_elems == 0) {
    plan->grad_path = s.total_elems == 0 ? "no parameters"
                      : pl.world_size > 1
                          ? "fold off (several ranks: the reduction reads one accumulator)"
                          : "fold off (developer override)";
    return;
  }
  const int64_t landing = s.total_param_bytes;
  const bool pin = landing <= pinned_left;
  // Bytes per element and window the fold saves (plan.h).
  const double g = static_cast<double>(s.total_param_bytes) / static_cast<double>(s.total_elems);
  const double saved_per_elem = pl.gradient_accumulation_steps <= 1 ? 20.0 - g : 8.0 - g;
  const double saved_bytes = saved_per_elem * static_cast<double>(s.total_elems);
  // What a pageable landing buffer adds to the copy, at the measured rates.
  double penalty_s = 0;
  if (!pin) {
    penalty_s = (facts.d2h_pageable_gbps > 0 && facts.d2h_pinned_gbps > 0)
                    ? static_cast<double>(landing) * 1e-9 *
                          std::max(0.0, 1.0 / facts.d2h_pageable_gbps - 1.0 / facts.d2h_pinned_gbps)
                    : -1;  // unknown
  }
  const double saved_s =
      facts.accumulate_gbps > 0 ? saved_bytes * 1e-9 / facts.accumulate_gbps : -1;  // unknown
  if (pl.fold_override != 1) {
    if (saved_s < 0 || penalty_s < 0) {
      plan->grad_path = "rates not measured";
      return;
    }
    if (saved_s <= penalty_s) {
      plan->grad_path = fmt::format(
          "folding would save {:.2f} ms of accumulation at {:.1f} GB/s but cost {:.2f} ms of "
          "pageable copy",
          saved_s * 1e3, facts.accumulate_gbps, penalty_s * 1e3);
      return;
    }
  }
  plan->fold_last_micro_batch = true;
  plan->pin_grad_landing = pin;
  plan->grad_landing_bytes = landing;
  plan->grad_path =
      pl.fold_override == 1
          ? "last micro-batch folded into the optimizer (developer override)"
          : fmt::format(
                "last micro-batch folded into the optimizer: {:.0f} B/element less, {:.2f} "
                "ms per window at {:.1f} GB/s{}",
                saved_per_elem, saved_s * 1e3, facts.accumulate_gbps,
                pin ? "" : fmt::format(", pageable copy +{:.2f} ms", penalty_s * 1e3));
}

// What each tier's placement reads: the inputs, and what is derived from them
// once.
struct TierInputs {
  const Placement& pl;
  const LayoutSizes& s;
  const TierFacts& facts;
  bool grads_on_nvme;
  bool grads_in_hbm;  // TierPlan::grads_in_hbm
  // This rank's optimizer states (data parallelism: its partition) and their
  // bytes; the fp32 gradient accumulator's bytes.
  int64_t state_groups;
  int64_t states;
  int64_t accumulator;
  // Placement::device_step_groups: their elements, and their states' bytes
  // in HBM (not in `states`).
  int64_t device_elems;
  int64_t device_states;
  // Stage 3 with several ranks: the parameters are partitioned (offload_param
  // cpu: the host copy holds this rank's part; none: the device block).
  bool partitioned;
  // What crosses PCIe every step: the updated parameters (offload_param none
  // uploads them, cpu fetches from them, nvme fetches from them while the
  // step overlaps the forward pass), with the array they swap with at
  // commit (cpu: the host copy; none: the mirror), so that both stay pinned.
  // offload_param nvme: none (the write-back buffers; with several ranks
  // each writes its pieces of the modules the same way).
  bool swaps;
  bool copies_all;
  // The host arrays: every parameter's bytes, or this rank's part of them.
  int64_t host_param_bytes;
};

// The elements of the first Placement::device_step_groups sub-groups.
int64_t DeviceStepElems(const Placement& pl, const LayoutSizes& s) {
  if (pl.device_step_groups <= 0) return 0;
  const int64_t state_elems = s.state_elems > 0 ? s.state_elems : s.total_elems;
  return std::min(state_elems, pl.device_step_groups * std::max<int64_t>(1, s.max_group_elems));
}

// offload_param cpu with sub-groups stepped on the device: the device
// buffer their parameters are copied out into (their share of the
// parameter bytes, with a page a module for the modules' alignment).
int64_t DeviceStepParamBytes(const TierInputs& in) {
  const LayoutSizes& s = in.s;
  if (in.device_elems <= 0 || s.total_elems <= 0) return 0;
  const auto share = static_cast<double>(in.device_elems) / static_cast<double>(s.total_elems);
  return std::min(
      s.total_param_bytes,
      static_cast<int64_t>(std::ceil(share * static_cast<double>(s.total_param_bytes))) +
          s.num_modules * kIoAlign);
}

// "optimizer states 1.2 GiB", with the format when it is not fp32.
std::string StatesRow(const TierInputs& in) {
  return "optimizer states " + FormatBytes(in.states) +
         (in.pl.optimizer_states == OptimizerStates::kFp32
              ? ""
              : fmt::format(" ({})", OptimizerStatesName(in.pl.optimizer_states)));
}

TierInputs InputsOf(const Placement& pl, const LayoutSizes& s, const TierFacts& facts,
                    GradTier grad_tier) {
  const int64_t state_elems = s.state_elems > 0 ? s.state_elems : s.total_elems;
  const int64_t device_elems = DeviceStepElems(pl, s);
  const cpu_adam::StateFormat f = pl.optimizer_states;
  return TierInputs{
      .pl = pl,
      .s = s,
      .facts = facts,
      .grads_on_nvme = grad_tier == GradTier::kNvme,
      .grads_in_hbm = grad_tier == GradTier::kHbm,
      .state_groups = s.state_groups > 0 ? s.state_groups : s.num_groups,
      .states = StateArrayBytes(f, state_elems - device_elems),
      .accumulator = kGradAccBytesPerElem * s.total_elems,
      .device_elems = device_elems,
      .device_states = StateArrayBytes(f, device_elems),
      .partitioned = s.partitioned_param_bytes > 0,
      .swaps = pl.params == OffloadDevice::kCpu || pl.param_mirror(),
      .copies_all = pl.params != OffloadDevice::kNvme,
      .host_param_bytes =
          s.partitioned_param_bytes > 0 ? s.partitioned_param_bytes : s.total_param_bytes,
  };
}

// The parameters' HBM: their block (offload_param none), or this rank's part
// and the gather buffers (none, partitioned), or the persistent modules'
// block; and slots of plan.slot_bytes for the other modules' copies. Returns
// the number of parameter slots.
int64_t AddHbmParameters(const TierInputs& in, const TierPlan& plan, TierSum* hbm) {
  const Placement& pl = in.pl;
  const LayoutSizes& s = in.s;
  if (pl.params == OffloadDevice::kNone && !in.partitioned) {
    hbm->Add(s.total_param_bytes, "parameters " + FormatBytes(s.total_param_bytes));
    return 0;
  }
  if (pl.params == OffloadDevice::kNone) {
    // This rank's part, and the buffers modules are gathered ahead into
    // (the others are gathered straight into their slots).
    const int64_t ahead = std::max<int64_t>(0, pl.param_buffer_count - 1);
    hbm->Add(s.partitioned_param_bytes,
             fmt::format("parameters (this rank's part of {}) {}", pl.world_size,
                         FormatBytes(s.partitioned_param_bytes)));
    hbm->Add(ahead * s.max_module_bytes,
             fmt::format("parameter gather {} x {}", ahead, FormatBytes(s.max_module_bytes)));
  }
  // Working set: the live-parameter limit, but at least two modules (the
  // one in use and one prefetched), in whole slots.
  const int64_t n = s.total_elems;
  const int64_t elem_size = n ? s.total_param_bytes / n : 2;
  const int64_t offloaded = s.total_param_bytes - s.persistent_param_bytes;
  const int64_t live =
      std::min(offloaded, std::max(pl.max_live_parameters * elem_size, 2 * s.max_module_bytes));
  const int64_t param_slots =
      offloaded > 0 ? std::max<int64_t>(1, (live + plan.slot_bytes - 1) / plan.slot_bytes) : 0;
  hbm->Add(s.persistent_param_bytes,
           "persistent parameters " + FormatBytes(s.persistent_param_bytes));
  hbm->Add(param_slots * plan.slot_bytes,
           fmt::format("parameter slots {} x {}", param_slots, FormatBytes(plan.slot_bytes)));
  return param_slots;
}

// HBM, laid out by purpose (the device layer never has to find a large free
// block later): the parameters (AddHbmParameters), two gradient slots, the
// optimizer states and accumulator when they stay on the device, the
// collectives' staging, and the window's gradient accumulator when it is
// summed in HBM (ChooseDeviceAccumulator).
TierBudget PlanHbm(const TierInputs& in, TierPlan* plan) {
  const Placement& pl = in.pl;
  TierSum hbm;
  plan->slot_bytes = std::max<int64_t>(kTensorAlign, in.s.max_module_bytes);
  const int64_t param_slots = AddHbmParameters(in, *plan, &hbm);
  // Gradient buffers: one written, one offloading.
  constexpr int64_t kGradSlots = 2;
  plan->device_slots = param_slots + kGradSlots;
  hbm.Add(kGradSlots * plan->slot_bytes,
          fmt::format("gradient slots {} x {}", kGradSlots, FormatBytes(plan->slot_bytes)));
  if (pl.optimizer == OffloadDevice::kNone) hbm.Add(in.states, StatesRow(in));
  if (in.device_elems > 0) {
    hbm.Add(in.device_states,
            fmt::format("optimizer states of the first {} sub-groups {} (stepped on the device)",
                        pl.device_step_groups, FormatBytes(in.device_states)));
    hbm.Add(kGradAccBytesPerElem * in.device_elems,
            "their gradient sums " + FormatBytes(kGradAccBytesPerElem * in.device_elems));
    if (pl.params == OffloadDevice::kCpu) {
      const int64_t bytes = DeviceStepParamBytes(in);
      hbm.Add(bytes, "their updated parameters " + FormatBytes(bytes) + " (copied to the host)");
    }
  }
  if (pl.device_optimizer)
    hbm.Add(in.accumulator, "gradient accumulator " + FormatBytes(in.accumulator));
  if (pl.collective_staging_bytes > 0)
    hbm.Add(pl.collective_staging_bytes,
            fmt::format("collective staging {} ({} ranks)",
                        FormatBytes(pl.collective_staging_bytes), pl.world_size));
  if (in.grads_in_hbm) {
    plan->grads_in_hbm = true;
    plan->device_grad_accumulator = false;
    hbm.Add(in.accumulator, "window gradient sums " + FormatBytes(in.accumulator) +
                                " (kept until the step reads them)");
  } else {
    ChooseDeviceAccumulator(pl, in.s, in.facts, hbm.bytes, plan);
  }
  if (plan->device_grad_accumulator)
    hbm.Add(plan->device_accumulator_bytes,
            "window gradient accumulator " + FormatBytes(plan->device_accumulator_bytes));
  return hbm.Budget("hbm", in.facts.hbm_budget);
}

// The pinned pools every step needs: gradient staging, the optimizer
// pipeline (offload_optimizer nvme), the parameter gather, fetch and
// write-back buffers, and the optimizer states when pin_memory asks.
void AddPinnedPools(const TierInputs& in, TierPlan* plan, TierSum* pinned) {
  const Placement& pl = in.pl;
  const LayoutSizes& s = in.s;
  // (The device optimizer keeps the gradients in HBM: no staging.)
  if (!pl.device_optimizer)
    pinned->Add(kGradStagingBuffers * s.grad_staging_bytes,
                "gradient staging " + FormatBytes(kGradStagingBuffers * s.grad_staging_bytes));
  // The parameter pools' buffers: the largest module, page-rounded (the
  // NVMe reads' unit). (offload_param nvme: the fetch pool below receives
  // the gathers.)
  const int64_t module_buffer = IoBytes(std::max<int64_t>(s.max_module_bytes, kIoAlign));
  const bool gather_pool = in.partitioned && pl.params == OffloadDevice::kCpu;
  const bool nvme_params = pl.params == OffloadDevice::kNvme;
  const bool pinned_states = pl.optimizer == OffloadDevice::kCpu && pl.pin_optimizer_states;
  if (pl.optimizer == OffloadDevice::kNvme) {
    const cpu_adam::StateFormat f = pl.optimizer_states;
    const int64_t count = std::max<int64_t>(1, pl.optimizer_buffer_count);
    int64_t per = OptimizerBufferBytes(s.max_group_elems, in.grads_on_nvme, f);
    // A pipeline of whole sub-groups the budget does not hold streams them
    // in pieces: the largest (a multiple of kStatePieceQuantum) whose
    // buffers fit beside the fixed pools, at least one quantum.
    const int64_t fixed =
        pinned->bytes + (gather_pool ? pl.param_buffer_count * module_buffer : 0) +
        (nvme_params ? (pl.param_buffer_count + kParamWriteBuffers) * module_buffer : 0);
    std::string pieces;
    if (in.facts.pinned_budget > 0 && fixed + count * per > in.facts.pinned_budget &&
        s.max_group_elems > kStatePieceQuantum) {
      const int64_t room = std::max<int64_t>(0, in.facts.pinned_budget - fixed) / count;
      const int64_t per_elem = OptimizerBufferBytes(kStatePieceQuantum, in.grads_on_nvme, f);
      int64_t p = std::max<int64_t>(1, room / std::max<int64_t>(1, per_elem)) * kStatePieceQuantum;
      while (p > kStatePieceQuantum && OptimizerBufferBytes(p, in.grads_on_nvme, f) > room)
        p -= kStatePieceQuantum;
      p = std::min(p, s.max_group_elems);
      if (p < s.max_group_elems) {
        plan->state_piece_elems = p;
        per = OptimizerBufferBytes(p, in.grads_on_nvme, f);
        pieces = fmt::format(", sub-groups of {} elements in pieces of {}{}", s.max_group_elems, p,
                             per > room ? ": the smallest pipeline" : "");
      }
    }
    plan->optimizer_buffer_bytes = per;
    pinned->Add(count * per,
                fmt::format("optimizer pipeline {} x {}{}{}", count, FormatBytes(per),
                            in.grads_on_nvme ? " (states and gradients)" : "", pieces));
  }
  if (gather_pool)
    pinned->Add(
        pl.param_buffer_count * module_buffer,
        fmt::format("parameter gather {} x {}", pl.param_buffer_count, FormatBytes(module_buffer)));
  if (nvme_params) {
    pinned->Add(
        pl.param_buffer_count * module_buffer,
        fmt::format("parameter fetch {} x {}", pl.param_buffer_count, FormatBytes(module_buffer)));
    const int64_t per = module_buffer;
    plan->param_write_bytes = kParamWriteBuffers * per;
    pinned->Add(plan->param_write_bytes,
                fmt::format("parameter write-back {} x {}", kParamWriteBuffers, FormatBytes(per)));
  }
  if (pinned_states) pinned->Add(in.states, StatesRow(in));
  if (in.grads_in_hbm) {
    // Chunks of the sums on their way to the step (whole sub-groups when
    // they are smaller), in whole norm blocks.
    plan->grad_chunk_elems = kSumChunkElems;
    const int64_t elems = std::clamp<int64_t>(s.max_group_elems, 1, kSumChunkElems);
    const int64_t bytes = kSumBuffers * IoBytes(kGradAccBytesPerElem * elems);
    pinned->Add(bytes, fmt::format("gradient sums from HBM {} x {}", kSumBuffers,
                                   FormatBytes(bytes / kSumBuffers)));
  }
}

// The parameter copies that cross PCIe every step (TierInputs::swaps,
// copies_all): pinned with offload_param.pin_memory or when `pinned_left`
// holds them; else the pinned row says why not (DRAM holds them).
void PinParamCopies(const TierInputs& in, int64_t pinned_left, TierPlan* plan, TierSum* pinned) {
  plan->param_copy_bytes = in.copies_all ? (in.swaps ? 2 : 1) * in.host_param_bytes : 0;
  plan->pin_param_copies = in.pl.pin_param_copies || plan->param_copy_bytes <= pinned_left;
  const std::string copies =
      in.swaps ? fmt::format("parameter copies 2 x {}", FormatBytes(in.host_param_bytes))
               : fmt::format("updated parameters {}", FormatBytes(in.host_param_bytes));
  if (!in.copies_all) {
    // Nothing to place.
  } else if (plan->pin_param_copies) {
    // (The device optimizer updates the parameters in HBM: the host copy
    // only carries initial values and loaded checkpoints there.)
    pinned->Add(plan->param_copy_bytes,
                copies + (in.pl.device_optimizer ? " (uploaded at start and at loads)"
                                                 : " (cross PCIe every step)"));
  } else {
    pinned->parts.push_back(fmt::format("not pinned: {} (budget left {})", copies,
                                        FormatBytes(std::max<int64_t>(0, pinned_left))));
  }
}

// The gradient path (ChooseGradPath, or the sums on NVMe) with what the
// pinned budget leaves after the copies, and its landing buffer when it is
// pinned.
void PlanGradPath(const TierInputs& in, int64_t pinned_left, TierPlan* plan, TierSum* pinned) {
  if (in.grads_on_nvme) {
    plan->grad_path = "the window's gradient sums on NVMe, one shard per sub-group";
  } else if (in.grads_in_hbm) {
    plan->grad_path =
        "the window's gradient sums kept in HBM; the checks and the step copy each sub-group's "
        "to the host a chunk at a time";
  } else {
    ChooseGradPath(in.pl, in.s, in.facts,
                   pinned_left - (plan->pin_param_copies ? plan->param_copy_bytes : 0), plan);
  }
  if (plan->fold_last_micro_batch && plan->pin_grad_landing)
    pinned->Add(
        plan->grad_landing_bytes,
        "gradient landing " + FormatBytes(plan->grad_landing_bytes) + " (" + plan->grad_path + ")");
}

// The window's sums in HBM land in a pinned accumulator when it fits.
void PinGradAccumulator(const TierInputs& in, TierPlan* plan, TierSum* pinned) {
  plan->pin_grad_accumulator = false;
  if (plan->device_grad_accumulator && !in.grads_on_nvme && !in.pl.device_optimizer &&
      !in.pl.delayed_param_update) {
    const int64_t left =
        in.facts.pinned_budget > 0 ? in.facts.pinned_budget - pinned->bytes : INT64_MAX;
    // (Page-locked in whole pages.)
    const int64_t locked = IoBytes(in.accumulator);
    if (locked <= left) {
      plan->pin_grad_accumulator = true;
      pinned->Add(locked,
                  "gradient accumulator " + FormatBytes(locked) + " (the window's sums copied in)");
    }
  }
}

// Pinned: the pools (+ the optimizer states when pin_memory), then from what
// the budget leaves the parameter copies, the gradient landing buffer and
// the window's accumulator.
TierBudget PlanPinned(const TierInputs& in, TierPlan* plan) {
  TierSum pinned;
  AddPinnedPools(in, plan, &pinned);
  const int64_t pinned_left =
      in.facts.pinned_budget > 0 ? in.facts.pinned_budget - pinned.bytes : INT64_MAX;
  PinParamCopies(in, pinned_left, plan, &pinned);
  PlanGradPath(in, pinned_left, plan, &pinned);
  PinGradAccumulator(in, plan, &pinned);
  return pinned.Budget("pinned", in.facts.pinned_budget);
}

// NVMe: two versions of everything placed there (atomic steps), one of the
// gradient sums; a row only when the plan has NVMe paths.
std::optional<TierBudget> PlanNvme(const TierInputs& in, TierPlan* plan) {
  const Placement& pl = in.pl;
  const LayoutSizes& s = in.s;
  TierSum disk;
  if (pl.optimizer == OffloadDevice::kNvme)
    disk.Add(
        2 * in.states,
        "optimizer states 2 x " + FormatBytes(in.states) +
            (in.pl.speculate() ? " (the speculative step writes the inactive one during backward)"
                               : ""));
  if (pl.params == OffloadDevice::kNvme && in.partitioned) {
    // Each module's piece of this rank's part, page-rounded.
    const int64_t part = s.partitioned_param_bytes + s.num_modules * kIoAlign;
    disk.Add(2 * part, fmt::format("parameters 2 x {} (this rank's part of {})", FormatBytes(part),
                                   pl.world_size));
  } else if (pl.params == OffloadDevice::kNvme) {
    disk.Add(2 * s.total_param_bytes, "parameters 2 x " + FormatBytes(s.total_param_bytes));
  }
  if (in.grads_on_nvme) {
    // One version: a failed step drops the window's gradients anyway.
    plan->grad_nvme_bytes = kGradAccBytesPerElem * s.total_elems;
    disk.Add(plan->grad_nvme_bytes, "gradients " + FormatBytes(plan->grad_nvme_bytes));
  }
  if (in.facts.nvme_paths.empty()) return std::nullopt;
  // What the swap store adds (nvme.h, SwapStore): every shard (a sub-group's
  // states, a module's parameters, a sub-group's gradient sums) takes whole
  // pages, each piece of a streamed sub-group too; and over several paths a
  // shard's stripes (nvme::kDefaultSwapStripeUnit each) are spread over the files, so one
  // file may take up to a stripe of each shard more than its share: the
  // headroom is each shard's bytes up to a stripe, per path. One path has
  // none (the file holds exactly its shards).
  struct Shards {
    int64_t count = 0, bytes = 0;  // how many, and the largest one's bytes
  };
  std::vector<Shards> shards;
  int64_t pages = 0;  // page rounding: at most a page per shard (or piece)
  if (pl.optimizer == OffloadDevice::kNvme) {
    const int64_t group_states =
        StateArrayBytes(pl.optimizer_states, std::max<int64_t>(1, s.max_group_elems));
    const int64_t pieces =
        plan->state_piece_elems > 0
            ? (s.max_group_elems + plan->state_piece_elems - 1) / plan->state_piece_elems
            : 1;
    shards.push_back({2 * in.state_groups, group_states + pieces * kIoAlign});
    pages += 2 * in.state_groups * pieces;
  }
  if (pl.params == OffloadDevice::kNvme)  // (the modules' bytes are page-aligned already)
    shards.push_back({2 * s.num_modules, s.max_module_bytes});
  if (in.grads_on_nvme) {
    shards.push_back({s.num_groups, IoBytes(kGradAccBytesPerElem * s.max_group_elems)});
    pages += s.num_groups;
  }
  if (pages > 0)
    disk.Add(pages * kIoAlign, fmt::format("page rounding {} ({} shards of whole {}-byte pages)",
                                           FormatBytes(pages * kIoAlign), pages, kIoAlign));
  const auto paths = static_cast<int64_t>(in.facts.nvme_paths.size());
  if (paths > 1) {
    int64_t headroom = 0;
    for (const Shards& sh : shards)
      headroom += paths * sh.count * std::min<int64_t>(sh.bytes, nvme::kDefaultSwapStripeUnit);
    disk.Add(headroom,
             fmt::format("striping headroom {} (up to a {} stripe per shard per path)",
                         FormatBytes(headroom), FormatBytes(nvme::kDefaultSwapStripeUnit)));
  }
  TierBudget b = disk.Budget("nvme", in.facts.nvme_available);
  b.detail += fmt::format(" on {}", fmt::join(in.facts.nvme_paths, ", "));
  return b;
}

// DRAM (pageable): gradient accumulator or cache, what the pinned budget did
// not hold (parameter copies, landing buffer), host states and parameters.
// A pageable landing buffer that DRAM cannot hold turns the fold off.
TierBudget PlanDram(const TierInputs& in, TierPlan* plan) {
  const Placement& pl = in.pl;
  const int64_t host_param_bytes = in.host_param_bytes;
  TierSum dram;
  if (in.grads_on_nvme) {
    plan->grad_cache_bytes = kGradCacheSlots * GradSlotBytes(in.s.max_group_elems);
    dram.Add(plan->grad_cache_bytes, fmt::format("gradient cache {} sub-groups {}", kGradCacheSlots,
                                                 FormatBytes(plan->grad_cache_bytes)));
  } else if (!pl.device_optimizer && !plan->pin_grad_accumulator && !in.grads_in_hbm) {
    dram.Add(in.accumulator, "gradient accumulator " + FormatBytes(in.accumulator));
  }
  if (in.copies_all && !plan->pin_param_copies)
    dram.Add(host_param_bytes, "updated parameters " + FormatBytes(host_param_bytes));
  if (pl.optimizer == OffloadDevice::kCpu && !pl.pin_optimizer_states)
    dram.Add(in.states, StatesRow(in));
  if (pl.params == OffloadDevice::kCpu && !plan->pin_param_copies)
    dram.Add(host_param_bytes, "parameters " + FormatBytes(host_param_bytes));
  if (pl.param_mirror() && !plan->pin_param_copies)
    dram.Add(host_param_bytes,
             "parameter mirror (overlap_optimizer) " + FormatBytes(host_param_bytes));
  if (pl.delayed_param_update)
    dram.Add(in.accumulator,
             "second gradient accumulator (delayed_param_update) " + FormatBytes(in.accumulator));
  if (plan->fold_last_micro_batch && !plan->pin_grad_landing) {
    if (in.facts.dram_available > 0 &&
        dram.bytes + plan->grad_landing_bytes > in.facts.dram_available) {
      // A pageable landing buffer must not make a plan that fits fail.
      plan->fold_last_micro_batch = false;
      plan->grad_path =
          "no DRAM left for a landing buffer of " + FormatBytes(plan->grad_landing_bytes);
      plan->grad_landing_bytes = 0;
    } else {
      dram.Add(plan->grad_landing_bytes, "gradient landing " +
                                             FormatBytes(plan->grad_landing_bytes) + " (" +
                                             plan->grad_path + ")");
    }
  }
  if (!plan->fold_last_micro_batch && !pl.device_optimizer && !in.grads_on_nvme && !in.grads_in_hbm)
    dram.parts.push_back("last micro-batch accumulated (" + plan->grad_path + ")");
  // The speculative step's spare: what DRAM holds after the rest, up to
  // every state.
  plan->speculation_elems = 0;
  if (pl.speculate() && pl.optimizer == OffloadDevice::kNvme) {
    plan->speculation_elems = in.s.total_elems;
  } else if (pl.speculate() && !in.grads_in_hbm) {
    // (The sums in HBM reach the host only at the step: nothing to speculate.)
    // A copy of the last elements' states in their format (whole bytes per
    // element here; int8's spare starts on a block, as HostOptimizer's).
    const cpu_adam::StateFormat f = pl.optimizer_states;
    const auto per_elem = static_cast<int64_t>(
        std::ceil(cpu_adam::StateBytesPerParam(f, cpu_adam::Algorithm::kAdamW)));
    // (Sub-groups stepped on the device are not speculated: the rest.)
    int64_t elems = in.s.total_elems - in.device_elems;
    if (in.facts.dram_available > 0)
      elems = std::clamp<int64_t>((in.facts.dram_available - dram.bytes) / per_elem, 0, elems);
    if (f == cpu_adam::StateFormat::kInt8 && elems < in.s.total_elems) {
      const auto block = static_cast<int64_t>(cpu_adam::kStateBlock);
      elems = in.s.total_elems - (in.s.total_elems - elems + block - 1) / block * block;
    }
    plan->speculation_elems = elems;
    const int64_t spare_bytes = StateArrayBytes(f, elems);
    if (elems > 0)
      dram.Add(spare_bytes,
               fmt::format("speculative step's spare states {}{}", FormatBytes(spare_bytes),
                           elems < in.s.total_elems
                               ? fmt::format(" (the last {:.0f} % of the elements)",
                                             100.0 * static_cast<double>(elems) /
                                                 static_cast<double>(in.s.total_elems))
                               : ""));
  }
  return dram.Budget("dram", in.facts.dram_available);
}

// Whether every tier holds what it must, and the host memory the plan
// allocates (pinned + dram; on the host device the hbm row too).
void TallyBudgets(const Placement& pl, TierPlan* plan) {
  for (const TierBudget& t : plan->budgets) {
    if (t.available_bytes > 0 && t.needed_bytes > t.available_bytes) plan->fits = false;
    if (t.tier == "pinned" || t.tier == "dram" || (t.tier == "hbm" && pl.host_device))
      plan->host_bytes += t.needed_bytes;
  }
}

// The plan with the window's gradient sums in DRAM, on NVMe or in HBM
// (`grad_tier`, resolved): each tier in turn, the later ones placing what
// the earlier ones left.
TierPlan ComputeTierPlanWith(const Placement& pl, const LayoutSizes& s, const TierFacts& facts,
                             GradTier grad_tier) {
  const TierInputs in = InputsOf(pl, s, facts, grad_tier);
  TierPlan plan;
  plan.placement = pl;
  plan.grads_on_nvme = in.grads_on_nvme;
  plan.budgets.push_back(PlanHbm(in, &plan));
  plan.budgets.push_back(PlanPinned(in, &plan));
  if (std::optional<TierBudget> nvme = PlanNvme(in, &plan)) plan.budgets.push_back(*nvme);
  plan.budgets.push_back(PlanDram(in, &plan));
  TallyBudgets(pl, &plan);
  return plan;
}

int64_t NeededIn(const TierPlan& p, std::string_view tier) {
  for (const TierBudget& t : p.budgets)
    if (t.tier == tier) return t.needed_bytes;
  return 0;
}

}  // namespace

namespace {

TierPlan ComputeTierPlanOf(const Placement& pl, const LayoutSizes& s, const TierFacts& facts) {
  const bool nvme_possible = pl.optimizer == OffloadDevice::kNvme && !pl.delayed_param_update &&
                             !pl.device_optimizer && s.total_elems > 0;
  const bool hbm_possible = pl.optimizer == OffloadDevice::kCpu && !pl.delayed_param_update &&
                            !pl.device_optimizer && pl.world_size <= 1 && s.total_elems > 0;
  if (nvme_possible && pl.grad_tier == GradTier::kNvme)
    return ComputeTierPlanWith(pl, s, facts, GradTier::kNvme);
  if (hbm_possible && pl.grad_tier == GradTier::kHbm)
    return ComputeTierPlanWith(pl, s, facts, GradTier::kHbm);
  TierPlan plan = ComputeTierPlanWith(pl, s, facts, GradTier::kDram);
  if (pl.grad_tier != GradTier::kAuto || facts.dram_available <= 0 ||
      NeededIn(plan, "dram") <= facts.dram_available)
    return plan;
  // DRAM is the faster tier for the sums (no NVMe traffic for them, no
  // second pass over PCIe): kept unless the DRAM budget cannot hold them.
  const std::string why = fmt::format(
      " (the fp32 accumulator of {} does not fit the DRAM budget of {})",
      FormatBytes(kGradAccBytesPerElem * s.total_elems), FormatBytes(facts.dram_available));
  if (nvme_possible) {
    TierPlan nvme = ComputeTierPlanWith(pl, s, facts, GradTier::kNvme);
    if (NeededIn(nvme, "dram") >= NeededIn(plan, "dram")) return plan;  // the cache needs as much
    nvme.grad_path += why;
    return nvme;
  }
  if (hbm_possible) {
    TierPlan hbm = ComputeTierPlanWith(pl, s, facts, GradTier::kHbm);
    // Only where that makes the plan fit (the HBM budget holds them).
    if (!hbm.fits) return plan;
    hbm.grad_path += why;
    return hbm;
  }
  return plan;
}

// Why offload_optimizer.ratio cannot split this placement ("" if it can).
std::string RatioRefusal(const Placement& pl, const TierPlan& plan) {
  if (pl.stage != 3) return fmt::format("it needs zero_optimization.stage 3 (it is {})", pl.stage);
  if (pl.optimizer != OffloadDevice::kCpu)
    return fmt::format(
        "it splits the CPU optimizer's states (offload_optimizer.device \"cpu\"; "
        "it is \"{}\")",
        OffloadDeviceName(pl.optimizer));
  if (pl.params == OffloadDevice::kNvme)
    return "the device step's parameters go to the device block or the host copy "
           "(offload_param.device \"none\" or \"cpu\"; it is \"nvme\")";
  if (pl.world_size > 1)
    return fmt::format("it applies to one rank (this run has {})", pl.world_size);
  if (pl.delayed_param_update) return "not with strata.delayed_param_update";
  if (!pl.device_adam) return "the device optimizer runs Adam and AdamW only (optimizer.type)";
  if (plan.grads_in_hbm || plan.grads_on_nvme)
    return "the window's sums are not in DRAM (strata.grad_tier)";
  return "";
}

}  // namespace

// offload_optimizer.ratio "auto" with measured rates: the fewest of the
// first `most` sub-groups (those half the HBM budget holds) whose split
// gives a predicted bound (PredictStep, at the facts' rates) within 2 % of
// the best any count up to `most` gives: more sub-groups on the device
// take HBM from the framework without shortening the step once another
// resource (PCIe fetches, the device's own memory) is the bound. Up to 64
// counts are evaluated, evenly spaced. Without the CPU optimizer's rate:
// `most`. `why` says what the rates gave.
int64_t FewestSubGroupsForTheBound(const Placement& given, const LayoutSizes& s,
                                   const TierFacts& facts, int64_t most, std::string* why) {
  if (most <= 0 || !(facts.adam_elems_per_s > 0)) return most;
  StepRates r;
  r.h2d_gbps = facts.h2d_gbps;
  r.d2h_gbps = facts.d2h_pinned_gbps;
  r.accumulate_gbps = facts.accumulate_gbps;
  r.adam_elems_per_s = facts.adam_elems_per_s;
  r.device_gbps = facts.device_copy_gbps;
  Placement pl = given;
  std::vector<std::pair<int64_t, double>> bounds;  // (count, predicted bound)
  const int64_t step = std::max<int64_t>(1, (most + 63) / 64);
  for (int64_t k = 0;; k = std::min(most, k + step)) {
    pl.device_step_groups = k;
    TierPlan t = ComputeTierPlanOf(pl, s, facts);
    t.device_step_elems = k > 0 ? DeviceStepElems(pl, s) : 0;
    if (t.fits) bounds.push_back({k, PredictStep(pl, s, t, r).bound_s});
    if (k == most) break;
  }
  if (bounds.empty()) return most;
  double best = bounds[0].second;
  for (const auto& [k, b] : bounds) best = std::min(best, b);
  for (const auto& [k, b] : bounds)
    if (b <= best * 1.02) {
      *why = fmt::format(
          "; the predicted bound {:.3g} s ({:.3g} s with every sub-group on the CPU){}", b,
          bounds[0].second,
          k < most ? fmt::format(", and more sub-groups in HBM (up to {}, what half the budget "
                                 "holds) would not shorten it",
                                 most)
                   : "");
      return k;
    }
  return most;
}

TierPlan ComputeTierPlan(const Placement& given, const LayoutSizes& s, const TierFacts& facts) {
  Placement pl = given;
  pl.device_step_groups = 0;
  TierPlan plan = ComputeTierPlanOf(pl, s, facts);
  if (!pl.cpu_ratio_auto && pl.cpu_ratio >= 1.0) return plan;
  const std::string ratio =
      pl.cpu_ratio_auto ? std::string("\"auto\"") : fmt::format("{}", pl.cpu_ratio);
  const std::string refusal = RatioRefusal(pl, plan);
  const int64_t groups = s.state_groups > 0 ? s.state_groups : s.num_groups;
  std::string by_rates;  // "auto": what the rates said
  if (!refusal.empty()) {
    plan.device_step = fmt::format(
        "offload_optimizer.ratio {} not applied: {}; every sub-group "
        "is stepped on the CPU",
        ratio, refusal);
    return plan;
  }
  int64_t k = 0;
  if (!pl.cpu_ratio_auto) {
    k = std::min<int64_t>(
        groups - 1, static_cast<int64_t>(
                        std::floor((1.0 - pl.cpu_ratio) * static_cast<double>(groups) + 1e-9)));
  } else if (pl.host_device) {
    plan.device_step =
        "offload_optimizer.ratio \"auto\": every sub-group on the CPU (the host device's Adam "
        "runs on the framework's thread)";
    return plan;
  } else if (facts.hbm_budget > 0) {
    // As many as half the HBM budget holds beside the rest of the plan (the
    // other half is left for the framework's workspaces, as for the device
    // accumulator).
    const cpu_adam::StateFormat f = pl.optimizer_states;
    const int64_t group = std::max<int64_t>(1, s.max_group_elems);
    int64_t per_group = StateArrayBytes(f, group) + kGradAccBytesPerElem * group;
    if (pl.params == OffloadDevice::kCpu && s.total_elems > 0)  // (their copy-out buffer)
      per_group += (s.total_param_bytes + s.total_elems - 1) / s.total_elems * group;
    const int64_t room = facts.hbm_budget / 2 - NeededIn(plan, "hbm");
    k = std::clamp<int64_t>(room / per_group, 0, groups - 1);
    k = FewestSubGroupsForTheBound(pl, s, facts, k, &by_rates);
  }
  for (; k > 0; --k) {
    pl.device_step_groups = k;
    TierPlan split = ComputeTierPlanOf(pl, s, facts);
    if (!split.fits && pl.cpu_ratio_auto) continue;
    split.device_step_groups = k;
    split.device_step_elems = DeviceStepElems(pl, s);
    split.device_step = fmt::format(
        "offload_optimizer.ratio {}: the first {} of {} sub-groups ({} elements, {:.1f} %) keep "
        "their states in HBM and are stepped on the device{}",
        ratio, k, groups, split.device_step_elems,
        100.0 * static_cast<double>(split.device_step_elems) /
            static_cast<double>(
                std::max<int64_t>(1, s.state_elems > 0 ? s.state_elems : s.total_elems)),
        by_rates);
    return split;
  }
  if (!by_rates.empty()) {
    plan.device_step = fmt::format(
        "offload_optimizer.ratio \"auto\": every sub-group is stepped on the CPU{}", by_rates);
    return plan;
  }
  plan.device_step = fmt::format(
      "offload_optimizer.ratio {}: no whole sub-group {} (sub_group_size {} gives {} of them); "
      "every sub-group is stepped on the CPU",
      ratio,
      pl.cpu_ratio_auto ? "fits in half the HBM budget beside the rest of the plan"
                        : "is that fraction of them",
      pl.sub_group_size, groups);
  return plan;
}

std::string OverBudgetTable(const TierPlan& plan, const Placement& pl, const LayoutSizes& s) {
  std::string table = "the placement does not fit:\n";
  table += fmt::format("  {:<7} {:>12} {:>12}  {}\n", "tier", "needed", "available", "made of");
  for (const TierBudget& t : plan.budgets)
    table += fmt::format(
        "  {:<7} {:>12} {:>12}  {}{}\n", t.tier, FormatBytes(t.needed_bytes),
        t.available_bytes > 0 ? FormatBytes(t.available_bytes) : std::string("-"), t.detail,
        (t.available_bytes > 0 && t.needed_bytes > t.available_bytes) ? "  <-- over" : "");
  table += fmt::format(
      "  (stage {}, offload_optimizer {}, offload_param {}, {} parameters in {} modules, "
      "sub_group_size {}{})",
      pl.stage, OffloadDeviceName(pl.optimizer), OffloadDeviceName(pl.params),
      s.param_elems > 0 ? s.param_elems : s.total_elems, s.num_modules, pl.sub_group_size,
      pl.world_size > 1 ? fmt::format(", {} ranks: this rank's optimizer states cover {} elements",
                                      pl.world_size, s.state_elems)
                        : "");
  return table;
}

std::vector<std::string> UsedNvmePaths(const Config& config) {
  const auto& zo = config.zero_optimization;
  std::vector<std::string> paths;
  auto add = [&](const std::vector<std::string>& from) {
    for (const std::string& p : from)
      if (std::find(paths.begin(), paths.end(), p) == paths.end()) paths.push_back(p);
  };
  if (zo.offload_optimizer.device == OffloadDevice::kNvme) add(zo.offload_optimizer.nvme_path);
  if (zo.offload_param.device == OffloadDevice::kNvme) add(zo.offload_param.nvme_path);
  return paths;
}

TierFacts MeasureTierFacts(int64_t hbm_budget, int64_t pinned_budget,
                           std::vector<std::string> nvme_paths, int64_t dram_budget) {
  TierFacts f;
  f.hbm_budget = hbm_budget;
  f.pinned_budget = pinned_budget;
  for (const std::string& p : nvme_paths) {
    struct statvfs sv {};
    if (statvfs(p.c_str(), &sv) == 0)
      f.nvme_available += static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize);
  }
  f.nvme_paths = std::move(nvme_paths);
  f.dram_available = dram_budget > 0 ? dram_budget : DefaultDramBudget();
  return f;
}

Status CheckParamsCanFit(const std::vector<ParamRec>& params, const TierFacts& facts,
                         int world_size) {
  if (facts.dram_available <= 0) return Status();
  // Saturating sums: numel is anything a caller registered.
  auto add = [](int64_t a, int64_t b) {
    int64_t sum = 0;
    return __builtin_add_overflow(a, b, &sum) ? INT64_MAX : sum;
  };
  int64_t needed = 0, elems = 0;
  for (const ParamRec& p : params) {
    int64_t bytes = 0;
    if (__builtin_mul_overflow(std::max<int64_t>(0, p.numel), p.elem_size(), &bytes))
      bytes = INT64_MAX;
    needed = add(needed, bytes);
    elems = add(elems, std::max<int64_t>(0, p.numel));
  }
  const int64_t ranks = std::max(1, world_size);
  const int64_t share = needed / ranks + (needed % ranks != 0 ? 1 : 0);
  const int64_t tiers[] = {facts.hbm_budget, facts.pinned_budget, facts.dram_available,
                           facts.nvme_available};
  int64_t available = 0;
  for (int64_t t : tiers) available = add(available, std::max<int64_t>(0, t));
  if (share <= available) return Status();
  return ResourceExhaustedError(fmt::format(
      "the model's parameters alone need {} bytes ({} elements, before gradients and optimizer "
      "states{}); every tier together has {} bytes (HBM budget {}, pinned budget {}, DRAM "
      "available {}, NVMe free {}): it cannot fit whatever the placement",
      share, elems, ranks > 1 ? fmt::format("; this rank's share of {} ranks", ranks) : "",
      available, facts.hbm_budget, facts.pinned_budget, facts.dram_available,
      facts.nvme_available));
}

int64_t DefaultDramBudget() {
  const HostMemoryInfo mem = ReadHostMemory();
  if (!mem.mem_known) return 0;
  const auto available = static_cast<int64_t>(mem.mem_available);
  return std::max<int64_t>(1, available - std::min<int64_t>(available / 10, int64_t{4} << 30));
}

LayoutOptions LayoutOptionsFromConfig(const Config& config) {
  const auto& zo = config.zero_optimization;
  LayoutOptions lo;
  lo.sub_group_size = zo.sub_group_size;
  lo.params_offloaded = zo.offload_param.device != OffloadDevice::kNone;
  lo.persistence_threshold = zo.stage3_param_persistence_threshold;
  lo.reduce_bucket_size = zo.reduce_bucket_size;
  lo.state_format = config.strata.optimizer_states;
  if (lo.state_format == cpu_adam::StateFormat::kInt8)
    lo.elem_align = static_cast<int64_t>(cpu_adam::kStateBlock);
  return lo;
}

StepPrediction PredictStep(const Placement& pl, const LayoutSizes& s, const TierPlan& plan,
                           const StepRates& r) {
  StepPrediction p;
  auto add = [&](const char* resource, double amount, double rate, std::string what) {
    if (amount <= 0) return;
    StepPrediction::Term t;
    t.resource = resource;
    t.amount = amount;
    t.seconds = rate > 0 ? amount / rate : 0;
    t.what = std::move(what);
    p.terms.push_back(std::move(t));
  };
  const auto elems = static_cast<double>(s.total_elems);
  // The elements this rank steps (data parallelism: its partition).
  // (Less the sub-groups the device steps: offload_optimizer.ratio.)
  const int64_t stepped =
      (s.state_elems > 0 ? s.state_elems : s.total_elems) - plan.device_step_elems;
  const auto state_elems = static_cast<double>(stepped);
  // With sub-groups stepped on the device their gradients and parameters
  // never cross PCIe: the host's share of what does.
  const double host_share = plan.device_step_elems > 0
                                ? state_elems / static_cast<double>(std::max<int64_t>(
                                                    1, stepped + plan.device_step_elems))
                                : 1.0;
  // Over PCIe a module moves its own extent; on NVMe its page-aligned one.
  const auto param_bytes =
      static_cast<double>(s.module_param_bytes > 0 ? s.module_param_bytes : s.total_param_bytes);
  // (Partitioned: this rank's pieces.)
  const auto nvme_param_bytes = static_cast<double>(
      s.partitioned_param_bytes > 0 ? s.partitioned_param_bytes : s.total_param_bytes);
  const auto persistent = static_cast<double>(s.persistent_param_bytes);
  const auto gas = static_cast<double>(std::max<int64_t>(1, pl.gradient_accumulation_steps));
  const double grad_elem_bytes = elems > 0 ? param_bytes / elems : 0;
  if (!pl.device_optimizer && plan.grads_in_hbm) {
    // The window's fp32 sum crosses twice: for the checks, for the step.
    add("pcie_d2h", 8 * elems, r.d2h_gbps * 1e9,
        fmt::format("the window's fp32 gradient sums, 2 x {} (the checks, the step)",
                    FormatBytes(4 * s.total_elems)));
    add("cpu_accumulate", 4 * elems, r.accumulate_gbps * 1e9,
        fmt::format("the checks' pass over {} sums", s.total_elems));
    add("cpu_optimizer", state_elems, r.adam_elems_per_s, fmt::format("{} elements", stepped));
  } else if (!pl.device_optimizer && plan.device_grad_accumulator) {
    // The window's fp32 sum, copied and added once.
    add("pcie_d2h", host_share * 4 * elems, r.d2h_gbps * 1e9,
        "the window's fp32 gradient sum " + FormatBytes(4 * s.total_elems));
    add("cpu_accumulate", host_share * 12 * elems, r.accumulate_gbps * 1e9,
        fmt::format("1 fp32 pass over {} elements", s.total_elems));
    add("cpu_optimizer", state_elems, r.adam_elems_per_s, fmt::format("{} elements", stepped));
  } else if (!pl.device_optimizer) {
    add("pcie_d2h", host_share * gas * param_bytes, r.d2h_gbps * 1e9,
        fmt::format("gradients, {} micro-batch{} x {}", gas, gas == 1 ? "" : "es",
                    FormatBytes(static_cast<int64_t>(param_bytes))));
    const double accumulated = gas - (plan.fold_last_micro_batch ? 1 : 0);
    // 8 + G bytes per element and pass: the fp32 sum read and written, the
    // gradient (G bytes) read.
    add("cpu_accumulate", host_share * accumulated * elems * (8 + grad_elem_bytes),
        r.accumulate_gbps * 1e9,
        fmt::format("{} accumulation pass{} over {} elements", accumulated,
                    accumulated == 1 ? "" : "es", s.total_elems));
    add("cpu_optimizer", state_elems, r.adam_elems_per_s, fmt::format("{} elements", stepped));
  }
  // Parameters: fetched for forward and backward when offloaded; the
  // updated ones uploaded after the step (persistent ones and
  // offload_param none) unless the optimizer runs on the device.
  const double fetched =
      pl.params == OffloadDevice::kNone ? 0 : 2 * gas * (param_bytes - persistent);
  // (Partitioned in HBM: this rank's part is uploaded; modules are
  // gathered within the device.)
  const double none_uploaded =
      s.partitioned_param_bytes > 0 ? static_cast<double>(s.partitioned_param_bytes) : param_bytes;
  const double uploaded =
      pl.device_optimizer
          ? 0
          : (pl.params == OffloadDevice::kNone ? host_share * none_uploaded : persistent);
  add("pcie_h2d", fetched + uploaded, r.h2d_gbps * 1e9,
      fetched > 0
          ? fmt::format("parameter fetches {} x {} + updated {}", 2 * gas,
                        FormatBytes(static_cast<int64_t>(param_bytes - persistent)),
                        FormatBytes(static_cast<int64_t>(uploaded)))
          : fmt::format("updated parameters {}", FormatBytes(static_cast<int64_t>(uploaded))));
  double nvme_read = 0, nvme_write = 0;
  std::string read_what, write_what;
  if (pl.optimizer == OffloadDevice::kNvme) {
    const double states = static_cast<double>(StateArrayBytes(pl.optimizer_states, stepped));
    nvme_read += states;
    nvme_write += states;
    read_what = "optimizer states " + FormatBytes(static_cast<int64_t>(states));
    write_what = read_what;
  }
  if (pl.params == OffloadDevice::kNvme) {
    // Modules are read and written page-aligned.
    const double read = 2 * gas * std::max(0.0, nvme_param_bytes - persistent);
    nvme_read += read;
    nvme_write += nvme_param_bytes;
    read_what += std::string(read_what.empty() ? "" : " + ") + "parameter fetches " +
                 FormatBytes(static_cast<int64_t>(read));
    write_what += std::string(write_what.empty() ? "" : " + ") + "updated parameters " +
                  FormatBytes(static_cast<int64_t>(nvme_param_bytes));
  }
  if (plan.grads_on_nvme) {
    // Each sub-group's sum written once per micro-batch and read back by the
    // next one (host accumulation), or written once per window (the sum in
    // HBM); the optimizer pipeline reads it once. An upper bound: the
    // sub-groups still cached when a micro-batch ends are not written.
    const double passes = plan.device_grad_accumulator ? 1 : gas;
    const double bytes = static_cast<double>(kGradAccBytesPerElem) * elems;
    nvme_read += passes * bytes;
    nvme_write += passes * bytes;
    const std::string what =
        fmt::format("gradients {} x {}", passes, FormatBytes(static_cast<int64_t>(bytes)));
    read_what += std::string(read_what.empty() ? "" : " + ") + what;
    write_what += std::string(write_what.empty() ? "" : " + ") + what;
  }
  add("nvme_read", nvme_read, r.nvme_read_gbps * 1e9, read_what);
  add("nvme_write", nvme_write, r.nvme_write_gbps * 1e9, write_what);
  if (plan.device_step_elems > 0) {
    // The device Adam over the split: its states read and written, the fp32
    // sums read and zeroed, the parameters written.
    const auto n = static_cast<double>(plan.device_step_elems);
    const double bytes =
        2 * static_cast<double>(StateArrayBytes(pl.optimizer_states, plan.device_step_elems)) +
        8 * n + grad_elem_bytes * n;
    add("device_optimizer", bytes, r.device_gbps * 1e9,
        fmt::format("the device Adam over {} elements", plan.device_step_elems));
  }
  // Shared resources add up: one disk, one CPU.
  std::map<std::string, double> busy;
  for (const StepPrediction::Term& t : p.terms) {
    std::string key = t.resource;
    if (key.starts_with("nvme")) key = "nvme";
    if (key.starts_with("cpu")) key = "cpu";
    busy[key] += t.seconds;
  }
  for (const auto& [key, secs] : busy)
    if (secs > p.bound_s) {
      p.bound_s = secs;
      p.bound_by = key;
    }
  return p;
}

}  // namespace strata::scheduler
