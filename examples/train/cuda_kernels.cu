// Kernels of the example model's CUDA backend (cuda_backend.cc runs them on
// Engine::ComputeStream() between cuBLAS GEMMs). Built when STRATA_HAVE_CUDA.
// Raw pointers and cudaError_t only: no framework types in device code.
//
// Parameters arrive as bf16/fp16/fp32 device tensors; each module's weights are
// widened once per use into an fp32 workspace (2 bytes read + 4 written per
// element) and its fp32 gradients narrowed into the engine's gradient buffers
// (4 read + 2 written). Activations are fp32. Per element of the activations:
// embedding 3 gathers; rms norm 2 passes over a row; bias+gelu 1 read, 2
// writes; softmax cross-entropy one block per row (V = 256 threads).
// The embedding backward scatter-adds with atomics (order not deterministic
// on the GPU; the host backend is the bitwise reference).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "examples/train/cuda_kernels.h"

namespace strata::example::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kRmsEps = 1e-5f;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }
unsigned Grid(int64_t n) { return std::min<unsigned>(Blocks(n), 65535u * 8); }  // grid-stride loops cover the rest

// ---- device helpers --------------------------------------------------------
__device__ inline float Load(const void* p, int dtype, int64_t i) {
  // dtype: 0 fp32, 1 fp16, 2 bf16 (strata::DType values)
  if (dtype == 0) return static_cast<const float*>(p)[i];
  if (dtype == 1) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ inline void Store(void* p, int dtype, int64_t i, float v) {
  if (dtype == 0) static_cast<float*>(p)[i] = v;
  else if (dtype == 1) static_cast<__half*>(p)[i] = __float2half_rn(v);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}
__device__ inline float BlockSum(float v, float* shared) {
  // Sum over the block (blockDim.x a multiple of 32, at most 1024).
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : 0.f;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  const float total = shared[0];
  __syncthreads();
  return total;
}
__device__ inline float BlockMax(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : -INFINITY;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  const float total = shared[0];
  __syncthreads();
  return total;
}

// ---- kernels ---------------------------------------------------------------
// out[i] = float(in[i]): widen a parameter.
__global__ void WidenKernel(const void* in, int dtype, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = Load(in, dtype, i);
}
// out[i] = narrow(in[i]): a gradient into the engine's buffer.
__global__ void NarrowKernel(const float* in, void* out, int dtype, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    Store(out, dtype, i, in[i]);
}
// h0[n, j] = tok[x_t] + prev1[x_{t-1}] + prev2[x_{t-2}]
__global__ void EmbedForwardKernel(const int32_t* x, int64_t seq, int64_t H, int64_t N, const float* tok,
                                   const float* p1, const float* p2, float* h0) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * H; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / H, j = i % H, t = n % seq;
    float v = tok[x[n] * H + j];
    if (t >= 1) v += p1[x[n - 1] * H + j];
    if (t >= 2) v += p2[x[n - 2] * H + j];
    h0[i] = v;
  }
}
// Scatter-add dh into the three (zeroed) fp32 table gradients.
__global__ void EmbedBackwardKernel(const int32_t* x, int64_t seq, int64_t H, int64_t N, const float* dh, float* g0,
                                    float* g1, float* g2) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * H; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / H, j = i % H, t = n % seq;
    const float d = dh[i];
    atomicAdd(&g0[x[n] * H + j], d);
    if (t >= 1) atomicAdd(&g1[x[n - 1] * H + j], d);
    if (t >= 2) atomicAdd(&g2[x[n - 2] * H + j], d);
  }
}
// One block per row: r = sqrt(mean(h²) + eps); u = h / r.
__global__ void RmsForwardKernel(const float* h, int64_t H, float* u, float* r) {
  __shared__ float sh[32];
  const float* row = h + blockIdx.x * H;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) ss += row[j] * row[j];
  ss = BlockSum(ss, sh);
  const float rn = sqrtf(ss / static_cast<float>(H) + kRmsEps);
  if (threadIdx.x == 0) r[blockIdx.x] = rn;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) u[blockIdx.x * H + j] = row[j] / rn;
}
// One block per row: dh (= or +=) (du − u · mean(du ⊙ u)) / r.
__global__ void RmsBackwardKernel(const float* u, const float* r, const float* du, int64_t H, int accumulate,
                                  float* dh) {
  __shared__ float sh[32];
  const int64_t off = blockIdx.x * H;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dot += du[off + j] * u[off + j];
  const float mean = BlockSum(dot, sh) / static_cast<float>(H);
  const float inv = 1.f / r[blockIdx.x];
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float v = (du[off + j] - u[off + j] * mean) * inv;
    dh[off + j] = accumulate ? dh[off + j] + v : v;
  }
}
// a += b (per column); g = gelu(a).
__global__ void BiasGeluKernel(float* a, const float* b, int64_t N, int64_t F, float* g) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * F; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = a[i] + b[i % F];
    a[i] = v;
    g[i] = 0.5f * v * (1.f + tanhf(kGeluK * (v + kGeluC * v * v * v)));
  }
}
// dg *= gelu'(a).
__global__ void GeluBackwardKernel(const float* a, float* dg, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = a[i];
    const float t = tanhf(kGeluK * (v + kGeluC * v * v * v));
    dg[i] *= 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * v * v);
  }
}
// out[n, j] = x[n, j] + b[j]  (x may be null: out = b broadcast).
__global__ void AddRowBiasKernel(const float* x, const float* b, int64_t N, int64_t C, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * C; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = (x ? x[i] : 0.f) + b[i % C];
}
// out[j] = Σ_n x[n, j] (one thread per column; deterministic).
__global__ void ColumnSumKernel(const float* x, int64_t N, int64_t C, float* out) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= C) return;
  float s = 0.f;
  for (int64_t n = 0; n < N; ++n) s += x[n * C + j];
  out[j] = s;
}
// One block per row of V logits: loss[n] = logsumexp(z) − z[y]; z becomes
// (softmax(z) − onehot(y)) · scale.
__global__ void SoftmaxXentKernel(float* z, const int32_t* y, int64_t V, float scale, float* loss) {
  __shared__ float sh[32];
  float* row = z + blockIdx.x * V;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = BlockMax(mx, sh);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(row[j] - mx);
  s = BlockSum(s, sh);
  const int32_t target = y[blockIdx.x];
  if (threadIdx.x == 0) loss[blockIdx.x] = logf(s) - (row[target] - mx);
  __syncthreads();  // row[target] is read above before it is overwritten below
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float p = expf(row[j] - mx) / s;
    row[j] = (p - (j == target ? 1.f : 0.f)) * scale;
  }
}

}  // namespace

cudaError_t Widen(const void* in, int dtype, float* out, int64_t n, cudaStream_t s) {
  WidenKernel<<<Grid(n), kThreads, 0, s>>>(in, dtype, out, n);
  return cudaGetLastError();
}
cudaError_t Narrow(const float* in, void* out, int dtype, int64_t n, cudaStream_t s) {
  NarrowKernel<<<Grid(n), kThreads, 0, s>>>(in, out, dtype, n);
  return cudaGetLastError();
}
cudaError_t EmbedForward(const int32_t* x, int64_t seq, int64_t H, int64_t N, const float* tok, const float* p1,
                         const float* p2, float* h0, cudaStream_t s) {
  EmbedForwardKernel<<<Grid(N * H), kThreads, 0, s>>>(x, seq, H, N, tok, p1, p2, h0);
  return cudaGetLastError();
}
cudaError_t EmbedBackward(const int32_t* x, int64_t seq, int64_t H, int64_t N, const float* dh, float* g0, float* g1,
                          float* g2, cudaStream_t s) {
  EmbedBackwardKernel<<<Grid(N * H), kThreads, 0, s>>>(x, seq, H, N, dh, g0, g1, g2);
  return cudaGetLastError();
}
cudaError_t RmsForward(const float* h, int64_t N, int64_t H, float* u, float* r, cudaStream_t s) {
  RmsForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, s>>>(h, H, u, r);
  return cudaGetLastError();
}
cudaError_t RmsBackward(const float* u, const float* r, const float* du, int64_t N, int64_t H, bool accumulate,
                        float* dh, cudaStream_t s) {
  RmsBackwardKernel<<<static_cast<unsigned>(N), kThreads, 0, s>>>(u, r, du, H, accumulate ? 1 : 0, dh);
  return cudaGetLastError();
}
cudaError_t BiasGelu(float* a, const float* b, int64_t N, int64_t F, float* g, cudaStream_t s) {
  BiasGeluKernel<<<Grid(N * F), kThreads, 0, s>>>(a, b, N, F, g);
  return cudaGetLastError();
}
cudaError_t GeluBackward(const float* a, float* dg, int64_t n, cudaStream_t s) {
  GeluBackwardKernel<<<Grid(n), kThreads, 0, s>>>(a, dg, n);
  return cudaGetLastError();
}
cudaError_t AddRowBias(const float* x, const float* b, int64_t N, int64_t C, float* out, cudaStream_t s) {
  AddRowBiasKernel<<<Grid(N * C), kThreads, 0, s>>>(x, b, N, C, out);
  return cudaGetLastError();
}
cudaError_t ColumnSum(const float* x, int64_t N, int64_t C, float* out, cudaStream_t s) {
  ColumnSumKernel<<<Blocks(C), kThreads, 0, s>>>(x, N, C, out);
  return cudaGetLastError();
}
cudaError_t SoftmaxXent(float* z, const int32_t* y, int64_t N, int64_t V, float scale, float* loss, cudaStream_t s) {
  SoftmaxXentKernel<<<static_cast<unsigned>(N), kThreads, 0, s>>>(z, y, V, scale, loss);
  return cudaGetLastError();
}

}  // namespace strata::example::cuda
