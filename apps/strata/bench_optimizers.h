// The CPU optimizers a `strata bench` command compares, all with the same
// threads and pinning: the ISA the machine gets (strata), the same-traffic
// roofline kernel (Options::roofline_kernel) and the plain scalar loop.
#pragma once

#include <memory>

#include "src/common/status_util.h"
#include "src/cpu_adam/cpu_adam.h"

namespace strata::cli {

struct BenchOptimizers {
  std::unique_ptr<cpu_adam::CpuOptimizer> strata, roofline, scalar;
};

inline StatusOr<BenchOptimizers> CreateBenchOptimizers(const cpu_adam::Options& base) {
  BenchOptimizers b;
  ASSIGN_OR_RETURN(b.strata, cpu_adam::CpuOptimizer::Create(base));
  cpu_adam::Options ro = base;
  ro.roofline_kernel = true;
  ASSIGN_OR_RETURN(b.roofline, cpu_adam::CpuOptimizer::Create(ro));
  cpu_adam::Options so = base;
  so.isa = "scalar";
  ASSIGN_OR_RETURN(b.scalar, cpu_adam::CpuOptimizer::Create(so));
  return b;
}

}  // namespace strata::cli
