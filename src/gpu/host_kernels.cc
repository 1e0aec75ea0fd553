// Scalar CPU kernels; see host_kernels.h. Bytes moved per element: cast
// src+dst size, unscale 2×size, sum of squares 1×size, fill 1×size.
#include "src/gpu/host_kernels.h"

#include <cmath>
#include <cstring>

#include "src/common/half.h"

namespace strata::gpu::host {

float LoadAsFloat(const void* p, DType t, size_t i) {
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

void StoreFromFloat(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::kFp32:
      static_cast<float*>(p)[i] = v;
      return;
    case DType::kFp16:
      static_cast<uint16_t*>(p)[i] = FloatToHalfBits(v);
      return;
    case DType::kBf16:
      static_cast<uint16_t*>(p)[i] = FloatToBf16Bits(v);
      return;
  }
}

void Cast(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (src_type == dst_type) {
    if (src != dst) std::memmove(dst, src, n * DTypeSize(src_type));
    return;
  }
  // Widening through fp32 is exact, so fp16↔bf16 is rounded once.
  for (size_t i = 0; i < n; ++i) StoreFromFloat(dst, dst_type, i, LoadAsFloat(src, src_type, i));
}

bool UnscaleAndCheck(void* x, DType type, size_t n, float inv_scale) {
  bool found = false;
  for (size_t i = 0; i < n; ++i) {
    const float v = LoadAsFloat(x, type, i);
    found |= !std::isfinite(v);  // the scaled gradient overflowed in backward
    StoreFromFloat(x, type, i, v * inv_scale);
    found |= !std::isfinite(LoadAsFloat(x, type, i));  // unscaling overflowed the dtype
  }
  return found;
}

double SumSquares(const void* x, DType type, size_t n) {
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double v = LoadAsFloat(x, type, i);
    sum += v * v;
  }
  return sum;
}

void Fill(void* x, DType type, size_t n, float value) {
  for (size_t i = 0; i < n; ++i) StoreFromFloat(x, type, i, value);
}

}  // namespace strata::gpu::host
