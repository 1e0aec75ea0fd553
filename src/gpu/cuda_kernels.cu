// The device layer's CUDA kernels (llm.c layout: device helpers, kernels,
// launchers that take the stream and check the launch).
//
//   cast             dst[i] = convert(src[i])      bytes/elem: size(src) + size(dst)
//   unscale+check    x[i] *= inv_scale; flag inf/nan  bytes/elem: 2 × size(x)
//   sum of squares   *sum += Σ x[i]² (double)       bytes/elem: size(x)
//   fill             x[i] = value                    bytes/elem: size(x)
//
// fp16/bf16 travel as uint16_t bit patterns and are converted with the
// round-to-nearest-even intrinsics (__float2half_rn, __float2bfloat16_rn);
// widening is exact. Built without fast-math, so subnormals are kept (no FTZ)
// and fp32 arithmetic is IEEE round-to-nearest, matching the CPU reference in
// host_kernels.cc. All loops are grid-stride with 64-bit indices.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "src/common/half.h"
#include "src/gpu/cuda_kernels.h"

namespace strata::gpu::cuda {
namespace {

constexpr int kThreads = 256;        // elementwise kernels
constexpr int kReduceThreads = 512;  // sum of squares (multiple of 32)

// ---- device helpers: one tag type per dtype --------------------------------

struct F32 {
  using T = float;
};
struct F16 {
  using T = uint16_t;
};
struct BF16 {
  using T = uint16_t;
};

__device__ __forceinline__ float ToFloat(F32, float v) { return v; }
__device__ __forceinline__ float ToFloat(F16, uint16_t b) {
  return __half2float(__ushort_as_half(b));  // exact
}
__device__ __forceinline__ float ToFloat(BF16, uint16_t b) {
  return __bfloat162float(__ushort_as_bfloat16(b));  // exact
}
__device__ __forceinline__ float FromFloat(F32, float v) { return v; }
__device__ __forceinline__ uint16_t FromFloat(F16, float v) {
  return __half_as_ushort(__float2half_rn(v));  // round to nearest even
}
__device__ __forceinline__ uint16_t FromFloat(BF16, float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));  // round to nearest even
}

__device__ __forceinline__ size_t GlobalIndex() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t GridStride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

int Blocks(size_t n, int threads, int max_blocks) {
  const size_t need = (n + threads - 1) / threads;
  const size_t cap = max_blocks > 0 ? static_cast<size_t>(max_blocks) : 1;
  return static_cast<int>(need < cap ? need : cap);
}

// ---- kernels -------------------------------------------------------------------

// In place (src == dst) is allowed when the element sizes match: each thread
// reads element i before writing it, so no __restrict__ here.
template <class S, class D>
__global__ void CastKernel(const typename S::T* src, typename D::T* dst, size_t n) {
  for (size_t i = GlobalIndex(); i < n; i += GridStride()) {
    dst[i] = FromFloat(D{}, ToFloat(S{}, src[i]));  // widen exactly, round once
  }
}

template <class D>
__global__ void UnscaleKernel(typename D::T* x, size_t n, float inv_scale, int32_t* found_inf) {
  int bad = 0;
  for (size_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = ToFloat(D{}, x[i]);
    bad |= !isfinite(v);  // overflowed in the scaled backward pass
    const typename D::T r = FromFloat(D{}, v * inv_scale);  // unscale, round to the dtype
    x[i] = r;
    bad |= !isfinite(ToFloat(D{}, r));  // unscaling overflowed the dtype
  }
  // One store per block that saw a bad value; concurrent stores all write 1.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1;
}

template <class D>
__global__ void SumSquaresKernel(const typename D::T* x, size_t n, double* sum) {
  double acc = 0.0;
  for (size_t i = GlobalIndex(); i < n; i += GridStride()) {
    const double v = ToFloat(D{}, x[i]);  // widen exactly
    acc += v * v;
  }
  // Reduce within each warp, then across the block's warps, then one atomic.
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  __shared__ double warp_sums[kReduceThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) atomicAdd(sum, acc);  // double atomicAdd: sm_60+
  }
}

// acc[i] += float(x[i]): reads 4 + sizeof(T), writes 4 bytes per element.
template <class S>
__global__ void AddToFp32Kernel(float* __restrict__ acc, const typename S::T* __restrict__ x,
                                size_t n) {
  for (size_t i = GlobalIndex(); i < n; i += GridStride()) {
    acc[i] = __fadd_rn(acc[i], ToFloat(S{}, x[i]));  // one rounding, never fused
  }
}

template <typename T>
__global__ void FillKernel(T* x, size_t n, T value) {
  for (size_t i = GlobalIndex(); i < n; i += GridStride()) x[i] = value;
}

// ---- launch helpers ----------------------------------------------------------------

template <class S, class D>
cudaError_t CastTo(const void* src, void* dst, size_t n, int max_blocks, cudaStream_t s) {
  CastKernel<S, D><<<Blocks(n, kThreads, max_blocks), kThreads, 0, s>>>(
      static_cast<const typename S::T*>(src), static_cast<typename D::T*>(dst), n);
  return cudaGetLastError();
}

template <class S>
cudaError_t CastFrom(const void* src, DType dst_type, void* dst, size_t n, int max_blocks,
                     cudaStream_t s) {
  switch (dst_type) {
    case DType::kFp32:
      return CastTo<S, F32>(src, dst, n, max_blocks, s);
    case DType::kFp16:
      return CastTo<S, F16>(src, dst, n, max_blocks, s);
    case DType::kBf16:
      return CastTo<S, BF16>(src, dst, n, max_blocks, s);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t FillT(T* x, size_t n, T value, int max_blocks, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  FillKernel<T><<<Blocks(n, kThreads, max_blocks), kThreads, 0, s>>>(x, n, value);
  return cudaGetLastError();
}

template <typename K>
cudaError_t Load(K* kernel) {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace

namespace internal_adam {
cudaError_t LoadAdamKernels();  // adam_kernel.cu
}  // namespace internal_adam

cudaError_t LoadKernels() {
  const cudaError_t errs[] = {
      Load(CastKernel<F32, F16>),  Load(CastKernel<F32, BF16>),     Load(CastKernel<F16, F32>),
      Load(CastKernel<F16, BF16>), Load(CastKernel<BF16, F32>),     Load(CastKernel<BF16, F16>),
      Load(UnscaleKernel<F32>),    Load(UnscaleKernel<F16>),        Load(UnscaleKernel<BF16>),
      Load(SumSquaresKernel<F32>), Load(SumSquaresKernel<F16>),     Load(SumSquaresKernel<BF16>),
      Load(FillKernel<float>),     Load(FillKernel<uint16_t>),      Load(FillKernel<int32_t>),
      Load(FillKernel<double>),    Load(AddToFp32Kernel<F32>),      Load(AddToFp32Kernel<F16>),
      Load(AddToFp32Kernel<BF16>), internal_adam::LoadAdamKernels()};
  for (cudaError_t e : errs)
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

// ---- launchers -------------------------------------------------------------------------

cudaError_t LaunchCast(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                       int max_blocks, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (src_type == dst_type) return cudaErrorInvalidValue;  // the caller copies instead
  switch (src_type) {
    case DType::kFp32:
      return CastFrom<F32>(src, dst_type, dst, n, max_blocks, stream);
    case DType::kFp16:
      return CastFrom<F16>(src, dst_type, dst, n, max_blocks, stream);
    case DType::kBf16:
      return CastFrom<BF16>(src, dst_type, dst, n, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchUnscaleAndCheck(void* x, DType type, size_t n, float inv_scale,
                                  int32_t* found_inf, int max_blocks, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = Blocks(n, kThreads, max_blocks);
  switch (type) {
    case DType::kFp32:
      UnscaleKernel<F32>
          <<<blocks, kThreads, 0, stream>>>(static_cast<float*>(x), n, inv_scale, found_inf);
      break;
    case DType::kFp16:
      UnscaleKernel<F16>
          <<<blocks, kThreads, 0, stream>>>(static_cast<uint16_t*>(x), n, inv_scale, found_inf);
      break;
    case DType::kBf16:
      UnscaleKernel<BF16>
          <<<blocks, kThreads, 0, stream>>>(static_cast<uint16_t*>(x), n, inv_scale, found_inf);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchSumSquares(const void* x, DType type, size_t n, double* sum, int max_blocks,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  // Fewer, larger blocks: one atomic per block.
  const int blocks = Blocks(n, kReduceThreads, max_blocks > 4 ? max_blocks / 4 : 1);
  switch (type) {
    case DType::kFp32:
      SumSquaresKernel<F32>
          <<<blocks, kReduceThreads, 0, stream>>>(static_cast<const float*>(x), n, sum);
      break;
    case DType::kFp16:
      SumSquaresKernel<F16>
          <<<blocks, kReduceThreads, 0, stream>>>(static_cast<const uint16_t*>(x), n, sum);
      break;
    case DType::kBf16:
      SumSquaresKernel<BF16>
          <<<blocks, kReduceThreads, 0, stream>>>(static_cast<const uint16_t*>(x), n, sum);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchFill(void* x, DType type, size_t n, float value, int max_blocks,
                       cudaStream_t stream) {
  switch (type) {
    case DType::kFp32:
      return FillT<float>(static_cast<float*>(x), n, value, max_blocks, stream);
    case DType::kFp16:
      return FillT<uint16_t>(static_cast<uint16_t*>(x), n, FloatToHalfBits(value), max_blocks,
                             stream);
    case DType::kBf16:
      return FillT<uint16_t>(static_cast<uint16_t*>(x), n, FloatToBf16Bits(value), max_blocks,
                             stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchFillInt32(int32_t* x, size_t n, int32_t value, int max_blocks,
                            cudaStream_t stream) {
  return FillT<int32_t>(x, n, value, max_blocks, stream);
}

cudaError_t LaunchFillDouble(double* x, size_t n, double value, int max_blocks,
                             cudaStream_t stream) {
  return FillT<double>(x, n, value, max_blocks, stream);
}

cudaError_t LaunchAddToFp32(float* acc, const void* x, DType type, size_t n, int max_blocks,
                            cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = Blocks(n, kThreads, max_blocks);
  switch (type) {
    case DType::kFp32:
      AddToFp32Kernel<F32><<<blocks, kThreads, 0, stream>>>(acc, static_cast<const float*>(x), n);
      break;
    case DType::kFp16:
      AddToFp32Kernel<F16>
          <<<blocks, kThreads, 0, stream>>>(acc, static_cast<const uint16_t*>(x), n);
      break;
    case DType::kBf16:
      AddToFp32Kernel<BF16>
          <<<blocks, kThreads, 0, stream>>>(acc, static_cast<const uint16_t*>(x), n);
      break;
  }
  return cudaGetLastError();
}

}  // namespace strata::gpu::cuda
