// Scalar CPU kernels; see host_kernels.h. Bytes moved per element: cast
// src+dst size, unscale 2×size, sum of squares 1×size, fill 1×size.
#include "src/gpu/host_kernels.h"

#include <cmath>
#include <cstring>

#include "src/common/half.h"

namespace strata::gpu::host {

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
