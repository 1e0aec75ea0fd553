// Fused multi-tensor Adam/AdamW for Device::AdamStep on CUDA (llm.c
// adamw.cuh layout: device helpers, the kernel, the host launcher).
//
// Per element it reads the fp32 master param, the gradient (fp32/fp16/bf16)
// and the moments m and v (fp32, or bf16: MB), and writes param, m, v and,
// optionally, the updated param converted to fp16/bf16/fp32 — one pass over
// HBM:
//   bytes moved per element = 24 (param, m, v: read + write; 16 with bf16
//                             moments) + grad (4|2) + copy (0|2|4)
//                             e.g. 26 bf16 grad, no copy; 28 with the bf16 copy.
// bf16 moments are widened to fp32, updated, and stored rounded to nearest
// even: src/cpu_adam's bf16 format, bit for bit.
// The arithmetic is src/cpu_adam/kernel_scalar.cc's, operation for operation,
// written with the _rn intrinsics so that nvcc cannot contract a multiply
// and an add into an fma: results equal the CPU scalar reference (sqrt and
// division are IEEE correctly rounded without fast-math).
//
// Multi-tensor: the host packs up to kAdamTensorsPerLaunch tensors into the
// kernel's parameter block (the device-side table; CUDA 12.1+ allows 32 KiB
// of parameters on sm_70+), each tensor cut into chunks of kChunk elements;
// block b finds its tensor by binary search over the chunk prefix sums. A
// tensor whose arrays are all 16-byte aligned moves 8 elements per thread
// per iteration with 16-byte loads and stores (two float4 per fp32 array, one
// uint4 for a 16-bit gradient or copy); others, and the tails, go one element
// at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "src/common/state_codes.h"
#include "src/gpu/cuda_kernels.h"

namespace strata::gpu::cuda {
namespace {

constexpr int kAdamThreads = 256;
constexpr int kVec = 8;                     // elements per thread per iteration (vector path)
constexpr size_t kChunk = 256 * kVec * 16;  // elements per block: 16 iterations of the block

struct TensorEntry {
  AdamTensor t;
  uint64_t first_chunk;  // prefix sum of chunks over the tensors before this one
  uint32_t vec;          // all arrays 16-byte aligned: the vector path
};

struct AdamTable {
  TensorEntry e[kAdamTensorsPerLaunch];
  int n;
};

// ---- device helpers ------------------------------------------------------------

template <int GD>  // 0 fp32, 1 fp16, 2 bf16
__device__ __forceinline__ float LoadGrad(const void* g, size_t i) {
  if constexpr (GD == 0)
    return static_cast<const float*>(g)[i];
  else if constexpr (GD == 1)
    return __half2float(__ushort_as_half(static_cast<const uint16_t*>(g)[i]));
  else
    return __bfloat162float(__ushort_as_bfloat16(static_cast<const uint16_t*>(g)[i]));
}
__device__ __forceinline__ float HalfBits(uint16_t b, int gd) {
  return gd == 1 ? __half2float(__ushort_as_half(b)) : __bfloat162float(__ushort_as_bfloat16(b));
}
template <int CD>  // 0 none, 1 fp32, 2 fp16, 3 bf16
__device__ __forceinline__ uint16_t ToHalfBits(float x) {
  if constexpr (CD == 2)
    return __half_as_ushort(__float2half_rn(x));  // round to nearest even
  else
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
template <int CD>
__device__ __forceinline__ void StoreCopy(void* out, size_t i, float x) {
  if constexpr (CD == 1)
    static_cast<float*>(out)[i] = x;
  else if constexpr (CD >= 2)
    static_cast<uint16_t*>(out)[i] = ToHalfBits<CD>(x);
}

// One element: kernel_scalar.cc's Adam/AdamW line for line (no contraction).
__device__ __forceinline__ void AdamElement(float& p, float g, float& m, float& v,
                                            const host::AdamCoeffs& c) {
  g = __fmul_rn(g, c.grad_scale);                                          // unscale × clip
  if (!c.adamw) g = __fadd_rn(__fmul_rn(c.l2, p), g);                      // Adam: L2 decay
  m = __fadd_rn(__fmul_rn(c.w1, __fsub_rn(g, m)), m);                      // m = lerp(m, g, 1-b1)
  v = __fadd_rn(__fmul_rn(c.w2, __fmul_rn(g, g)), __fmul_rn(c.beta2, v));  // v = b2 v + (1-b2) g²
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), c.inv_bc2_sqrt), c.eps);  // sqrt(v̂)+eps
  if (c.adamw) p = __fmul_rn(p, c.decay);                        // AdamW: decoupled decay
  p = __fadd_rn(__fmul_rn(c.neg_step, __fdiv_rn(m, denom)), p);  // p -= lr m̂ / denom
}

// Moment MB (0 fp32, 1 bf16) element i, and back (round to nearest even).
template <int MB>
__device__ __forceinline__ float LoadMoment(const void* a, size_t i) {
  if constexpr (MB == 0)
    return static_cast<const float*>(a)[i];
  else
    return __bfloat162float(__ushort_as_bfloat16(static_cast<const uint16_t*>(a)[i]));
}
template <int MB>
__device__ __forceinline__ void StoreMoment(void* a, size_t i, float x) {
  if constexpr (MB == 0)
    static_cast<float*>(a)[i] = x;
  else
    static_cast<uint16_t*>(a)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
// kVec consecutive moments from / to element j (16-byte aligned).
template <int MB>
__device__ __forceinline__ void LoadMoments(const void* a, size_t j, float* out) {
  if constexpr (MB == 0) {
    const float4* a4 = reinterpret_cast<const float4*>(static_cast<const float*>(a) + j);
    *reinterpret_cast<float4*>(out) = a4[0], *reinterpret_cast<float4*>(out + 4) = a4[1];
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a) + j);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = __bfloat162float(__ushort_as_bfloat16(h[k]));
  }
}
template <int MB>
__device__ __forceinline__ void StoreMoments(void* a, size_t j, const float* in) {
  if constexpr (MB == 0) {
    float4* a4 = reinterpret_cast<float4*>(static_cast<float*>(a) + j);
    a4[0] = *reinterpret_cast<const float4*>(in), a4[1] = *reinterpret_cast<const float4*>(in + 4);
  } else {
    uint4 out;
    uint16_t* h = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
    for (int k = 0; k < kVec; ++k) h[k] = __bfloat16_as_ushort(__float2bfloat16_rn(in[k]));
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a) + j) = out;
  }
}

// Which tensor holds chunk `b` (the last entry whose first_chunk <= b).
template <class Table>
__device__ __forceinline__ int FindTensor(const Table& tab, uint64_t b) {
  int lo = 0, hi = tab.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab.e[mid].first_chunk <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// ---- the kernel ---------------------------------------------------------------------

template <int GD, int CD, int MB>
__global__ void __launch_bounds__(kAdamThreads)
    AdamKernel(const __grid_constant__ AdamTable tab, const host::AdamCoeffs c,
               const int32_t* skip) {
  if (skip != nullptr && *skip != 0) return;  // overflow: the step is skipped
  const TensorEntry& e = tab.e[FindTensor(tab, blockIdx.x)];
  const AdamTensor& t = e.t;
  const size_t begin = (blockIdx.x - e.first_chunk) * kChunk;
  const size_t end = begin + kChunk < t.count ? begin + kChunk : t.count;
  size_t i = begin;
  if (e.vec) {
    // Vector body: 8 consecutive elements per thread, 16-byte accesses.
    const size_t vec_end = begin + (end - begin) / kVec * kVec;
    for (size_t j = begin + static_cast<size_t>(threadIdx.x) * kVec; j < vec_end;
         j += static_cast<size_t>(blockDim.x) * kVec) {
      float p[kVec], m[kVec], v[kVec], g[kVec];
      float4* p4 = reinterpret_cast<float4*>(t.param + j);
      *reinterpret_cast<float4*>(p) = p4[0], *reinterpret_cast<float4*>(p + 4) = p4[1];
      LoadMoments<MB>(t.exp_avg, j, m);
      LoadMoments<MB>(t.exp_avg_sq, j, v);
      if constexpr (GD == 0) {
        const float4* g4 = reinterpret_cast<const float4*>(static_cast<const float*>(t.grad) + j);
        *reinterpret_cast<float4*>(g) = g4[0], *reinterpret_cast<float4*>(g + 4) = g4[1];
      } else {
        const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.grad) + j);
        const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec; ++k) g[k] = HalfBits(h[k], GD);
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) AdamElement(p[k], g[k], m[k], v[k], c);
      p4[0] = *reinterpret_cast<float4*>(p), p4[1] = *reinterpret_cast<float4*>(p + 4);
      StoreMoments<MB>(t.exp_avg, j, m);
      StoreMoments<MB>(t.exp_avg_sq, j, v);
      if constexpr (CD == 1) {
        float4* c4 = reinterpret_cast<float4*>(static_cast<float*>(t.copy_out) + j);
        c4[0] = *reinterpret_cast<float4*>(p), c4[1] = *reinterpret_cast<float4*>(p + 4);
      } else if constexpr (CD >= 2) {
        uint4 out;
        uint16_t* h = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
        for (int k = 0; k < kVec; ++k) h[k] = ToHalfBits<CD>(p[k]);
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(t.copy_out) + j) = out;
      }
    }
    i = vec_end;
  }
  // Scalar: unaligned tensors entirely, the vector path's tail (< 8 elements).
  for (size_t j = i + threadIdx.x; j < end; j += blockDim.x) {
    float p = t.param[j], m = LoadMoment<MB>(t.exp_avg, j), v = LoadMoment<MB>(t.exp_avg_sq, j);
    AdamElement(p, LoadGrad<GD>(t.grad, j), m, v, c);
    t.param[j] = p;
    StoreMoment<MB>(t.exp_avg, j, m);
    StoreMoment<MB>(t.exp_avg_sq, j, v);
    StoreCopy<CD>(t.copy_out, j, p);
  }
}

// ---- the compact formats: int8 moments, a bf16 master ------------------------------
//
// kernel_scalar.cc's compact loop, one quantization block (256 elements) at
// a time per thread block, one element per thread: each thread steps its
// element (the codes and the stochastic rounding are
// src/common/state_codes.h's, the same functions the CPU runs); for int8 the
// block's absmax of the new moments is a max-reduction (exact and
// order-independent; NaN is dropped as the CPU's comparison drops it), then
// thread 0 writes the scales and every thread its codes.

constexpr size_t kCompactChunk = codes::kQuantBlock * 16;  // elements per thread block
static_assert(kAdamThreads == static_cast<int>(codes::kQuantBlock));

struct CompactEntry {
  AdamCompactTensor t;
  uint64_t first_chunk;
};
struct CompactTable {
  CompactEntry e[kAdamTensorsPerLaunch];
  int n;
};

// The maximum over the block of each thread's a and b (non-negative, no NaN).
__device__ __forceinline__ void BlockMax2(float& a, float& b) {
  __shared__ float sa[kAdamThreads / 32], sb[kAdamThreads / 32];
  for (int off = 16; off > 0; off /= 2) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, off));
  }
  if (threadIdx.x % 32 == 0) sa[threadIdx.x / 32] = a, sb[threadIdx.x / 32] = b;
  __syncthreads();
  a = sa[0], b = sb[0];
#pragma unroll
  for (int w = 1; w < kAdamThreads / 32; ++w) a = fmaxf(a, sa[w]), b = fmaxf(b, sb[w]);
  __syncthreads();  // the arrays are reused by the next block
}

__device__ __forceinline__ float Bf16ToFloat(uint16_t b) {
  return __bfloat162float(__ushort_as_bfloat16(b));
}

template <int GD, int CD, bool Q8>
__global__ void __launch_bounds__(kAdamThreads)
    AdamCompactKernel(const __grid_constant__ CompactTable tab, const host::AdamCoeffs c,
                      const int32_t* skip) {
  if (skip != nullptr && *skip != 0) return;  // overflow: the step is skipped
  const CompactEntry& e = tab.e[FindTensor(tab, blockIdx.x)];
  const AdamCompactTensor& t = e.t;
  const size_t begin = (blockIdx.x - e.first_chunk) * kCompactChunk;
  const size_t end = begin + kCompactChunk < t.count ? begin + kCompactChunk : t.count;
  const codes::SrKey key{c.sr_key0, c.sr_key1};
  for (size_t b0 = begin; b0 < end; b0 += codes::kQuantBlock) {
    const size_t i = b0 + threadIdx.x;
    const bool in = i < end;
    if constexpr (Q8) {
      auto* const param = static_cast<float*>(t.param);
      auto* const m8 = static_cast<uint8_t*>(t.exp_avg);
      auto* const v8 = static_cast<uint8_t*>(t.exp_avg_sq);
      const size_t blk = b0 / codes::kQuantBlock;
      float m = 0.f, v = 0.f;
      if (in) {
        float p = param[i];
        m = __fmul_rn(codes::DecodeExpAvg8(m8[i]), t.exp_avg_scale[blk]);
        v = __fmul_rn(codes::DecodeExpAvgSq8(v8[i]), t.exp_avg_sq_scale[blk]);
        AdamElement(p, LoadGrad<GD>(t.grad, i), m, v, c);
        param[i] = p;
        StoreCopy<CD>(t.copy_out, i, p);
      }
      const float am = fabsf(m), av = fabsf(v);
      float amax0 = am > 0.f ? am : 0.f, amax1 = av > 0.f ? av : 0.f;
      BlockMax2(amax0, amax1);  // every thread has read the old scales before this
      const codes::BlockScale q0 = codes::MakeBlockScale(amax0, codes::kExpAvgCodeMax);
      const codes::BlockScale q1 = codes::MakeBlockScale(amax1, codes::kExpAvgSqCodeMax);
      if (threadIdx.x == 0) t.exp_avg_scale[blk] = q0.scale, t.exp_avg_sq_scale[blk] = q1.scale;
      if (in) {
        m8[i] = codes::EncodeExpAvg8(m, q0.inv);
        v8[i] = codes::EncodeExpAvgSq8(v, q1.inv);
      }
    } else {
      if (!in) continue;
      auto* const pc = static_cast<uint16_t*>(t.param);
      auto* const mb = static_cast<uint16_t*>(t.exp_avg);
      auto* const vb = static_cast<uint16_t*>(t.exp_avg_sq);
      float p = Bf16ToFloat(pc[i]), m = Bf16ToFloat(mb[i]), v = Bf16ToFloat(vb[i]);
      AdamElement(p, LoadGrad<GD>(t.grad, i), m, v, c);
      mb[i] = __bfloat16_as_ushort(__float2bfloat16_rn(m));
      vb[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
      const uint16_t stored = codes::FloatToBf16Stochastic(p, codes::SrBits(t.index0 + i, key));
      pc[i] = stored;
      StoreCopy<CD>(t.copy_out, i, Bf16ToFloat(stored));  // the copy of the stored master
    }
  }
}

template <int GD, int CD, bool Q8>
cudaError_t LaunchCompactGroup(const AdamCompactTensor* tensors, size_t n,
                               const host::AdamCoeffs& c, const int32_t* skip,
                               cudaStream_t stream) {
  for (size_t base = 0; base < n; base += kAdamTensorsPerLaunch) {
    CompactTable tab{};
    uint64_t chunks = 0;
    for (size_t k = base; k < std::min(n, base + kAdamTensorsPerLaunch); ++k) {
      if (tensors[k].count == 0) continue;
      CompactEntry& e = tab.e[tab.n++];
      e.t = tensors[k];
      e.first_chunk = chunks;
      chunks += (tensors[k].count + kCompactChunk - 1) / kCompactChunk;
    }
    if (tab.n == 0) continue;
    if (chunks > 0x7fffffffu) return cudaErrorInvalidValue;
    AdamCompactKernel<GD, CD, Q8>
        <<<static_cast<unsigned>(chunks), kAdamThreads, 0, stream>>>(tab, c, skip);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <int GD, bool Q8>
cudaError_t LaunchCompactForGrad(const AdamCompactTensor* t, size_t n, bool copy, DType cd,
                                 const host::AdamCoeffs& c, const int32_t* skip, cudaStream_t s) {
  if (!copy) return LaunchCompactGroup<GD, 0, Q8>(t, n, c, skip, s);
  switch (cd) {
    case DType::kFp32:
      return LaunchCompactGroup<GD, 1, Q8>(t, n, c, skip, s);
    case DType::kFp16:
      return LaunchCompactGroup<GD, 2, Q8>(t, n, c, skip, s);
    case DType::kBf16:
      return LaunchCompactGroup<GD, 3, Q8>(t, n, c, skip, s);
  }
  return cudaErrorInvalidValue;
}

template <bool Q8>
cudaError_t LaunchCompactForFormat(const AdamCompactTensor* t, size_t n, DType gd, bool copy,
                                   DType cd, const host::AdamCoeffs& c, const int32_t* skip,
                                   cudaStream_t s) {
  switch (gd) {
    case DType::kFp32:
      return LaunchCompactForGrad<0, Q8>(t, n, copy, cd, c, skip, s);
    case DType::kFp16:
      return LaunchCompactForGrad<1, Q8>(t, n, copy, cd, c, skip, s);
    case DType::kBf16:
      return LaunchCompactForGrad<2, Q8>(t, n, copy, cd, c, skip, s);
  }
  return cudaErrorInvalidValue;
}

template <int GD, bool Q8>
cudaError_t LoadCompactForGrad() {
  cudaFuncAttributes attr{};
  for (cudaError_t e : {cudaFuncGetAttributes(&attr, AdamCompactKernel<GD, 0, Q8>),
                        cudaFuncGetAttributes(&attr, AdamCompactKernel<GD, 1, Q8>),
                        cudaFuncGetAttributes(&attr, AdamCompactKernel<GD, 2, Q8>),
                        cudaFuncGetAttributes(&attr, AdamCompactKernel<GD, 3, Q8>)})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int GD, int CD, int MB>
cudaError_t LaunchGroup(const AdamTensor* tensors, size_t n, const host::AdamCoeffs& c,
                        const int32_t* skip, cudaStream_t stream, size_t* vector_tensors) {
  for (size_t base = 0; base < n; base += kAdamTensorsPerLaunch) {
    AdamTable tab{};
    uint64_t chunks = 0;
    for (size_t k = base; k < std::min(n, base + kAdamTensorsPerLaunch); ++k) {
      const AdamTensor& t = tensors[k];
      if (t.count == 0) continue;
      TensorEntry& e = tab.e[tab.n++];
      e.t = t;
      e.first_chunk = chunks;
      e.vec = Aligned16(t.param) && Aligned16(t.grad) && Aligned16(t.exp_avg) &&
              Aligned16(t.exp_avg_sq) && (CD == 0 || Aligned16(t.copy_out));
      chunks += (t.count + kChunk - 1) / kChunk;
    }
    size_t vec = 0;
    for (int k = 0; k < tab.n; ++k) vec += tab.e[k].vec;
    if (tab.n == 0) continue;
    if (chunks > 0x7fffffffu) return cudaErrorInvalidValue;  // > 2^31 blocks: ~1.4e14 elements
    AdamKernel<GD, CD, MB>
        <<<static_cast<unsigned>(chunks), kAdamThreads, 0, stream>>>(tab, c, skip);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    if (vector_tensors != nullptr) *vector_tensors += vec;
  }
  return cudaSuccess;
}

template <int GD, int MB>
cudaError_t LaunchForGrad(const AdamTensor* t, size_t n, bool copy, DType cd,
                          const host::AdamCoeffs& c, const int32_t* skip, cudaStream_t s,
                          size_t* v) {
  if (!copy) return LaunchGroup<GD, 0, MB>(t, n, c, skip, s, v);
  switch (cd) {
    case DType::kFp32:
      return LaunchGroup<GD, 1, MB>(t, n, c, skip, s, v);
    case DType::kFp16:
      return LaunchGroup<GD, 2, MB>(t, n, c, skip, s, v);
    case DType::kBf16:
      return LaunchGroup<GD, 3, MB>(t, n, c, skip, s, v);
  }
  return cudaErrorInvalidValue;
}

template <int MB>
cudaError_t LaunchForMoments(const AdamTensor* t, size_t n, DType gd, bool copy, DType cd,
                             const host::AdamCoeffs& c, const int32_t* skip, cudaStream_t s,
                             size_t* v) {
  switch (gd) {
    case DType::kFp32:
      return LaunchForGrad<0, MB>(t, n, copy, cd, c, skip, s, v);
    case DType::kFp16:
      return LaunchForGrad<1, MB>(t, n, copy, cd, c, skip, s, v);
    case DType::kBf16:
      return LaunchForGrad<2, MB>(t, n, copy, cd, c, skip, s, v);
  }
  return cudaErrorInvalidValue;
}

template <int GD, int CD, int MB>
cudaError_t LoadOne() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, AdamKernel<GD, CD, MB>);
}
template <int GD, int MB>
cudaError_t LoadForGrad() {
  for (cudaError_t e :
       {LoadOne<GD, 0, MB>(), LoadOne<GD, 1, MB>(), LoadOne<GD, 2, MB>(), LoadOne<GD, 3, MB>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchAdam(const AdamTensor* tensors, size_t n, DType grad_dtype, bool copy,
                       DType copy_dtype, bool bf16_moments, const host::AdamCoeffs& c,
                       const int32_t* skip_if_set, cudaStream_t stream, size_t* vector_tensors) {
  if (bf16_moments)
    return LaunchForMoments<1>(tensors, n, grad_dtype, copy, copy_dtype, c, skip_if_set, stream,
                               vector_tensors);
  return LaunchForMoments<0>(tensors, n, grad_dtype, copy, copy_dtype, c, skip_if_set, stream,
                             vector_tensors);
}

cudaError_t LaunchAdamCompact(const AdamCompactTensor* tensors, size_t n, bool int8,
                              DType grad_dtype, bool copy, DType copy_dtype,
                              const host::AdamCoeffs& c, const int32_t* skip_if_set,
                              cudaStream_t stream) {
  if (int8)
    return LaunchCompactForFormat<true>(tensors, n, grad_dtype, copy, copy_dtype, c, skip_if_set,
                                        stream);
  return LaunchCompactForFormat<false>(tensors, n, grad_dtype, copy, copy_dtype, c, skip_if_set,
                                       stream);
}

namespace internal_adam {
cudaError_t LoadAdamKernels() {
  for (cudaError_t e : {LoadForGrad<0, 0>(), LoadForGrad<1, 0>(), LoadForGrad<2, 0>(),
                        LoadForGrad<0, 1>(), LoadForGrad<1, 1>(), LoadForGrad<2, 1>(),
                        LoadCompactForGrad<0, false>(), LoadCompactForGrad<1, false>(),
                        LoadCompactForGrad<2, false>(), LoadCompactForGrad<0, true>(),
                        LoadCompactForGrad<1, true>(), LoadCompactForGrad<2, true>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}
}  // namespace internal_adam

}  // namespace strata::gpu::cuda
