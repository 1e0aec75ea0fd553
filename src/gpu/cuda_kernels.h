// Launchers for the CUDA kernels in cuda_kernels.cu. Internal to src/gpu:
// only cuda_device.cc includes this. Each launcher computes the grid, launches
// on `stream` and returns the launch's error (cudaGetLastError); n == 0
// launches nothing. `max_blocks` caps the grid (grid-stride loops cover the
// rest); pass a few blocks per SM.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "src/common/dtype.h"
#include "src/gpu/adam_coeffs.h"

namespace strata::gpu::cuda {

// dst[i] = convert(src[i]); src_type != dst_type (equal types are a memcpy).
cudaError_t LaunchCast(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                       int max_blocks, cudaStream_t stream);
// x[i] *= inv_scale in place; *found_inf = 1 if any x[i] is inf/nan before or
// after scaling.
cudaError_t LaunchUnscaleAndCheck(void* x, DType type, size_t n, float inv_scale,
                                  int32_t* found_inf, int max_blocks, cudaStream_t stream);
// *sum += Σ x[i]² (double accumulation, one atomicAdd per block).
cudaError_t LaunchSumSquares(const void* x, DType type, size_t n, double* sum, int max_blocks,
                             cudaStream_t stream);
// x[i] = value rounded to x's dtype (rounded once on the host with half.h).
cudaError_t LaunchFill(void* x, DType type, size_t n, float value, int max_blocks,
                       cudaStream_t stream);
cudaError_t LaunchFillInt32(int32_t* x, size_t n, int32_t value, int max_blocks,
                            cudaStream_t stream);
cudaError_t LaunchFillDouble(double* x, size_t n, double value, int max_blocks,
                             cudaStream_t stream);
// acc[i] += float(x[i]) (exact widening, one round-to-nearest fp32 add).
cudaError_t LaunchAddToFp32(float* acc, const void* x, DType type, size_t n, int max_blocks,
                            cudaStream_t stream);

// Forces every kernel of this file (and adam_kernel.cu) to be loaded now.
// CUDA loads kernels lazily by default (CUDA_MODULE_LOADING=LAZY since 12.2)
// and loading one may synchronize the whole context: a first launch while a
// stream waits for a host function that waits for the caller would hang.
// CudaDevice calls this once at creation.
cudaError_t LoadKernels();

// One tensor of a multi-tensor Adam launch (device pointers).
struct AdamTensor {
  float* param;
  const void* grad;
  void* exp_avg;  // fp32, or bf16 with LaunchAdam's bf16_moments
  void* exp_avg_sq;
  void* copy_out;  // null: no copy
  size_t count;
};
// Adam/AdamW over all `tensors` (all with the same grad dtype, copy
// dtype/presence and moment type: bf16_moments), in ceil(n /
// kAdamTensorsPerLaunch) launches on `stream`.
// If skip_if_set is non-null and *skip_if_set != 0 when a launch runs, it
// writes nothing. A tensor whose arrays are all 16-byte aligned runs the
// 16-byte vector path (AdamShardVectorizable's rule); `vector_tensors`, if
// non-null, is increased by the number of tensors (count > 0) launched on it.
inline constexpr int kAdamTensorsPerLaunch = 256;
cudaError_t LaunchAdam(const AdamTensor* tensors, size_t n, DType grad_dtype, bool copy,
                       DType copy_dtype, bool bf16_moments, const host::AdamCoeffs& c,
                       const int32_t* skip_if_set, cudaStream_t stream,
                       size_t* vector_tensors = nullptr);

// One tensor of a compact-format Adam launch (LaunchAdamCompact).
struct AdamCompactTensor {
  void* param;  // int8: the fp32 master; bf16 master: its bf16 bits
  const void* grad;
  void* exp_avg;  // int8 codes, or (bf16 master) bf16 bits
  void* exp_avg_sq;
  float* exp_avg_scale;  // int8: one per 256 elements; else null
  float* exp_avg_sq_scale;
  void* copy_out;  // null: no copy
  size_t count;
  uint64_t index0;  // global index of element 0 (bf16 master: the rounding stream)
};
// Adam/AdamW over `tensors` in the int8 format (int8) or with a bf16 master
// (bf16 moments), all with the same grad dtype and copy dtype/presence,
// src/cpu_adam's scalar bits for the same format (src/common/state_codes.h).
// One block of kAdamQuantBlock threads per quantization block at a time.
cudaError_t LaunchAdamCompact(const AdamCompactTensor* tensors, size_t n, bool int8,
                              DType grad_dtype, bool copy, DType copy_dtype,
                              const host::AdamCoeffs& c, const int32_t* skip_if_set,
                              cudaStream_t stream);

}  // namespace strata::gpu::cuda
