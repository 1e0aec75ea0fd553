// fp16 loss scaling with DeepSpeed's semantics (the `fp16` config section).
//
// Static (fp16.loss_scale > 0): the scale never changes; an overflowing step
// is still skipped.
// Dynamic (fp16.loss_scale == 0): the scale starts at 2^initial_scale_power.
//   On an overflowing step the step is skipped and, once `hysteresis`
//   overflows have been absorbed, the scale halves (never below
//   min_loss_scale); each overflow before that only uses up one unit of
//   hysteresis. After `loss_scale_window` consecutive clean steps since the
//   last overflow the scale doubles and the hysteresis is restored.
// bf16 and fp32 training use no scaling: Disabled() gives scale 1 forever.
//
// Not thread-safe; owned by the engine's step().
#pragma once

#include <cstdint>

#include "strata/config.h"

namespace strata {

class LossScaler {
 public:
  static LossScaler FromConfig(const Fp16Config& fp16);
  static LossScaler Disabled();

  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  // Records the outcome of one step (overflow = any gradient was inf/nan).
  // Returns true when the step must be skipped.
  bool Update(bool overflow);

  int64_t iteration() const { return iter_; }
  int hysteresis_left() const { return hysteresis_left_; }

  // What changes as steps go (for checkpoints); the rest comes from the
  // config. Restore(state()) gives a scaler that behaves identically.
  struct State {
    double scale = 1.0;
    int hysteresis_left = 1;
    int64_t iteration = 0;
    int64_t last_overflow_iteration = -1;
    bool operator==(const State&) const = default;
  };
  State state() const { return {scale_, hysteresis_left_, iter_, last_overflow_iter_}; }
  void Restore(const State& s);

 private:
  double scale_ = 1.0;
  bool dynamic_ = false;
  double min_scale_ = 1.0;
  int64_t window_ = 1000;
  int hysteresis_ = 1;
  int hysteresis_left_ = 1;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
};

}  // namespace strata
