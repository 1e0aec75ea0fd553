// ScheduleAt: the formulas of DeepSpeed's learning-rate schedules
// (deepspeed/runtime/lr_schedules.py), as functions of DeepSpeed's
// last_batch_iteration i. DeepSpeed builds a schedule at i = -1 (setting that
// lr), runs the optimizer, and advances i after each step that was applied;
// so the step following k applied steps uses the lr of i = k - 1.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "src/config/config_internal.h"

namespace strata {
namespace {

// WarmupLR / WarmupDecayLR / WarmupCosineLR warm up over max(2, n) steps.
int64_t WarmupSteps(const SchedulerConfig& s) { return std::max<int64_t>(2, s.warmup_num_steps); }

// The warmup fraction at iteration i < warmup steps: log(i + 1) / log(n) or i / n.
double WarmupGamma(const SchedulerConfig& s, int64_t i) {
  const auto n = static_cast<double>(WarmupSteps(s));
  if (s.warmup_type == WarmupType::kLinear) return static_cast<double>(i) / n;
  return (1.0 / std::log(n)) * std::log(static_cast<double>(i + 1));
}

double WarmupLr(const SchedulerConfig& s, int64_t i) {
  if (i < 0) return s.warmup_min_lr;
  double gamma = 1.0;
  if (i < WarmupSteps(s)) {
    gamma = WarmupGamma(s, i);
  } else if (s.type == LrScheduleType::kWarmupDecayLR) {
    // Linear decay to 0 at total_num_steps.
    gamma =
        std::max(0.0, static_cast<double>(s.total_num_steps - i) /
                          std::max(1.0, static_cast<double>(s.total_num_steps - WarmupSteps(s))));
  }
  return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
}

double CosineRatio(const SchedulerConfig& s, int64_t i) {
  if (i < 0) return 0.0;  // DeepSpeed's lr before the schedule has started
  const int64_t n = WarmupSteps(s);
  if (i < n) return s.warmup_min_ratio + WarmupGamma(s, i) * (1.0 - s.warmup_min_ratio);
  const double real_last = static_cast<double>(i - n + 1);
  const double real_total = static_cast<double>(std::max<int64_t>(1, s.total_num_steps - n));
  // Held at cos_min_ratio once the schedule reaches its end.
  const double progress = std::min(1.0, real_last / real_total);
  const double ratio = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
  return std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ratio);
}

// OneCycle's position in the cycle at iteration i (0 = cycle_min, 1 = peak).
double CycleScale(const SchedulerConfig& s, int64_t i) {
  const double first = static_cast<double>(s.cycle_first_step_size);
  const double second = static_cast<double>(s.cycle_second_step_size);
  const double total = first + second;
  const double step_ratio = first / total;
  const double b = static_cast<double>(i + 1);
  const double cycle = std::floor(1.0 + b / total);
  const double x = 1.0 + b / total - cycle;
  double scale;
  int64_t stairs;
  if (x <= step_ratio) {
    scale = x / step_ratio;
    stairs = s.cycle_first_stair_count;
  } else {
    scale = (x - 1.0) / (step_ratio - 1.0);
    stairs = s.cycle_second_stair_count;
  }
  if (stairs > 0) {
    // Stairs from the integer position in the cycle (Python's float modulo).
    const double ci = std::fmod(b, total);
    const double position = ci <= first ? ci * static_cast<double>(stairs) / first
                                        : (total - ci) * static_cast<double>(stairs) / second;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

void OneCycle(const SchedulerConfig& s, int64_t i, ScheduledValues* v) {
  const int64_t total = s.cycle_first_step_size + s.cycle_second_step_size;
  constexpr double kBeta2 = 0.99;  // DeepSpeed's OneCycle sets betas[1] to 0.99
  if (i < 0) {
    v->lr = s.cycle_min_lr;
    if (s.cycle_momentum) {
      v->beta1 = s.cycle_min_mom;
      v->beta2 = kBeta2;
    }
    return;
  }
  if (i < total) {
    const double scale = CycleScale(s, i);
    v->lr = s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * scale;
    if (s.cycle_momentum) {
      v->beta1 = s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * scale;
      v->beta2 = kBeta2;
    }
    return;
  }
  // After the cycle: lr min / (1 + rate × decay intervals), momentum max × (1 + rate × ...).
  const double decay_iteration = static_cast<double>(i - total + 1);
  const bool no_decay = s.decay_step_size == 0;
  const double interval = no_decay ? 0.0 : decay_iteration / static_cast<double>(s.decay_step_size);
  v->lr = no_decay || s.decay_lr_rate == 0.0 ? s.cycle_min_lr
                                             : s.cycle_min_lr / (1.0 + s.decay_lr_rate * interval);
  if (s.cycle_momentum) {
    v->beta1 = no_decay || s.decay_mom_rate == 0.0
                   ? s.cycle_max_mom
                   : s.cycle_max_mom * (1.0 + s.decay_mom_rate * interval);
    v->beta2 = kBeta2;
  }
}

double RangeTestLr(const SchedulerConfig& s, int64_t i) {
  double interval = static_cast<double>(i + 1) / static_cast<double>(s.lr_range_test_step_size);
  if (s.lr_range_test_staircase) interval = std::floor(interval);
  return s.lr_range_test_min_lr * (1.0 + s.lr_range_test_step_rate * interval);
}

}  // namespace

ScheduledValues ScheduleAt(const Config& c, int64_t applied_steps) {
  const SchedulerConfig& s = c.scheduler;
  ScheduledValues v;
  v.lr = c.optimizer.lr;
  v.beta1 = c.optimizer.beta1;
  v.beta2 = c.optimizer.beta2;
  const int64_t i = applied_steps - 1;  // DeepSpeed's last_batch_iteration
  switch (s.type) {
    case LrScheduleType::kNone:
      v.lr_ratio = 1.0;
      break;
    case LrScheduleType::kWarmupLR:
    case LrScheduleType::kWarmupDecayLR:
      v.lr = WarmupLr(s, i);
      break;
    case LrScheduleType::kWarmupCosineLR:
      v.lr_ratio = CosineRatio(s, i);
      v.lr = c.optimizer.lr * *v.lr_ratio;
      break;
    case LrScheduleType::kOneCycle:
      OneCycle(s, i, &v);
      break;
    case LrScheduleType::kLRRangeTest:
      v.lr = RangeTestLr(s, i);
      break;
  }
  return v;
}

}  // namespace strata
