// strata/dtype.h — element types of parameters and gradients.
#pragma once

#include <cstdint>

namespace strata {

// fp16 and bf16 values are 16-bit patterns (uint16_t) in Strata's API.
enum class DType : uint8_t { kFp32 = 0, kFp16 = 1, kBf16 = 2 };

}  // namespace strata
