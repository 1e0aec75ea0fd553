// Element types Strata moves and computes on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "src/common/half.h"
#include "strata/dtype.h"

namespace strata {

constexpr size_t DTypeSize(DType t) { return t == DType::kFp32 ? 4 : 2; }
constexpr std::string_view DTypeName(DType t) {
  return t == DType::kFp32 ? "fp32" : (t == DType::kFp16 ? "fp16" : "bf16");
}
// "fp32"/"float32", "fp16"/"float16"/"half", "bf16"/"bfloat16".
std::optional<DType> ParseDType(std::string_view name);

// Element i of an array of type t, as fp32 (exact) / stored from fp32 (round
// to nearest even, see half.h). The plain reference conversions; vector and
// GPU kernels are tested against these.
inline float LoadAsFloat(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kFp32:
      return static_cast<const float*>(p)[i];
    case DType::kFp16:
      return HalfBitsToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kBf16:
      return Bf16BitsToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.f;
}
inline void StoreFromFloat(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::kFp32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kFp16:
      static_cast<uint16_t*>(p)[i] = FloatToHalfBits(v);
      break;
    case DType::kBf16:
      static_cast<uint16_t*>(p)[i] = FloatToBf16Bits(v);
      break;
  }
}

}  // namespace strata
