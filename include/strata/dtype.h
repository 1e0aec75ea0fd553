// strata/dtype.h — element types of parameters and gradients.
#pragma once

#include <cstdint>

namespace strata {

// fp16 and bf16 values are 16-bit patterns (uint16_t) in Strata's API.
enum class DType : uint8_t { kFp32 = 0, kFp16 = 1, kBf16 = 2 };

// How the optimizer keeps its states between steps (strata.optimizer_states),
// one type for the config (OptimizerStates), the CPU optimizer
// (cpu_adam::StateFormat, which documents each format's arrays and rounding)
// and the device's Adam step (gpu::AdamStates):
//   kFp32        fp32 master, exp_avg, exp_avg_sq              12 B/param
//   kBf16        fp32 master, bf16 moments                       8 B/param
//   kBf16Master  bf16 master (stochastic rounding), bf16 moments 6 B/param
//   kInt8        fp32 master, 8-bit block-quantized moments   ~6.06 B/param
enum class StateFormat : uint8_t { kFp32 = 0, kBf16 = 1, kBf16Master = 2, kInt8 = 3 };

}  // namespace strata
