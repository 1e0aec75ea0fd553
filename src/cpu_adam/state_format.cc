// Whole arrays in a state format (EncodeState, DecodeState): bf16 and int8
// by the vectorized conversions of the best ISA table — the codes of
// state_codes.h, the same bits the kernels store (tested against the scalar
// table on every ISA).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "src/common/half.h"
#include "src/common/status_util.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/cpu_adam/kernel.h"
#include "src/cpu_adam/state_codes.h"

namespace strata::cpu_adam {

namespace {

// The best kernel table here (the int8 conversions are the same bits on
// every ISA: integer operations and single multiplies).
const internal::KernelTable& Table() {
  static const internal::KernelTable* const t = internal::UsableTables().front();
  return *t;
}

Status CheckArrays(const char* fn, StateFormat f, StateRole r, const void* a, const void* b,
                   const float* scales, size_t count) {
  const int fi = static_cast<int>(f), ri = static_cast<int>(r);
  if (fi < 0 || fi > 3 || ri < 0 || ri > 2)
    return InvalidArgumentError(std::string("cpu_adam: ") + fn + ": unknown format or role");
  if (count == 0) return Status::Ok();
  if (a == nullptr || b == nullptr)
    return InvalidArgumentError(std::string("cpu_adam: ") + fn + ": null src or dst (count " +
                                std::to_string(count) + ")");
  if (StateScaleCount(f, r, count) != 0 && scales == nullptr)
    return InvalidArgumentError(std::string("cpu_adam: ") + fn + " (" +
                                std::string(StateFormatName(f)) +
                                "): scales is null (one fp32 per 256 elements needed)");
  return Status::Ok();
}

}  // namespace

Status EncodeState(StateFormat f, StateRole r, const float* src, size_t count, void* dst,
                   float* scales) {
  RETURN_IF_ERROR(CheckArrays("EncodeState", f, r, src, dst, scales, count));
  if (count == 0) return Status::Ok();
  const size_t eb = StateElementBytes(f, r);
  if (eb == 4) {
    std::memcpy(dst, src, count * 4);
  } else if (eb == 2) {
    Table().f32_to_bf16(src, static_cast<uint16_t*>(dst), count);
  } else {
    Table().quantize_q8[r == StateRole::kExpAvgSq ? 1 : 0](src, count, static_cast<uint8_t*>(dst),
                                                           scales);
  }
  return Status::Ok();
}

Status DecodeState(StateFormat f, StateRole r, const void* src, const float* scales, size_t count,
                   float* dst) {
  RETURN_IF_ERROR(CheckArrays("DecodeState", f, r, src, dst, scales, count));
  if (count == 0) return Status::Ok();
  const size_t eb = StateElementBytes(f, r);
  if (eb == 4) {
    std::memcpy(dst, src, count * 4);
  } else if (eb == 2) {
    Table().bf16_to_f32(static_cast<const uint16_t*>(src), dst, count);
  } else {
    Table().dequantize_q8[r == StateRole::kExpAvgSq ? 1 : 0](static_cast<const uint8_t*>(src),
                                                             scales, count, dst);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_adam
