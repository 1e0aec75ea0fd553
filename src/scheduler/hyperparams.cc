#include "src/scheduler/hyperparams.h"

namespace strata::scheduler {

cpu_adam::HyperParams OptimizerHyperParams(const Config& config, int64_t steps_applied,
                                           std::optional<double> lr_override, double grad_scale) {
  const OptimizerConfig& o = config.optimizer;
  cpu_adam::HyperParams hp;
  switch (o.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      hp.algorithm = o.adam_w_mode ? cpu_adam::Algorithm::kAdamW : cpu_adam::Algorithm::kAdam;
      break;
    case OptimizerType::kAdagrad:  // uses exp_avg_sq as its sum of squares
      hp.algorithm = cpu_adam::Algorithm::kAdagrad;
      break;
    case OptimizerType::kLion:  // uses exp_avg as its momentum
      hp.algorithm = cpu_adam::Algorithm::kLion;
      break;
  }
  // Doubles all the way, as the optimizer's fields and PyTorch's: the
  // derived coefficients are rounded to fp32 once, inside the optimizer.
  // The schedule is a function of the applied steps (skipped ones do not
  // advance it), which checkpoints restore.
  const ScheduledValues sched = ScheduleAt(config, steps_applied);
  hp.lr = lr_override.value_or(sched.lr);
  hp.beta1 = sched.beta1;
  hp.beta2 = sched.beta2;
  hp.eps = o.eps;
  hp.weight_decay = o.weight_decay;
  hp.bias_correction = o.bias_correction;
  hp.step = steps_applied + 1;
  hp.grad_scale = grad_scale;
  return hp;
}

double GroupLearningRate(const Config& config, int64_t steps_applied, const ParamGroupSpec& group,
                         std::optional<double> lr_override) {
  if (lr_override.has_value()) return *lr_override;
  const ScheduledValues sched = ScheduleAt(config, steps_applied);
  if (group.lr.has_value() && sched.lr_ratio.has_value()) return *group.lr * *sched.lr_ratio;
  return sched.lr;
}

cpu_adam::HyperParams GroupHyperParams(const Config& config, const cpu_adam::HyperParams& base,
                                       const ParamGroupSpec& group,
                                       std::optional<double> lr_override) {
  cpu_adam::HyperParams hp = base;
  hp.lr = GroupLearningRate(config, base.step - 1, group, lr_override);
  if (group.weight_decay) hp.weight_decay = *group.weight_decay;
  if (group.beta1) hp.beta1 = *group.beta1;
  if (group.beta2) hp.beta2 = *group.beta2;
  if (group.eps) hp.eps = *group.eps;
  return hp;
}

ParamGroupSpec DefaultParamGroup() {
  ParamGroupSpec g;
  g.name = "default";
  return g;
}

bool ScheduleCyclesMomentum(const Config& config) {
  return config.scheduler.type == LrScheduleType::kOneCycle && config.scheduler.cycle_momentum;
}

}  // namespace strata::scheduler
