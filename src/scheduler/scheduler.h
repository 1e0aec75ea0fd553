// src/scheduler/scheduler.h — the tiered scheduler's contract.
//
// The scheduler is the implementation of the public strata::Engine
// (include/strata/engine.h): it places every state by the config, moves
// parameters HBM ← DRAM ← NVMe ahead of use, moves gradients HBM → DRAM
// during backward, and runs the optimizer pipeline NVMe read → CPU Adam →
// NVMe write. Its parts, each usable and tested on its own:
//
//   Plan / ComputePlan      what each tier must hold, and the needed-vs-
//                           available table when it does not fit (engine.cc)
//   LossScaler              fp16 dynamic loss scaling (loss_scaler.h)
//   FetchTrace              the recorded module order for prefetch (fetch_trace.h)
//   Timeline                the Chrome-trace/Perfetto timeline (timeline.h)
//   EngineImpl              the Engine itself (engine.cc)
//
// Engine::Create in engine.cc uses CreateEngine below; tests use it to pass
// a fault-injecting NVMe engine.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

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
};

StatusOr<std::unique_ptr<Engine>> CreateEngine(const Config& config,
                                               const EngineTestHooks& hooks = {});

}  // namespace strata
