// Kernels of the example model's CUDA backend (cuda_backend.cc runs them on
// Engine::ComputeStream() between cuBLAS GEMMs). Built when STRATA_HAVE_CUDA.
// Raw pointers and cudaError_t only: no framework types in device code.
//
// T is the parameter dtype (fp32, fp16 or bf16): parameters are read as they
// are, gradients written in T, and every kernel that produces a GEMM operand
// writes it in T so that cuBLAS runs T × T on tensor cores with fp32
// accumulation. Arithmetic is fp32 throughout. Bytes per element (bf16):
//   embedding forward    3 gathers of 2 B, 4 B written
//   embedding backward   4-12 B read (dh), 2 B written per table element
//   rms forward          4 B read twice (the second from cache), 2 B written
//   rms backward         12 B read, 4 B written (8 read when not accumulating)
//   bias + gelu          4 B read, 2 B written
//   gelu' + bias grad    6 B read, 2 B written, plus kColumnChunks partial sums
//   column sum + cast    4 B read, 2 B written
//   softmax xent         4 B read, 4 B written per logit (one block per row)
// Column sums are two-pass with a chunking that depends on the shape only
// (ColumnChunks), and the embedding backward gathers in position order: every
// kernel is deterministic.
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
// Element-wise kernels over N rows × C columns: blockIdx.x tiles the columns,
// blockIdx.y strides over the rows (no 64-bit division per element).
dim3 RowGrid(int64_t N, int64_t C) {
  return dim3(Blocks(C), static_cast<unsigned>(std::min<int64_t>(N, 65535)));
}
// Threads for one block per row of C columns: a multiple of 32, at most kThreads.
unsigned RowThreads(int64_t C) {
  return static_cast<unsigned>(std::min<int64_t>(kThreads, (C + 31) / 32 * 32));
}

// ---- device helpers --------------------------------------------------------
__device__ inline float ToFloat(float v) { return v; }
__device__ inline float ToFloat(__half v) { return __half2float(v); }
__device__ inline float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ inline T FromFloat(float v);  // round to nearest even
template <>
__device__ inline float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ inline __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ inline float Gelu(float v) {
  return 0.5f * v * (1.f + tanhf(kGeluK * (v + kGeluC * v * v * v)));
}
__device__ inline float GeluGrad(float v) {
  const float t = tanhf(kGeluK * (v + kGeluC * v * v * v));
  // d/dv [0.5 v (1 + t)] = 0.5 (1 + t) + 0.5 v (1 − t²) k (1 + 3c v²)
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * v * v);
}

// Sum / max over the block (blockDim.x a multiple of 32, at most 1024).
__device__ inline float BlockSum(float v, float* shared) {
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

// Rows [first, last) of chunk blockIdx.y when N rows are cut into gridDim.y
// chunks.
__device__ inline void ChunkRows(int64_t N, int64_t* first, int64_t* last) {
  const int64_t rows = (N + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * rows;
  *first = begin < N ? begin : N;
  *last = *first + rows < N ? *first + rows : N;
}

// ---- kernels ---------------------------------------------------------------
// h0[n, j] = tok[x_n] + prev1[x_{n-1}] + prev2[x_{n-2}]
template <typename T>
__global__ void EmbedForwardKernel(const int32_t* x, int64_t seq, int64_t H, int64_t N,
                                   const T* tok, const T* p1, const T* p2, float* h0) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= H) return;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const int64_t t = n % seq;
    float v = ToFloat(tok[x[n] * H + j]);
    if (t >= 1) v += ToFloat(p1[x[n - 1] * H + j]);
    if (t >= 2) v += ToFloat(p2[x[n - 2] * H + j]);
    h0[n * H + j] = v;
  }
}

// Block (column tile, token v): g_k[v, j] = Σ dh[n + k, j] over the positions
// n of token v (ascending), when n + k is in n's sequence.
template <typename T>
__global__ void EmbedBackwardKernel(const int32_t* order, const int32_t* offsets, int64_t seq,
                                    int64_t H, const float* dh, T* g0, T* g1, T* g2) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t v = blockIdx.y;
  if (j >= H) return;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f;
  for (int32_t e = offsets[v]; e < offsets[v + 1]; ++e) {
    const int64_t n = order[e], t = n % seq;
    s0 += dh[n * H + j];
    if (t + 1 < seq) s1 += dh[(n + 1) * H + j];
    if (t + 2 < seq) s2 += dh[(n + 2) * H + j];
  }
  g0[v * H + j] = FromFloat<T>(s0);
  g1[v * H + j] = FromFloat<T>(s1);
  g2[v * H + j] = FromFloat<T>(s2);
}

// One block per row: r = sqrt(mean(h²) + eps); u_t = h / r in T.
template <typename T>
__global__ void RmsForwardKernel(const float* h, int64_t H, T* u_t, float* r) {
  __shared__ float sh[32];
  const float* row = h + blockIdx.x * H;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) ss += row[j] * row[j];
  ss = BlockSum(ss, sh);
  const float rn = sqrtf(ss / static_cast<float>(H) + kRmsEps);
  const float inv = 1.f / rn;
  if (threadIdx.x == 0) r[blockIdx.x] = rn;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x)
    u_t[blockIdx.x * H + j] = FromFloat<T>(row[j] * inv);
}

// One block per row: u = h / r; dh (= or +=) (du − u · mean(du ⊙ u)) / r.
__global__ void RmsBackwardKernel(const float* h, const float* r, const float* du, int64_t H,
                                  int accumulate, float* dh) {
  __shared__ float sh[32];
  const int64_t off = blockIdx.x * H;
  const float inv = 1.f / r[blockIdx.x];
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dot += du[off + j] * (h[off + j] * inv);
  const float mean = BlockSum(dot, sh) / static_cast<float>(H);
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float v = (du[off + j] - h[off + j] * inv * mean) * inv;
    dh[off + j] = accumulate ? dh[off + j] + v : v;
  }
}

// g_t = gelu(a + b) (b per column), in T.
template <typename T>
__global__ void BiasGeluKernel(const float* a, const T* b, int64_t N, int64_t F, T* g_t) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= F) return;
  const float bj = ToFloat(b[j]);
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y)
    g_t[n * F + j] = FromFloat<T>(Gelu(a[n * F + j] + bj));
}

// Block (column tile, row chunk): d = d ⊙ gelu'(a + b) in place (T), and the
// chunk's column sums of the fp32 products into partial[chunk, j].
template <typename T>
__global__ void GeluBackwardPartialKernel(const float* a, const T* b, int64_t N, int64_t F, T* d,
                                          float* partial) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= F) return;
  int64_t first, last;
  ChunkRows(N, &first, &last);
  const float bj = ToFloat(b[j]);
  float sum = 0.f;
  for (int64_t n = first; n < last; ++n) {
    const int64_t i = n * F + j;
    const float da = ToFloat(d[i]) * GeluGrad(a[i] + bj);  // da = dg ⊙ gelu'(a + b)
    d[i] = FromFloat<T>(da);
    sum += da;
  }
  partial[blockIdx.y * F + j] = sum;
}

// Block (column tile, row chunk): x_t = x in T (unless null) and the chunk's
// column sums of x into partial[chunk, j].
template <typename T>
__global__ void ColumnSumCastPartialKernel(const float* x, int64_t N, int64_t C, T* x_t,
                                           float* partial) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= C) return;
  int64_t first, last;
  ChunkRows(N, &first, &last);
  float sum = 0.f;
  for (int64_t n = first; n < last; ++n) {
    const float v = x[n * C + j];
    if (x_t != nullptr) x_t[n * C + j] = FromFloat<T>(v);
    sum += v;
  }
  partial[blockIdx.y * C + j] = sum;
}

// out[j] = Σ_chunk partial[chunk, j], chunks in order, stored in T.
template <typename T>
__global__ void FinishColumnSumKernel(const float* partial, int64_t C, int chunks, T* out) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= C) return;
  float s = 0.f;
  for (int c = 0; c < chunks; ++c) s += partial[c * C + j];
  out[j] = FromFloat<T>(s);
}

// out[n, j] = x[n, j] + b[j].
template <typename T>
__global__ void AddRowBiasKernel(const float* x, const T* b, int64_t N, int64_t C, float* out) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= C) return;
  const float bj = ToFloat(b[j]);
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) out[n * C + j] = x[n * C + j] + bj;
}

// One block per row of V logits: z += b; loss[n] = logsumexp(z) − z[y];
// z becomes (softmax(z) − onehot(y)) · scale.
template <typename T>
__global__ void SoftmaxXentKernel(float* z, const T* b, const int32_t* y, int64_t V, float scale,
                                  float* loss) {
  __shared__ float sh[32];
  float* row = z + blockIdx.x * V;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = row[j] + ToFloat(b[j]);
    row[j] = v;
    mx = fmaxf(mx, v);
  }
  mx = BlockMax(mx, sh);  // its __syncthreads also publishes the biased row
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

// Calls f(T{}) with T the type of `dtype` (0 fp32, 1 fp16, 2 bf16).
template <typename F>
cudaError_t Dispatch(int dtype, F&& f) {
  switch (dtype) {
    case 0:
      return f(float{});
    case 1:
      return f(__half{});
    case 2:
      return f(__nv_bfloat16{});
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename K>
cudaError_t Load(K* kernel) {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace

cudaError_t LoadKernels() {
  for (int dtype = 0; dtype < 3; ++dtype) {
    const cudaError_t e = Dispatch(dtype, [](auto tag) {
      using T = decltype(tag);
      const cudaError_t errs[] = {
          Load(EmbedForwardKernel<T>),        Load(EmbedBackwardKernel<T>),
          Load(RmsForwardKernel<T>),          Load(BiasGeluKernel<T>),
          Load(GeluBackwardPartialKernel<T>), Load(ColumnSumCastPartialKernel<T>),
          Load(FinishColumnSumKernel<T>),     Load(AddRowBiasKernel<T>),
          Load(SoftmaxXentKernel<T>)};
      for (cudaError_t x : errs)
        if (x != cudaSuccess) return x;
      return cudaSuccess;
    });
    if (e != cudaSuccess) return e;
  }
  return Load(RmsBackwardKernel);
}

int ColumnChunks(int64_t N, int64_t C, int64_t partial_floats) {
  const int64_t tiles = std::max<int64_t>(1, Blocks(C));
  int64_t chunks = std::max<int64_t>(kColumnChunks, (kColumnSumBlocks + tiles - 1) / tiles);
  chunks = std::min<int64_t>(chunks, partial_floats / std::max<int64_t>(1, C));
  chunks = std::min<int64_t>(chunks, std::min<int64_t>(N, 65535));
  return static_cast<int>(std::max<int64_t>(1, chunks));
}

cudaError_t EmbedForward(const int32_t* x, int64_t seq, int64_t H, int64_t N, const void* tok,
                         const void* p1, const void* p2, int dtype, float* h0, cudaStream_t s) {
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    EmbedForwardKernel<T><<<RowGrid(N, H), kThreads, 0, s>>>(
        x, seq, H, N, static_cast<const T*>(tok), static_cast<const T*>(p1),
        static_cast<const T*>(p2), h0);
    return cudaGetLastError();
  });
}

cudaError_t EmbedBackward(const int32_t* order, const int32_t* offsets, int64_t V, int64_t seq,
                          int64_t H, const float* dh, int dtype, void* g0, void* g1, void* g2,
                          cudaStream_t s) {
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(Blocks(H), static_cast<unsigned>(V));
    EmbedBackwardKernel<T><<<grid, kThreads, 0, s>>>(
        order, offsets, seq, H, dh, static_cast<T*>(g0), static_cast<T*>(g1), static_cast<T*>(g2));
    return cudaGetLastError();
  });
}

cudaError_t RmsForward(const float* h, int64_t N, int64_t H, int dtype, void* u_t, float* r,
                       cudaStream_t s) {
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    RmsForwardKernel<T>
        <<<static_cast<unsigned>(N), RowThreads(H), 0, s>>>(h, H, static_cast<T*>(u_t), r);
    return cudaGetLastError();
  });
}

cudaError_t RmsBackward(const float* h, const float* r, const float* du, int64_t N, int64_t H,
                        bool accumulate, float* dh, cudaStream_t s) {
  RmsBackwardKernel<<<static_cast<unsigned>(N), RowThreads(H), 0, s>>>(h, r, du, H,
                                                                       accumulate ? 1 : 0, dh);
  return cudaGetLastError();
}

cudaError_t BiasGelu(const float* a, const void* b, int64_t N, int64_t F, int dtype, void* g_t,
                     cudaStream_t s) {
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    BiasGeluKernel<T><<<RowGrid(N, F), kThreads, 0, s>>>(a, static_cast<const T*>(b), N, F,
                                                         static_cast<T*>(g_t));
    return cudaGetLastError();
  });
}

cudaError_t GeluBackwardBiasGrad(const float* a, const void* b, int64_t N, int64_t F, int dtype,
                                 void* d_t, float* partial, int64_t partial_floats, void* db,
                                 cudaStream_t s) {
  if (partial_floats < F) return cudaErrorInvalidValue;
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int chunks = ColumnChunks(N, F, partial_floats);
    const dim3 grid(Blocks(F), static_cast<unsigned>(chunks));
    GeluBackwardPartialKernel<T><<<grid, kThreads, 0, s>>>(a, static_cast<const T*>(b), N, F,
                                                           static_cast<T*>(d_t), partial);
    FinishColumnSumKernel<T>
        <<<Blocks(F), kThreads, 0, s>>>(partial, F, chunks, static_cast<T*>(db));
    return cudaGetLastError();
  });
}

cudaError_t ColumnSumCast(const float* x, int64_t N, int64_t C, int dtype, void* x_t,
                          float* partial, int64_t partial_floats, void* db, cudaStream_t s) {
  if (partial_floats < C) return cudaErrorInvalidValue;
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int chunks = ColumnChunks(N, C, partial_floats);
    const dim3 grid(Blocks(C), static_cast<unsigned>(chunks));
    ColumnSumCastPartialKernel<T><<<grid, kThreads, 0, s>>>(x, N, C, static_cast<T*>(x_t), partial);
    FinishColumnSumKernel<T>
        <<<Blocks(C), kThreads, 0, s>>>(partial, C, chunks, static_cast<T*>(db));
    return cudaGetLastError();
  });
}

cudaError_t AddRowBias(const float* x, const void* b, int64_t N, int64_t C, int dtype, float* out,
                       cudaStream_t s) {
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    AddRowBiasKernel<T><<<RowGrid(N, C), kThreads, 0, s>>>(x, static_cast<const T*>(b), N, C, out);
    return cudaGetLastError();
  });
}

cudaError_t SoftmaxXent(float* z, const void* b, int dtype, const int32_t* y, int64_t N, int64_t V,
                        float scale, float* loss, cudaStream_t s) {
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    SoftmaxXentKernel<T><<<static_cast<unsigned>(N), RowThreads(V), 0, s>>>(
        z, static_cast<const T*>(b), y, V, scale, loss);
    return cudaGetLastError();
  });
}

}  // namespace strata::example::cuda
