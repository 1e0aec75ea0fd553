// src/scheduler/hyperparams.h — the optimizer's hyperparameters for a step,
// from the config: the algorithm its optimizer section names, the learning
// rate and betas of its scheduler section at that step, and the rest as
// configured. Both optimizer back-ends step with these.
#pragma once

#include <cstdint>
#include <optional>

#include "src/cpu_adam/cpu_adam.h"
#include "strata/config.h"

namespace strata::scheduler {

// The hyperparameters of the step after `steps_applied` applied optimizer
// steps (hp.step = steps_applied + 1): the schedule is a function of the
// applied steps (an overflow-skipped step does not advance it), which a
// checkpoint restores. `lr_override` (Engine::SetLearningRate) replaces the
// learning rate; the gradients are multiplied by `grad_scale` (the inverse
// loss scale times the clip coefficient).
cpu_adam::HyperParams OptimizerHyperParams(const Config& config, int64_t steps_applied,
                                           std::optional<double> lr_override, double grad_scale);

}  // namespace strata::scheduler
