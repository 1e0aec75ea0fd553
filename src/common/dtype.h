// Element types Strata moves and computes on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "strata/dtype.h"

namespace strata {

constexpr size_t DTypeSize(DType t) { return t == DType::kFp32 ? 4 : 2; }
constexpr std::string_view DTypeName(DType t) {
  return t == DType::kFp32 ? "fp32" : (t == DType::kFp16 ? "fp16" : "bf16");
}
// "fp32"/"float32", "fp16"/"float16"/"half", "bf16"/"bfloat16".
std::optional<DType> ParseDType(std::string_view name);

}  // namespace strata
