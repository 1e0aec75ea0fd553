// Launchers of the example model's CUDA kernels (cuda_kernels.cu). Each
// enqueues on `s` and returns the launch status (cudaGetLastError()).
// dtype: 0 fp32, 1 fp16, 2 bf16 (strata::DType values). Row-major fp32
// activations, N rows (tokens); see model.h for the layouts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace strata::example::cuda {

// out = float(in) (a parameter, widened); out = narrow(in) (a gradient).
cudaError_t Widen(const void* in, int dtype, float* out, int64_t n, cudaStream_t s);
cudaError_t Narrow(const float* in, void* out, int dtype, int64_t n, cudaStream_t s);
// h0[n] = tok[x_t] + p1[x_{t-1}] + p2[x_{t-2}]; backward scatter-adds (atomics) into zeroed tables.
cudaError_t EmbedForward(const int32_t* x, int64_t seq, int64_t H, int64_t N, const float* tok, const float* p1,
                         const float* p2, float* h0, cudaStream_t s);
cudaError_t EmbedBackward(const int32_t* x, int64_t seq, int64_t H, int64_t N, const float* dh, float* g0, float* g1,
                          float* g2, cudaStream_t s);
// u = h / r, r = sqrt(mean(h²) + 1e-5) per row; backward dh (= or +=) (du − u·mean(du⊙u)) / r.
cudaError_t RmsForward(const float* h, int64_t N, int64_t H, float* u, float* r, cudaStream_t s);
cudaError_t RmsBackward(const float* u, const float* r, const float* du, int64_t N, int64_t H, bool accumulate,
                        float* dh, cudaStream_t s);
// a += b per column, g = gelu(a); dg *= gelu'(a).
cudaError_t BiasGelu(float* a, const float* b, int64_t N, int64_t F, float* g, cudaStream_t s);
cudaError_t GeluBackward(const float* a, float* dg, int64_t n, cudaStream_t s);
// out = x + b per row (x may be null: out = b broadcast); out[j] = Σ_n x[n, j].
cudaError_t AddRowBias(const float* x, const float* b, int64_t N, int64_t C, float* out, cudaStream_t s);
cudaError_t ColumnSum(const float* x, int64_t N, int64_t C, float* out, cudaStream_t s);
// loss[n] = logsumexp(z[n]) − z[n, y[n]]; z becomes (softmax(z) − onehot(y)) · scale.
cudaError_t SoftmaxXent(float* z, const int32_t* y, int64_t N, int64_t V, float scale, float* loss, cudaStream_t s);

}  // namespace strata::example::cuda
