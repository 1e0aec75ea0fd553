// CUDA backend of the example model: cuBLAS GEMMs (fp32 compute) plus a few
// kernels, all ordered on Engine::ComputeStream(). Built when STRATA_HAVE_CUDA.
//
// Parameters arrive as bf16/fp16/fp32 device tensors; each module's weights are
// widened once per use into an fp32 workspace (2 bytes read + 4 written per
// element) and its fp32 gradients narrowed into the engine's gradient buffers
// (4 read + 2 written). Activations are fp32. Per element of the activations:
// embedding 3 gathers; rms norm 2 passes over a row; bias+gelu 1 read, 2
// writes; softmax cross-entropy one block per row (V = 256 threads).
// The embedding backward scatter-adds with atomics (order not deterministic
// on the GPU; the host backend is the bitwise reference).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "examples/train/model.h"

namespace strata::example {
namespace {

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status();
  return InternalError(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
Status CublasStatus(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status();
  return InternalError(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(e)));
}
#define CUDA_RETURN(expr, what) STRATA_RETURN_IF_ERROR(CudaStatus((expr), what))

constexpr int kThreads = 256;
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kRmsEps = 1e-5f;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

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

// ---- the backend -------------------------------------------------------------
class CudaBackend final : public Backend {
 public:
  CudaBackend(const ModelShape& s, DType dtype, cudaStream_t stream, WorkspaceFn alloc)
      : s_(s), dtype_(static_cast<int>(dtype)), stream_(stream), alloc_(std::move(alloc)) {}
  ~CudaBackend() override {
    if (blas_) cublasDestroy(blas_);
  }

  Status Prepare() override {
    if (blas_) return Status();
    STRATA_RETURN_IF_ERROR(CublasStatus(cublasCreate(&blas_), "cublasCreate"));
    STRATA_RETURN_IF_ERROR(CublasStatus(cublasSetStream(blas_, stream_), "cublasSetStream"));
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn(), V = s_.vocab;
    // Activations: a, g [N × F]; u, du [N × H]; z [N × V]; rms, loss [N].
    // Weights/grads in fp32: the largest module has two F × H tensors (or three V × H).
    const int64_t wmax = std::max(2 * F * H + F + H, 3 * V * H);
    const int64_t floats = 2 * N * F + 2 * N * H + N * V + 2 * N + 2 * wmax;
    STRATA_ASSIGN_OR_RETURN(void* base, alloc_(floats * 4 + 2 * N * 4));
    float* f = static_cast<float*>(base);
    a_ = f, f += N * F;
    g_ = f, f += N * F;
    u_ = f, f += N * H;
    du_ = f, f += N * H;
    z_ = f, f += N * V;
    rms_ = f, f += N;
    loss_ = f, f += N;
    w_ = f, f += wmax;
    gw_ = f, f += wmax;
    tokens_ = reinterpret_cast<int32_t*>(f);
    host_loss_.resize(static_cast<size_t>(N));
    return Status();
  }

  Status SetBatch(std::span<const int32_t> inputs, std::span<const int32_t> targets) override {
    const int64_t N = s_.tokens();
    if (static_cast<int64_t>(inputs.size()) != N || static_cast<int64_t>(targets.size()) != N)
      return InvalidArgumentError("SetBatch: wrong number of tokens");
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i] < 0 || inputs[i] >= s_.vocab || targets[i] < 0 || targets[i] >= s_.vocab)
        return InvalidArgumentError("SetBatch: token out of range at " + std::to_string(i));
    STRATA_RETURN_IF_ERROR(Prepare());
    host_tokens_.assign(inputs.begin(), inputs.end());
    host_tokens_.insert(host_tokens_.end(), targets.begin(), targets.end());
    // Pageable source: the copy is staged before cudaMemcpyAsync returns.
    CUDA_RETURN(cudaMemcpyAsync(tokens_, host_tokens_.data(), host_tokens_.size() * 4, cudaMemcpyHostToDevice, stream_),
                "upload tokens");
    return Status();
  }

  Status EmbedForward(const std::vector<void*>& p, float* h0) override {
    if (p.size() != 3) return InvalidArgumentError("embedding: expected 3 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, VH = s_.vocab * H;
    for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(Widen(p[i], w_ + i * VH, VH));
    EmbedForwardKernel<<<Grid(N * H), kThreads, 0, stream_>>>(tokens_, s_.seq_len, H, N, w_, w_ + VH, w_ + 2 * VH, h0);
    return Check("EmbedForwardKernel");
  }

  Status BlockForward(const std::vector<void*>& p, const float* h_in, float* h_out) override {
    if (p.size() != 4) return InvalidArgumentError("block: expected 4 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    float *w1 = w_, *b1 = w_ + F * H, *w2 = b1 + F, *b2 = w2 + H * F;
    STRATA_RETURN_IF_ERROR(WidenBlock(p, w1, b1, w2, b2));
    RmsForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(h_in, H, u_, rms_);
    STRATA_RETURN_IF_ERROR(Check("RmsForwardKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, F, H, u_, H, w1, H, 0.f, a_, F));
    BiasGeluKernel<<<Grid(N * F), kThreads, 0, stream_>>>(a_, b1, N, F, g_);
    STRATA_RETURN_IF_ERROR(Check("BiasGeluKernel"));
    AddRowBiasKernel<<<Grid(N * H), kThreads, 0, stream_>>>(h_in, b2, N, H, h_out);
    STRATA_RETURN_IF_ERROR(Check("AddRowBiasKernel"));
    return Gemm(false, true, N, H, F, g_, F, w2, F, 1.f, h_out, H);
  }

  StatusOr<double> HeadForward(const std::vector<void*>& p, const float* h, double loss_scale) override {
    if (p.size() != 2) return InvalidArgumentError("head: expected 2 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    float *w = w_, *b = w_ + V * H;
    STRATA_RETURN_IF_ERROR(Widen(p[0], w, V * H));
    STRATA_RETURN_IF_ERROR(Widen(p[1], b, V));
    RmsForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(h, H, u_, rms_);
    STRATA_RETURN_IF_ERROR(Check("RmsForwardKernel"));
    AddRowBiasKernel<<<Grid(N * V), kThreads, 0, stream_>>>(nullptr, b, N, V, z_);
    STRATA_RETURN_IF_ERROR(Check("AddRowBiasKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, V, H, u_, H, w, H, 1.f, z_, V));
    SoftmaxXentKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(z_, tokens_ + N, V,
                                                                          static_cast<float>(loss_scale / N), loss_);
    STRATA_RETURN_IF_ERROR(Check("SoftmaxXentKernel"));
    CUDA_RETURN(cudaMemcpyAsync(host_loss_.data(), loss_, N * 4, cudaMemcpyDeviceToHost, stream_), "download loss");
    CUDA_RETURN(cudaStreamSynchronize(stream_), "synchronize for the loss");
    double total = 0;
    for (float l : host_loss_) total += l;
    return total / static_cast<double>(N);
  }

  Status HeadBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h, float* dh) override {
    if (p.size() != 2 || g.size() != 2) return InvalidArgumentError("head: expected 2 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    float* w = w_;
    STRATA_RETURN_IF_ERROR(Widen(p[0], w, V * H));
    RmsForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(h, H, u_, rms_);
    STRATA_RETURN_IF_ERROR(Check("RmsForwardKernel"));
    float *gw = gw_, *gb = gw_ + V * H;
    STRATA_RETURN_IF_ERROR(Gemm(true, false, V, H, N, z_, V, u_, H, 0.f, gw, H));
    ColumnSumKernel<<<Blocks(V), kThreads, 0, stream_>>>(z_, N, V, gb);
    STRATA_RETURN_IF_ERROR(Check("ColumnSumKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, H, V, z_, V, w, H, 0.f, du_, H));
    RmsBackwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(u_, rms_, du_, H, 0, dh);
    STRATA_RETURN_IF_ERROR(Check("RmsBackwardKernel"));
    STRATA_RETURN_IF_ERROR(Narrow(gw, g[0], V * H));
    return Narrow(gb, g[1], V);
  }

  Status BlockBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h_in,
                       float* dh) override {
    if (p.size() != 4 || g.size() != 4) return InvalidArgumentError("block: expected 4 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    float *w1 = w_, *b1 = w_ + F * H, *w2 = b1 + F, *b2 = w2 + H * F;
    STRATA_RETURN_IF_ERROR(WidenBlock(p, w1, b1, w2, b2));
    // Recompute the forward activations.
    RmsForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(h_in, H, u_, rms_);
    STRATA_RETURN_IF_ERROR(Check("RmsForwardKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, F, H, u_, H, w1, H, 0.f, a_, F));
    BiasGeluKernel<<<Grid(N * F), kThreads, 0, stream_>>>(a_, b1, N, F, g_);
    STRATA_RETURN_IF_ERROR(Check("BiasGeluKernel"));
    float *gw1 = gw_, *gb1 = gw_ + F * H, *gw2 = gb1 + F, *gb2 = gw2 + H * F;
    STRATA_RETURN_IF_ERROR(Gemm(true, false, H, F, N, dh, H, g_, F, 0.f, gw2, F));  // dW2 = dhᵀ · g
    ColumnSumKernel<<<Blocks(H), kThreads, 0, stream_>>>(dh, N, H, gb2);
    STRATA_RETURN_IF_ERROR(Check("ColumnSumKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, F, H, dh, H, w2, F, 0.f, g_, F));  // dg = dh · W2
    GeluBackwardKernel<<<Grid(N * F), kThreads, 0, stream_>>>(a_, g_, N * F);
    STRATA_RETURN_IF_ERROR(Check("GeluBackwardKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(true, false, F, H, N, g_, F, u_, H, 0.f, gw1, H));  // dW1 = daᵀ · u
    ColumnSumKernel<<<Blocks(F), kThreads, 0, stream_>>>(g_, N, F, gb1);
    STRATA_RETURN_IF_ERROR(Check("ColumnSumKernel"));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, H, F, g_, F, w1, H, 0.f, du_, H));  // du = da · W1
    RmsBackwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(u_, rms_, du_, H, 1, dh);
    STRATA_RETURN_IF_ERROR(Check("RmsBackwardKernel"));
    STRATA_RETURN_IF_ERROR(Narrow(gw1, g[0], F * H));
    STRATA_RETURN_IF_ERROR(Narrow(gb1, g[1], F));
    STRATA_RETURN_IF_ERROR(Narrow(gw2, g[2], H * F));
    return Narrow(gb2, g[3], H);
  }

  Status EmbedBackward(const std::vector<void*>& g, const float* dh) override {
    if (g.size() != 3) return InvalidArgumentError("embedding: expected 3 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, VH = s_.vocab * H;
    CUDA_RETURN(cudaMemsetAsync(gw_, 0, 3 * VH * 4, stream_), "zero embedding gradients");
    EmbedBackwardKernel<<<Grid(N * H), kThreads, 0, stream_>>>(tokens_, s_.seq_len, H, N, dh, gw_, gw_ + VH,
                                                               gw_ + 2 * VH);
    STRATA_RETURN_IF_ERROR(Check("EmbedBackwardKernel"));
    for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(Narrow(gw_ + i * VH, g[i], VH));
    return Status();
  }

  Status CopyToHost(const float* device, float* host, int64_t n) override {
    CUDA_RETURN(cudaMemcpyAsync(host, device, n * 4, cudaMemcpyDeviceToHost, stream_), "CopyToHost");
    return CudaStatus(cudaStreamSynchronize(stream_), "CopyToHost synchronize");
  }

 private:
  static unsigned Grid(int64_t n) { return std::min<unsigned>(Blocks(n), 65535u * 8); }
  Status Check(const char* kernel) { return CudaStatus(cudaGetLastError(), kernel); }
  Status Widen(const void* p, float* out, int64_t n) {
    WidenKernel<<<Grid(n), kThreads, 0, stream_>>>(p, dtype_, out, n);
    return Check("WidenKernel");
  }
  Status Narrow(const float* in, void* out, int64_t n) {
    NarrowKernel<<<Grid(n), kThreads, 0, stream_>>>(in, out, dtype_, n);
    return Check("NarrowKernel");
  }
  Status WidenBlock(const std::vector<void*>& p, float* w1, float* b1, float* w2, float* b2) {
    const int64_t H = s_.hidden, F = s_.ffn();
    STRATA_RETURN_IF_ERROR(Widen(p[0], w1, F * H));
    STRATA_RETURN_IF_ERROR(Widen(p[1], b1, F));
    STRATA_RETURN_IF_ERROR(Widen(p[2], w2, H * F));
    return Widen(p[3], b2, H);
  }
  // Row-major C[m × n] = op(A) · op(B) + beta · C, as column-major Cᵀ = op(B)ᵀ · op(A)ᵀ.
  Status Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
              int64_t ldb, float beta, float* c, int64_t ldc) {
    const float alpha = 1.f;
    return CublasStatus(
        cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                     static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_32F, static_cast<int>(ldb), a,
                     CUDA_R_32F, static_cast<int>(lda), &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }

  ModelShape s_;
  int dtype_;
  cudaStream_t stream_;
  WorkspaceFn alloc_;
  cublasHandle_t blas_ = nullptr;
  float *a_ = nullptr, *g_ = nullptr, *u_ = nullptr, *du_ = nullptr, *z_ = nullptr, *rms_ = nullptr,
        *loss_ = nullptr, *w_ = nullptr, *gw_ = nullptr;
  int32_t* tokens_ = nullptr;
  std::vector<int32_t> host_tokens_;
  std::vector<float> host_loss_;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const ModelShape& shape, DType dtype, void* stream,
                                                   WorkspaceFn alloc) {
  return std::unique_ptr<Backend>(
      std::make_unique<CudaBackend>(shape, dtype, static_cast<cudaStream_t>(stream), std::move(alloc)));
}

}  // namespace strata::example
