#include "src/scheduler/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace strata {

LossScaler LossScaler::FromConfig(const Fp16Config& fp16) {
  if (!fp16.enabled) return Disabled();
  LossScaler s;
  if (fp16.loss_scale > 0) {
    s.scale_ = fp16.loss_scale;
    s.dynamic_ = false;
    return s;
  }
  s.dynamic_ = true;
  s.scale_ = std::ldexp(1.0, fp16.initial_scale_power);
  s.min_scale_ = fp16.min_loss_scale;
  s.window_ = std::max<int64_t>(1, fp16.loss_scale_window);
  s.hysteresis_ = std::max(1, fp16.hysteresis);
  s.hysteresis_left_ = s.hysteresis_;
  return s;
}

LossScaler LossScaler::Disabled() { return LossScaler(); }

void LossScaler::Restore(const State& s) {
  scale_ = s.scale;
  hysteresis_left_ = s.hysteresis_left;
  iter_ = s.iteration;
  last_overflow_iter_ = s.last_overflow_iteration;
}

bool LossScaler::Update(bool overflow) {
  if (!dynamic_) {
    ++iter_;
    return overflow;
  }
  if (overflow) {
    if (hysteresis_left_ <= 1) {
      scale_ = std::max(scale_ / 2, min_scale_);  // hysteresis spent: lower the scale
    } else {
      --hysteresis_left_;  // absorb this overflow, keep the scale
    }
    last_overflow_iter_ = iter_;
  } else if ((iter_ - last_overflow_iter_) % window_ == 0) {
    hysteresis_left_ = hysteresis_;  // a full clean window: restore and raise
    scale_ *= 2;
  }
  ++iter_;
  return overflow;
}

}  // namespace strata
