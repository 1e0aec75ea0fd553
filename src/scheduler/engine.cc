// The tiered scheduler: strata::Engine on a Device, the CPU optimizer and the
// NVMe swap store. This file is the training step, what runs every
// micro-batch (engine_setup.cc wires the parts at Plan(), engine_state.cc
// serves the calls between windows; engine_impl.h declares EngineImpl);
// each part owns its state (see scheduler.h):
//
//   Partition         who this rank is and what it owns (partition.h)
//   Layout            where every parameter's elements and bytes live (layout.h)
//   TierPlan          what each tier must hold, and whether it fits (plan.h)
//   StateStore        the states and parameter copies, commit/rollback (state_store.h)
//   ParamFetcher      parameters onto the device ahead of use (param_fetcher.h)
//   OptimizerBackend  where gradients go and the optimizer runs, chosen once
//                     by the plan (optimizer_backend.h): HostOptimizer
//                     (gradients into DRAM, the step on the CPU) or
//                     DeviceOptimizer (all in HBM)
//   StepCounters      the statistics of a step window (step_counters.h)
//
// A window of micro-batches: BeforeForward/AfterForward and BeforeBackward/
// AfterBackward per module acquire and release the module's parameters and
// hand its gradients to the back-end; Step() counts micro-batches and at the
// window's end drains the gradients, checks them (inf/nan, global norm,
// clipping) and launches the optimizer step. With the host back-end the step
// runs on while the next forward pass begins; a module's fetch waits only for
// the sub-group holding it (where the plan decided so: Placement::
// overlap_step). The next Step() (or an error, ReadParameter,
// Synchronize) joins it and commits it into the StateStore, or rolls it back.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/scheduler/engine_impl.h"

namespace strata::scheduler {

// ---------------------------------------------------------------------------
// The hooks: parameters acquired before use, gradients handed over after backward
// ---------------------------------------------------------------------------

Status EngineImpl::FetchError(Status fetch) {
  // A fetch that failed while a step is in flight (it reads what the step
  // wrote): the step's own failure, if it failed, is what the caller must
  // hear about (its rollback); else the fetch's.
  if (fetch.ok() || !backend_->reading_next_params()) return fetch;
  Status step = backend_->Join();
  return step.ok() ? fetch : step;
}

Status EngineImpl::CheckModule(int module, const char* call) const {
  if (module < 0 || module >= layout_.num_modules() || !layout_.module(module).registered)
    return InvalidArgumentError(
        fmt::format("{}({}): no parameters are registered for module {}", call, module, module));
  return Status();
}

StatusOr<ModuleView> EngineImpl::BeforeForward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(CheckModule(module, "BeforeForward"));
  RETURN_IF_ERROR(backend_->Poll());
  StatusOr<ModuleView> v = fetcher_->Acquire(module, Phase::kForward);
  if (!v.ok()) return FetchError(v.status());
  counters_.HookExit();
  return v;
}

Status EngineImpl::AfterForward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(CheckModule(module, "AfterForward"));
  if (!planned_) return FailedPreconditionError("AfterForward before any BeforeForward");
  RETURN_IF_ERROR(backend_->Poll());
  RETURN_IF_ERROR(fetcher_->Release(module));
  counters_.HookExit();
  return Status();
}

StatusOr<ModuleView> EngineImpl::BeforeBackward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(CheckModule(module, "BeforeBackward"));
  RETURN_IF_ERROR(backend_->Poll());
  if (fetcher_->has_grad(module))
    return FailedPreconditionError(
        fmt::format("BeforeBackward({}): the module's previous gradients were not handed over with "
                    "AfterBackward",
                    module));
  StatusOr<ModuleView> v = fetcher_->Acquire(module, Phase::kBackward);
  if (!v.ok()) return FetchError(v.status());
  // The step follows this backward pass: what of it may start now does
  // (after the module's fetch: NVMe state reads queue behind it;
  // strata.speculative_step: the step itself, as the gradients arrive).
  if (last_micro_batch())
    RETURN_IF_ERROR(backend_->PrepareStep([this] { return SpeculativeLaunch(); }));
  counters_.HookExit();
  return v;
}

Status EngineImpl::AfterBackward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(CheckModule(module, "AfterBackward"));
  if (!planned_ || !fetcher_->has_grad(module))
    return FailedPreconditionError(fmt::format("AfterBackward({}) without BeforeBackward", module));
  window_.grads_since_launch = true;
  RETURN_IF_ERROR(backend_->AddGradients(module, fetcher_->grad(module), fetcher_->computed(module),
                                         last_micro_batch()));
  RETURN_IF_ERROR(fetcher_->ReleaseGrad(module, backend_->gradients_read_on()));
  counters_.HookExit();
  return Status();
}

// ---------------------------------------------------------------------------
// The optimizer step
// ---------------------------------------------------------------------------

std::vector<cpu_adam::HyperParams> EngineImpl::HyperParamsFor(double grad_scale) const {
  const cpu_adam::HyperParams base =
      scheduler::OptimizerHyperParams(cfg_, backend_->steps(), std::nullopt, grad_scale);
  std::vector<cpu_adam::HyperParams> out;
  for (size_t g = 0; g < groups_.size(); ++g)
    out.push_back(scheduler::GroupHyperParams(cfg_, base, groups_[g], lr_override_[g]));
  return out;
}

scheduler::LaunchParams EngineImpl::SpeculativeLaunch() const {
  // What EndWindow launches when the window has no inf/nan and is not
  // clipped (clip coefficient 1.0).
  scheduler::LaunchParams p;
  p.group_hp = HyperParamsFor(1.0 / scaler_.scale());
  p.hp = p.group_hp[0];
  p.background = true;
  return p;
}

Status EngineImpl::ZeroGrad() {
  if (!planned_) return Status();
  RETURN_IF_ERROR(backend_->Poll());
  return backend_->ZeroGrad();
}

Status EngineImpl::Synchronize() {
  if (!planned_) return Status();
  return backend_->Join();
}

StatusOr<StepStats> EngineImpl::Step() {
  counters_.HookEntry();
  RETURN_IF_ERROR(Plan());
  if (fetcher_->any_grad())
    return FailedPreconditionError(
        "Step: a module's gradients were not handed over with AfterBackward");
  if (last_micro_batch() && !window_.grads_since_launch)
    return FailedPreconditionError(fmt::format(
        "Step: no gradients were handed over since the last optimizer step (no backward in this "
        "window of {} micro-batch{}); the optimizer would apply zero gradients, which weight "
        "decay and momentum still move. Run backward before Step(), or ZeroGrad() to drop the "
        "window",
        gas_, gas_ == 1 ? "" : "es"));
  StepStats st;
  st.lr = learning_rate();
  if (num_param_groups() > 1)
    for (int g = 0; g < num_param_groups(); ++g) st.group_lrs.push_back(learning_rate(g));
  Status status;
  if (++window_.micro_batches >= gas_) {
    const int64_t opt0 = NowNanos();
    status = EndWindow(&st);
    if (!status.ok()) backend_->DiscardWindow();  // the window is over, applied or not
    const scheduler::OptimizerBackend::SpeculationCounts spec = backend_->TakeSpeculationCounts();
    st.sub_groups_speculated = spec.speculated;
    st.sub_groups_redone = spec.redone;
    st.optimizer_wall_s = static_cast<double>(NowNanos() - opt0) * 1e-9;
    window_.micro_batches = 0;
  }
  // Statistics of the window since the previous Step().
  const int64_t now = NowNanos();
  st.trace_rerecords = fetcher_->NextStep();
  st.step = backend_->steps();
  st.loss_scale = scaler_.scale();
  if (dp_) {  // before EndWindow: the bound counts the network
    const scheduler::CommCounters c = dp_->TakeCounters();
    st.rank = dp_->rank();
    st.world_size = dp_->world_size();
    st.comm_reduced_bytes = c.reduced_bytes;
    st.comm_overlapped_bytes = c.overlapped_bytes;
    st.comm_gathered_bytes = c.gathered_bytes;
    st.comm_s = c.busy_s;
    st.comm_busy_s = c.device_s;
    st.comm_ring_bytes = dp_->RingBytes(c);
    st.comm_gbytes_per_s = comm_gbps_;
  }
  counters_.EndWindow(now, &st);
  st.hbm_high_water_bytes = static_cast<int64_t>(dev_->Stats().high_water_bytes);
  st.pinned_high_water_bytes = pinned_bytes_ + store_->pinned_array_bytes();
  last_ = st;
  counters_.HookExit();
  if (!status.ok()) return status;
  return st;
}

Status EngineImpl::EndWindow(StepStats* st) {
  Status status = backend_->Drain();
  // The step in flight ends here: this one reads its states (and with DPU
  // its parameters become the current ones now).
  Status joined = backend_->Join();
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(joined);
  bool overflow = false;
  double sumsq = 0;
  RETURN_IF_ERROR(backend_->GlobalChecks(&overflow, &sumsq));
  const double scale = scaler_.scale();
  st->overflow = overflow;
  if (overflow) {
    scaler_.Update(true);
    STRATA_LOG_INFO("step {}: inf/nan in the gradients, step skipped; loss scale now {}",
                    backend_->steps() + 1, scaler_.scale());
    backend_->DiscardWindow();
    return Status();
  }
  const double norm = std::sqrt(sumsq) / scale;
  double clip_coef = 1.0;
  if (cfg_.gradient_clipping > 0) {
    const double c = cfg_.gradient_clipping / (norm + 1e-6);
    if (c < 1.0) clip_coef = c;
  }
  st->grad_norm = norm;
  st->clip_coef = clip_coef;
  scheduler::LaunchParams p;
  p.group_hp = HyperParamsFor(clip_coef / scale);
  p.hp = p.group_hp[0];
  p.delayed = cfg_.strata.delayed_param_update &&
              backend_->steps() >= cfg_.strata.delayed_param_update_warmup;
  // Beside the next window where the plan decided so (Placement::
  // overlap_step), and with delayed_param_update, whose step the next
  // Step() joins on every rank (with several ranks the gather happens there).
  p.background = p.delayed || placement_.overlap_step();
  const int64_t before = backend_->steps();
  Status launched = backend_->Launch(p);
  st->applied = backend_->steps() > before;
  return launched;
}

}  // namespace strata::scheduler
