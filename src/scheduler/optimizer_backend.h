// src/scheduler/optimizer_backend.h — where the window's gradients go and
// where the optimizer runs, chosen once by the plan:
//
//   HostOptimizer    (host_optimizer.h)    gradients into the fp32 accumulator
//                    in DRAM (GradOffloader), the step on the CPU over every
//                    sub-group (OptimizerStep), in the background or inline,
//                    committed into the StateStore or rolled back;
//   DeviceOptimizer  (device_optimizer.h)  offload_optimizer none on a GPU:
//                    the accumulator and the step stay in HBM, current at once.
//
// The engine's Step() drives either the same way: Drain the window's
// gradients and Join the step in flight, GlobalChecks (inf/nan, the sum of
// squares) on what was drained, then Launch the next step with the
// hyperparameters it derived (loss scale, clipping), or DiscardWindow.
//
// A back-end also tells the parameter fetcher about a step in flight
// (StepProgress): whether fetches must read the step's new parameters, and
// waits for the part of the step a module needs.
//
// Threading: the engine's (main) thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/scheduler/loss_scaler.h"
#include "src/scheduler/step_progress.h"
#include "strata/status.h"

namespace strata::scheduler {

// The micro-batches of the current accumulation window, as the engine counts
// them. A back-end that discards the window's gradients (a failed step, a
// skipped one) resets it.
struct GradientWindow {
  int64_t micro_batches = 0;        // Step() calls since the window began
  bool grads_since_launch = false;  // gradients handed over since the last launch
  void Reset() {
    micro_batches = 0;
    grads_since_launch = false;
  }
};

// How a step is launched (from the engine's hyperparameters and the loss
// scale / clipping it derived).
struct LaunchParams {
  cpu_adam::HyperParams hp;  // hp.step: the step it computes (1-based); group 0's
  // Per optimizer parameter group (ParamRec::group): group_hp[0] == hp. Empty:
  // `hp` for every parameter.
  std::vector<cpu_adam::HyperParams> group_hp;
  // DPU: the step's parameters are used from the next Step() on.
  bool delayed = false;
  // The step runs on its own thread while the next window begins.
  bool background = false;
};

class OptimizerBackend : public StepProgress {
 public:
  ~OptimizerBackend() override = default;

  // ---- The window's gradients ----
  // Takes module m's gradients (device_grad: its gradient buffer, laid out
  // like its parameters, complete once the work enqueued so far on the
  // compute stream is; `computed` is the module's event to record that on).
  // `last`: the window's last micro-batch.
  virtual Status AddGradients(int m, const void* device_grad, gpu::Event& computed, bool last) = 0;
  // The stream whose current point is after every read of the gradient
  // buffers handed to AddGradients (their device buffers are reused then).
  virtual gpu::Stream& gradients_read_on() = 0;
  // The window's last backward pass begins: the next step's work that does
  // not depend on the gradients may start (NVMe state reads), and with
  // strata.speculative_step the step itself, sub-group by sub-group as
  // their gradients become final, with `speculative()`'s hyperparameters
  // (those of a finite, unclipped window). Called before each module's
  // backward of that micro-batch.
  virtual Status PrepareStep(const std::function<LaunchParams()>& speculative) {
    (void)speculative;
    return Status();
  }
  // A speculative step of this window is dropped (its sub-groups' states
  // restored): the states are about to be read as they are (ReadParameter).
  virtual Status CancelSpeculation() { return Status(); }
  // The window that ended with the last Step(): sub-groups stepped during
  // its backward pass, and of those the ones rolled back (redone with the
  // true coefficients, or dropped with a skipped step). Read once.
  struct SpeculationCounts {
    int64_t speculated = 0;
    int64_t redone = 0;
  };
  virtual SpeculationCounts TakeSpeculationCounts() { return {}; }
  // Waits until every gradient handed over is in place; the first error.
  virtual Status Drain() = 0;
  // Inf/nan anywhere in the window's gradients, and their sum of squares
  // (REQUIRES: drained).
  virtual Status GlobalChecks(bool* overflow, double* sumsq) = 0;
  // ZeroGrad between windows: the current window's gradients become zero.
  virtual Status ZeroGrad() = 0;
  // The window is over without a step (overflow, error): its gradients are
  // dropped, errors ignored, and the engine's GradientWindow reset.
  virtual void DiscardWindow() = 0;

  // ---- The step ----
  // Starts the step (steps() advances, and the loss scaler counts a good
  // step, when it is launched); with !p.background it has ended, committed
  // or rolled back, when Launch returns.
  virtual Status Launch(const LaunchParams& p) = 0;
  // Finishes a step in flight that has ended by itself (an error, or a
  // non-delayed step that can be committed); never waits.
  virtual Status Poll() = 0;
  // Waits for the step in flight and commits it, or rolls it back (steps()
  // and the loss scaler back to before it, the window's gradients dropped)
  // and returns its error.
  virtual Status Join() = 0;
  // A step in flight ends and its outcome no longer matters (the states are
  // about to be replaced): reads ahead are dropped. Returns the step's error
  // for the caller to report.
  virtual Status Abandon() = 0;
  // The fetcher's device copies of the parameters, which a step that
  // changes them drops (set once, before the first step).
  virtual void set_device_copies(DeviceCopies* copies) = 0;
  // Optimizer steps applied (committed or in flight).
  virtual int64_t steps() const = 0;
  virtual void set_steps(int64_t steps) = 0;
};

}  // namespace strata::scheduler
