// src/scheduler/scheduler.h — the tiered scheduler's contract.
//
// The scheduler is the implementation of the public strata::Engine
// (include/strata/engine.h): it places every state by the config, moves
// parameters HBM <- DRAM <- NVMe ahead of use, moves gradients HBM -> DRAM
// during backward, and runs the optimizer pipeline NVMe read -> CPU Adam ->
// NVMe write. Its parts, each owning its state and tested on its own:
//
//   layout.h          Layout: parameters, module extents, sub-groups, alignment
//   partition.h       Partition: who this rank is and what it owns, built once
//                     by Plan(); ParamGatherer, RankExchange: how the other
//                     parts reach the other ranks
//   plan.h            Placement (with its decided policies) and ComputeTierPlan:
//                     needed vs available per tier, the table
//   state_store.h     StateStore: states and parameter copies, NVMe versions,
//                     Commit / Rollback (the only place versions flip)
//   param_fetcher.h   ParamFetcher: residency per module, prefetch, eviction,
//                     gathers of partitioned modules
//   grad_offloader.h  GradOffloader: gradient D2H chunks -> fp32 accumulator
//   grad_store.h      GradStore: the window's gradient sums on NVMe
//   optimizer_step.h  OptimizerStep: the step over every sub-group, its thread,
//                     the NVMe state ring, the state read-ahead
//   optimizer_backend.h  OptimizerBackend: where gradients go and the optimizer
//                     runs, chosen once by the plan
//   step_progress.h   StepProgress (the back-end tells the fetcher about a step
//                     in flight) and DeviceCopies (the fetcher's copies a step drops)
//   host_optimizer.h  HostOptimizer: GradOffloader + OptimizerStep, the step
//                     in flight, commit / rollback
//   device_optimizer.h  DeviceOptimizer: offload_optimizer none on a GPU (all in HBM)
//   data_parallel.h   DataParallel: the ranks' collectives (reductions, gathers,
//                     checks) and overlap_comm's OverlapIssuer
//   step_counters.h   StepCounters: busy times, bytes, NVMe busy union, timeline
//   rate_probes.h     the PCIe and accumulation rates the plan measures
//   hyperparams.h     the optimizer hyperparameters of a step (config + schedule)
//   loss_scaler.h     LossScaler: fp16 dynamic loss scaling
//   fetch_trace.h     FetchTrace: the recorded module order for prefetch
//   timeline.h        Timeline: the Chrome-trace/Perfetto timeline
//   checkpoint.h      WriteCheckpoint / ReadCheckpoint: crash-consistent
//                     checkpoints through the StateStore's accessors; the
//                     format (checkpoint_format.h), the root's lock and
//                     listing (checkpoint_dir.h), inspection and export
//                     (checkpoint_export.h)
//   engine_impl.h     EngineImpl: engine.cc the step, engine_setup.cc the
//                     creation and Plan(), engine_state.cc the calls between
//                     windows
//
// Locking: shared fields carry Clang thread-safety annotations
// (src/common/thread_annotations.h), checked by scripts/check_thread_safety.sh.
//
// Engine::Create in engine_setup.cc uses CreateEngine below; tests use it to pass
// a fault-injecting NVMe engine.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string_view>

#include "src/nvme/nvme.h"
#include "strata/engine.h"

namespace strata {

struct EngineTestHooks {
  // Wraps the NVMe I/O engine the scheduler creates (e.g. in a
  // FaultInjectionEngine). Called once, when the NVMe tier is opened.
  std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)> wrap_io_engine;
  // Called on the optimizer's thread before it steps sub-group g (tests hold
  // a step half-way to see what the next forward pass may do meanwhile).
  std::function<void(size_t g)> before_sub_group;
  // Runs offload_optimizer none through the device optimizer (gradient
  // accumulator in the arena, Device::AdamStep) on the host device too, as
  // it always runs on a GPU; without it the host device steps states in the
  // arena with the CPU optimizer.
  bool device_optimizer = false;
  // Whether the window's last micro-batch is folded into the optimizer's
  // pass: -1 as the plan decides, 0 never, 1 wherever possible (the plan's
  // Placement::fold_override; `strata train` sets it from STRATA_FOLD_GRADS
  // for A/B runs).
  int fold_override = -1;
  // strata.speculative_step: the speculative step ends only once it has
  // stepped every sub-group handed over to it (instead of dropping those it
  // has not started), so that what it speculates does not depend on how
  // the threads were scheduled.
  bool speculation_steps_all_handed_over = false;
  // strata.speculative_step true with auto's back-off after a rollback
  // (HostOptimizer::Options::speculation_backoff), which the host device
  // never runs otherwise (auto is off there).
  bool speculation_backoff = false;
  // Called at each point of a checkpoint save (CheckpointMeta::at_point
  // lists them); crash tests end the process there.
  std::function<void(std::string_view point)> checkpoint_point;
};

StatusOr<std::unique_ptr<Engine>> CreateEngine(
    const Config& config, const EngineTestHooks& hooks = {},
    std::shared_ptr<RendezvousStore> rendezvous = nullptr);

}  // namespace strata
