// src/scheduler/fold_mode.h — how a module's gradients reach the optimizer
// in a window whose last micro-batch is folded into the optimizer's pass
// (TierPlan::fold_last_micro_batch): the gradient path (GradOffloader)
// records one per module, the optimizer step (OptimizerStep) reads them.
#pragma once

#include <cstdint>

namespace strata::scheduler {

enum FoldMode : uint8_t {
  kAccOnly = 0,   // not landed: the accumulator alone
  kFoldAcc = 1,   // landed, and also accumulated this window: acc + landed
  kFoldZero = 2,  // only landed: acc is zero there and stays so
};

}  // namespace strata::scheduler
