// The device kernels on the CPU: plain scalar loops. HostDevice runs these on
// its compute stream's thread, and the typed device tests use them as the
// reference for CudaDevice's kernels. fp16/bf16 are uint16_t bit patterns
// converted with src/common/half.h (round to nearest even).
#pragma once

#include <cstddef>
#include <cstdint>

#include "src/common/dtype.h"
#include "src/gpu/adam_coeffs.h"
#include "src/gpu/device.h"

namespace strata::gpu::host {

// Element conversions: the reference ones of src/common/dtype.h.
using ::strata::LoadAsFloat;
using ::strata::StoreFromFloat;

// dst[i] = convert(src[i]). src == dst with equal element sizes is allowed.
void Cast(const void* src, DType src_type, void* dst, DType dst_type, size_t n);
// x[i] *= inv_scale in place; returns true if any x[i] was inf/nan before or
// after scaling (after rounding to x's dtype).
bool UnscaleAndCheck(void* x, DType type, size_t n, float inv_scale);
// Σ x[i]² in double, in index order.
double SumSquares(const void* x, DType type, size_t n);
void Fill(void* x, DType type, size_t n, float value);

// ---- Adam/AdamW (host_adam.cc) ----

// The per-step coefficients (src/gpu/adam_coeffs.h) for `hp`.
AdamCoeffs MakeAdamCoeffs(const AdamHyperParams& hp);

// The plain reference: one element at a time, the order of float operations
// of src/cpu_adam/kernel_scalar.cc (no fused multiply-add: this file is built
// with -ffp-contract=off), so results are bitwise equal to the CPU
// optimizer's scalar kernel. HostDevice::AdamStep runs it.
void AdamStep(const AdamShard& shard, const AdamCoeffs& c);

}  // namespace strata::gpu::host
