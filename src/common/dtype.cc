#include "src/common/dtype.h"

namespace strata {

std::optional<DType> ParseDType(std::string_view n) {
  if (n == "fp32" || n == "float32" || n == "float") return DType::kFp32;
  if (n == "fp16" || n == "float16" || n == "half") return DType::kFp16;
  if (n == "bf16" || n == "bfloat16") return DType::kBf16;
  return std::nullopt;
}

}  // namespace strata
