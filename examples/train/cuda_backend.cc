// CUDA backend of the example model: cuBLAS GEMMs (fp32 compute) plus the
// kernels of cuda_kernels.cu, all ordered on Engine::ComputeStream(). Built
// when STRATA_HAVE_CUDA. Compiled here; never run (no GPU was available).
//
// Parameters arrive as bf16/fp16/fp32 device tensors; each module's weights are
// widened once per use into an fp32 workspace and its fp32 gradients narrowed
// into the engine's gradient buffers (mixed-type cublasGemmEx is not allowed
// and the activations are fp32). The embedding backward scatter-adds with
// atomics (not bitwise deterministic on the GPU; the host backend is the
// bitwise reference).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "examples/train/cuda_kernels.h"
#include "examples/train/model.h"

namespace strata::example {
namespace {

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status();
  return InternalError(std::string(what) + ": " + cudaGetErrorName(e) + " (" +
                       cudaGetErrorString(e) + ")");
}
Status CublasStatus(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status();
  return InternalError(std::string(what) + ": cuBLAS status " +
                       std::to_string(static_cast<int>(e)));
}
#define CUDA_RETURN(expr, what) STRATA_RETURN_IF_ERROR(CudaStatus((expr), what))

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
    // BackendWorkspaceBytes (model.cc) is this layout's size.
    const int64_t wmax = std::max(2 * F * H + F + H, 3 * V * H);
    STRATA_ASSIGN_OR_RETURN(void* base, alloc_(BackendWorkspaceBytes(s_)));
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
    CUDA_RETURN(cudaMemcpyAsync(tokens_, host_tokens_.data(), host_tokens_.size() * 4,
                                cudaMemcpyHostToDevice, stream_),
                "upload tokens");
    return Status();
  }

  Status EmbedForward(const std::vector<void*>& p, float* h0) override {
    if (p.size() != 3) return InvalidArgumentError("embedding: expected 3 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, VH = s_.vocab * H;
    for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(Widen(p[i], w_ + i * VH, VH));
    return Check(
        cuda::EmbedForward(tokens_, s_.seq_len, H, N, w_, w_ + VH, w_ + 2 * VH, h0, stream_),
        "EmbedForward");
  }

  Status BlockForward(const std::vector<void*>& p, const float* h_in, float* h_out) override {
    if (p.size() != 4) return InvalidArgumentError("block: expected 4 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    float *w1 = w_, *b1 = w_ + F * H, *w2 = b1 + F, *b2 = w2 + H * F;
    STRATA_RETURN_IF_ERROR(WidenBlock(p, w1, b1, w2, b2));
    STRATA_RETURN_IF_ERROR(Check(cuda::RmsForward(h_in, N, H, u_, rms_, stream_), "RmsForward"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, F, H, u_, H, w1, H, 0.f, a_, F));
    STRATA_RETURN_IF_ERROR(Check(cuda::BiasGelu(a_, b1, N, F, g_, stream_), "BiasGelu"));
    STRATA_RETURN_IF_ERROR(Check(cuda::AddRowBias(h_in, b2, N, H, h_out, stream_), "AddRowBias"));
    return Gemm(false, true, N, H, F, g_, F, w2, F, 1.f, h_out, H);
  }

  StatusOr<double> HeadForward(const std::vector<void*>& p, const float* h,
                               double loss_scale) override {
    if (p.size() != 2) return InvalidArgumentError("head: expected 2 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    float *w = w_, *b = w_ + V * H;
    STRATA_RETURN_IF_ERROR(Widen(p[0], w, V * H));
    STRATA_RETURN_IF_ERROR(Widen(p[1], b, V));
    STRATA_RETURN_IF_ERROR(Check(cuda::RmsForward(h, N, H, u_, rms_, stream_), "RmsForward"));
    STRATA_RETURN_IF_ERROR(Check(cuda::AddRowBias(nullptr, b, N, V, z_, stream_), "AddRowBias"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, V, H, u_, H, w, H, 1.f, z_, V));
    STRATA_RETURN_IF_ERROR(
        Check(cuda::SoftmaxXent(z_, tokens_ + N, N, V, static_cast<float>(loss_scale / N), loss_,
                                stream_),
              "SoftmaxXent"));
    CUDA_RETURN(cudaMemcpyAsync(host_loss_.data(), loss_, N * 4, cudaMemcpyDeviceToHost, stream_),
                "download loss");
    CUDA_RETURN(cudaStreamSynchronize(stream_), "synchronize for the loss");
    double total = 0;
    for (float l : host_loss_) total += l;
    return total / static_cast<double>(N);
  }

  Status HeadBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h,
                      float* dh) override {
    if (p.size() != 2 || g.size() != 2) return InvalidArgumentError("head: expected 2 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    float* w = w_;
    STRATA_RETURN_IF_ERROR(Widen(p[0], w, V * H));
    STRATA_RETURN_IF_ERROR(Check(cuda::RmsForward(h, N, H, u_, rms_, stream_), "RmsForward"));
    float *gw = gw_, *gb = gw_ + V * H;
    STRATA_RETURN_IF_ERROR(Gemm(true, false, V, H, N, z_, V, u_, H, 0.f, gw, H));
    STRATA_RETURN_IF_ERROR(Check(cuda::ColumnSum(z_, N, V, gb, stream_), "ColumnSum"));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, H, V, z_, V, w, H, 0.f, du_, H));
    STRATA_RETURN_IF_ERROR(
        Check(cuda::RmsBackward(u_, rms_, du_, N, H, false, dh, stream_), "RmsBackward"));
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
    STRATA_RETURN_IF_ERROR(Check(cuda::RmsForward(h_in, N, H, u_, rms_, stream_), "RmsForward"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, F, H, u_, H, w1, H, 0.f, a_, F));
    STRATA_RETURN_IF_ERROR(Check(cuda::BiasGelu(a_, b1, N, F, g_, stream_), "BiasGelu"));
    float *gw1 = gw_, *gb1 = gw_ + F * H, *gw2 = gb1 + F, *gb2 = gw2 + H * F;
    STRATA_RETURN_IF_ERROR(Gemm(true, false, H, F, N, dh, H, g_, F, 0.f, gw2, F));  // dW2 = dhᵀ · g
    STRATA_RETURN_IF_ERROR(Check(cuda::ColumnSum(dh, N, H, gb2, stream_), "ColumnSum"));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, F, H, dh, H, w2, F, 0.f, g_, F));  // dg = dh · W2
    STRATA_RETURN_IF_ERROR(Check(cuda::GeluBackward(a_, g_, N * F, stream_), "GeluBackward"));
    STRATA_RETURN_IF_ERROR(Gemm(true, false, F, H, N, g_, F, u_, H, 0.f, gw1, H));  // dW1 = daᵀ · u
    STRATA_RETURN_IF_ERROR(Check(cuda::ColumnSum(g_, N, F, gb1, stream_), "ColumnSum"));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, H, F, g_, F, w1, H, 0.f, du_, H));  // du = da · W1
    STRATA_RETURN_IF_ERROR(
        Check(cuda::RmsBackward(u_, rms_, du_, N, H, true, dh, stream_), "RmsBackward"));
    STRATA_RETURN_IF_ERROR(Narrow(gw1, g[0], F * H));
    STRATA_RETURN_IF_ERROR(Narrow(gb1, g[1], F));
    STRATA_RETURN_IF_ERROR(Narrow(gw2, g[2], H * F));
    return Narrow(gb2, g[3], H);
  }

  Status EmbedBackward(const std::vector<void*>& g, const float* dh) override {
    if (g.size() != 3) return InvalidArgumentError("embedding: expected 3 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, VH = s_.vocab * H;
    CUDA_RETURN(cudaMemsetAsync(gw_, 0, 3 * VH * 4, stream_), "zero embedding gradients");
    STRATA_RETURN_IF_ERROR(Check(
        cuda::EmbedBackward(tokens_, s_.seq_len, H, N, dh, gw_, gw_ + VH, gw_ + 2 * VH, stream_),
        "EmbedBackward"));
    for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(Narrow(gw_ + i * VH, g[i], VH));
    return Status();
  }

  Status CopyToHost(const float* device, float* host, int64_t n) override {
    CUDA_RETURN(cudaMemcpyAsync(host, device, n * 4, cudaMemcpyDeviceToHost, stream_),
                "CopyToHost");
    return CudaStatus(cudaStreamSynchronize(stream_), "CopyToHost synchronize");
  }

 private:
  static Status Check(cudaError_t e, const char* kernel) { return CudaStatus(e, kernel); }
  Status Widen(const void* p, float* out, int64_t n) {
    return Check(cuda::Widen(p, dtype_, out, n, stream_), "Widen");
  }
  Status Narrow(const float* in, void* out, int64_t n) {
    return Check(cuda::Narrow(in, out, dtype_, n, stream_), "Narrow");
  }
  Status WidenBlock(const std::vector<void*>& p, float* w1, float* b1, float* w2, float* b2) {
    const int64_t H = s_.hidden, F = s_.ffn();
    STRATA_RETURN_IF_ERROR(Widen(p[0], w1, F * H));
    STRATA_RETURN_IF_ERROR(Widen(p[1], b1, F));
    STRATA_RETURN_IF_ERROR(Widen(p[2], w2, H * F));
    return Widen(p[3], b2, H);
  }
  // Row-major C[m × n] = op(A) · op(B) + beta · C, as column-major Cᵀ = op(B)ᵀ · op(A)ᵀ.
  Status Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
    const float alpha = 1.f;
    return CublasStatus(
        cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                     static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                     CUDA_R_32F, static_cast<int>(ldb), a, CUDA_R_32F, static_cast<int>(lda), &beta,
                     c, CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
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

StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const ModelShape& shape, DType dtype,
                                                  void* stream, WorkspaceFn alloc) {
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(
      shape, dtype, static_cast<cudaStream_t>(stream), std::move(alloc)));
}

}  // namespace strata::example
