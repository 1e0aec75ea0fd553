// Launchers of the example model's CUDA kernels (cuda_kernels.cu). Each
// enqueues on `s` and returns the launch status (cudaGetLastError()); none
// synchronizes or allocates.
//
// dtype: 0 fp32, 1 fp16, 2 bf16 (strata::DType values). It is the type of the
// parameters, of their gradients and of the GEMM operand copies the kernels
// emit (`..._t` arguments: what cuBLAS reads with tensor cores when dtype is
// fp16/bf16). The residual stream h, its gradient dh, the MLP pre-activation
// a, the logits z and the rms factors are fp32. Row-major, N rows (tokens);
// see model.h for the layouts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace strata::example::cuda {

// Column sums run in two passes: chunks of rows (ColumnChunks) each write a
// partial sum per column into `partial` (chunks × C floats, at most
// `partial_floats`), then one pass adds the chunks in order. The chunking is
// a function of the shape and the partial buffer's size only: the same bits
// on any GPU.
inline constexpr int kColumnChunks = 32;  // the fewest chunks (the buffer holds 32 × C)
// (column tile, chunk) blocks a column sum aims for: an H100's 132 SMs × 8
// resident 256-thread blocks, about one full wave. At hidden 2048 that is
// 128 chunks of 8 column tiles (32 chunks gave 256 blocks: 2 per SM).
inline constexpr int kColumnSumBlocks = 1024;
// The chunks of a column sum of N rows × C columns: enough for
// kColumnSumBlocks blocks, at least kColumnChunks, at most what
// partial_floats holds (partial_floats / C) and at most N (and 65535).
int ColumnChunks(int64_t N, int64_t C, int64_t partial_floats);

// Loads every kernel of this file (cudaFuncGetAttributes), as the device
// layer's cuda::LoadKernels does for src/gpu: with CUDA's lazy loading, a
// kernel's first launch may synchronize the context, which hangs when a host
// function on a stream waits for the launching thread. Call once before the
// first launch (NewCudaBackend does).
cudaError_t LoadKernels();

// h0[n] = tok[x_n] + p1[x_{n-1}] + p2[x_{n-2}] (terms before a sequence's
// start left out); tables in dtype.
cudaError_t EmbedForward(const int32_t* x, int64_t seq, int64_t H, int64_t N, const void* tok,
                         const void* p1, const void* p2, int dtype, float* h0, cudaStream_t s);
// Gradients of the three tables, written (not accumulated) in dtype:
// g_k[v] = Σ dh[n + k] over the positions n with x_n = v whose sequence
// reaches n + k. `order` lists the positions sorted by token (stable, so
// ascending within a token) and `offsets` [V + 1] delimits each token's run:
// a gather in position order, deterministic, no atomics.
cudaError_t EmbedBackward(const int32_t* order, const int32_t* offsets, int64_t V, int64_t seq,
                          int64_t H, const float* dh, int dtype, void* g0, void* g1, void* g2,
                          cudaStream_t s);
// r = sqrt(mean(h²) + 1e-5) per row; u_t = h / r in dtype (the GEMM operand).
cudaError_t RmsForward(const float* h, int64_t N, int64_t H, int dtype, void* u_t, float* r,
                       cudaStream_t s);
// dh (= or +=) (du − u · mean(du ⊙ u)) / r with u = h / r recomputed in fp32.
cudaError_t RmsBackward(const float* h, const float* r, const float* du, int64_t N, int64_t H,
                        bool accumulate, float* dh, cudaStream_t s);
// g_t = gelu(a + b) in dtype (b [F] in dtype; a, without the bias, is kept
// for the backward pass).
cudaError_t BiasGelu(const float* a, const void* b, int64_t N, int64_t F, int dtype, void* g_t,
                     cudaStream_t s);
// d_t: in, dg (dtype); out, da = dg ⊙ gelu'(a + b) (dtype, in place);
// db[j] = Σ_n da[n, j] (fp32 sum of the unrounded da, stored in dtype).
// partial: partial_floats floats (≥ F; see ColumnChunks).
cudaError_t GeluBackwardBiasGrad(const float* a, const void* b, int64_t N, int64_t F, int dtype,
                                 void* d_t, float* partial, int64_t partial_floats, void* db,
                                 cudaStream_t s);
// db[j] = Σ_n x[n, j] stored in dtype; x_t = x in dtype unless x_t is null.
// partial: partial_floats floats (≥ C; see ColumnChunks).
cudaError_t ColumnSumCast(const float* x, int64_t N, int64_t C, int dtype, void* x_t,
                          float* partial, int64_t partial_floats, void* db, cudaStream_t s);
// out[n, j] = x[n, j] + b[j] (b in dtype).
cudaError_t AddRowBias(const float* x, const void* b, int64_t N, int64_t C, int dtype, float* out,
                       cudaStream_t s);
// With z[n] += b (b [V] in dtype): loss[n] = logsumexp(z[n]) − z[n, y[n]];
// z becomes (softmax(z) − onehot(y)) · scale.
cudaError_t SoftmaxXent(float* z, const void* b, int dtype, const int32_t* y, int64_t N, int64_t V,
                        float scale, float* loss, cudaStream_t s);

}  // namespace strata::example::cuda
