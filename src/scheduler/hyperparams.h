// src/scheduler/hyperparams.h — the optimizer's hyperparameters for a step,
// from the config: the algorithm its optimizer section names, the learning
// rate and betas of its scheduler section at that step, and the rest as
// configured. Both optimizer back-ends step with these.
#pragma once

#include <cstdint>
#include <optional>

#include "src/cpu_adam/cpu_adam.h"
#include "strata/config.h"
#include "strata/engine.h"

namespace strata::scheduler {

// The hyperparameters of the step after `steps_applied` applied optimizer
// steps (hp.step = steps_applied + 1): the schedule is a function of the
// applied steps (an overflow-skipped step does not advance it), which a
// checkpoint restores. `lr_override` (Engine::SetLearningRate) replaces the
// learning rate; the gradients are multiplied by `grad_scale` (the inverse
// loss scale times the clip coefficient).
cpu_adam::HyperParams OptimizerHyperParams(const Config& config, int64_t steps_applied,
                                           std::optional<double> lr_override, double grad_scale);

// The learning rate of parameter group `group` at the step after
// `steps_applied`: `lr_override` (SetLearningRate) if set; else the group's
// lr, times the schedule's ratio for a schedule that scales each group's lr
// (none, WarmupCosineLR); else the schedule's (or the config's) lr.
double GroupLearningRate(const Config& config, int64_t steps_applied, const ParamGroupSpec& group,
                         std::optional<double> lr_override);

// `base` (OptimizerHyperParams's, for the same step) with parameter group
// `group`'s overrides: its learning rate as above, weight_decay, betas, eps.
cpu_adam::HyperParams GroupHyperParams(const Config& config, const cpu_adam::HyperParams& base,
                                       const ParamGroupSpec& group,
                                       std::optional<double> lr_override);

// Group 0: the config's own hyperparameters, named "default".
ParamGroupSpec DefaultParamGroup();

// Whether the config's schedule sets beta1/beta2 (OneCycle with cycle_momentum).
bool ScheduleCyclesMomentum(const Config& config);

}  // namespace strata::scheduler
