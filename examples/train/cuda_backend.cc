// CUDA backend of the example model: cuBLAS GEMMs plus the fused kernels of
// cuda_kernels.cu, all ordered on Engine::ComputeStream(). Built when
// STRATA_HAVE_CUDA.
//
// GEMM types. cublasGemmEx needs A and B of one type; with
// CUBLAS_COMPUTE_32F (fp32 accumulation, fp32 alpha/beta) it takes
// 16BF×16BF→16BF or →32F, 16F×16F→16F or →32F, and 32F×32F→32F. So:
//   * bf16/fp16 parameters: the weights are read where the engine put them,
//     and every activation a GEMM reads is emitted in the same type by the
//     kernel that produces it (u by the rms norm, gelu(a) by bias+gelu, dh by
//     the bias-gradient pass, da by gelu'+bias-gradient, dz by the head's
//     bias-gradient pass). Outputs are fp32 where the next op adds into them
//     or reduces them (the pre-activation a, the residual stream, du, the
//     logits) and in the parameter type otherwise: dg, and the weight
//     gradients, written straight into the engine's gradient buffers
//     (reductions stay fp32: CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION).
//   * fp32 parameters: 32F×32F→32F, CUBLAS_DEFAULT_MATH (no TF32).
// cuBLAS picks tensor-core kernels for the 16-bit types.
//
// Host synchronization: none inside a module. HeadForwardAsync enqueues the
// loss's D2H copy (N floats into pinned memory) and an event after it;
// Loss() waits for that event only, once the caller has enqueued the
// micro-batch's backward behind it. Nothing here
// allocates after Prepare(): the workspace is one engine workspace, cuBLAS's
// workspace pool comes with its handle.
//
// cuBLAS is not linked: its functions come from the table Cublas() binds
// when the first backend is created (cublas_api.h).
//
// Deterministic: column sums are two-pass with a fixed chunking and the
// embedding backward gathers each table row's positions in order (no
// atomics), so a run gives the same bits each time on a given GPU.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "examples/train/cublas_api.h"
#include "examples/train/cuda_kernels.h"
#include "examples/train/model.h"

namespace strata::example {
namespace {

static_assert(cuda::kColumnChunks == kBackendColumnChunks, "one chunking for both layouts");

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

cudaDataType CudaType(DType t) {
  switch (t) {
    case DType::kFp16:
      return CUDA_R_16F;
    case DType::kBf16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// ---- the backend -------------------------------------------------------------
class CudaBackend final : public Backend {
 public:
  CudaBackend(const CublasApi& blas, const ModelShape& s, DType dtype, cudaStream_t stream,
              WorkspaceFn alloc)
      : cublas_(blas),
        s_(s),
        dtype_(static_cast<int>(dtype)),
        narrow_(dtype != DType::kFp32),
        type_(CudaType(dtype)),
        stream_(stream),
        alloc_(std::move(alloc)) {}
  ~CudaBackend() override {
    if (blas_) cublas_.Destroy(blas_);
    if (loss_ready_) cudaEventDestroy(loss_ready_);
    if (host_loss_) cudaFreeHost(host_loss_);
  }

  Status Prepare() override {
    if (blas_) return Status();
    STRATA_RETURN_IF_ERROR(CublasStatus(cublas_.Create(&blas_), "cublasCreate"));
    STRATA_RETURN_IF_ERROR(CublasStatus(cublas_.SetStream(blas_, stream_), "cublasSetStream"));
    // Default math: tensor cores for 16-bit types, never TF32 for fp32; and
    // no reduced-precision reductions (split-K partials stay fp32).
    STRATA_RETURN_IF_ERROR(CublasStatus(
        cublas_.SetMathMode(
            blas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                             CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
        "cublasSetMathMode"));
    // The layout is BackendWorkspaceLayout (model.cc), shared with the host backend.
    const BackendLayout l = BackendWorkspaceLayout(s_);
    STRATA_ASSIGN_OR_RETURN(void* base, alloc_(l.total));
    char* b = static_cast<char*>(base);
    a_ = reinterpret_cast<float*>(b + l.a);
    gt_ = b + l.g;
    ut_ = b + l.u;
    du_ = reinterpret_cast<float*>(b + l.du);
    z_ = reinterpret_cast<float*>(b + l.z);
    rms_ = reinterpret_cast<float*>(b + l.rms);
    loss_ = reinterpret_cast<float*>(b + l.loss);
    dht_ = b + l.dht;
    zt_ = b + l.zt;
    partial_ = reinterpret_cast<float*>(b + l.partial);
    partial_floats_ = int64_t{kBackendColumnChunks} * std::max(s_.ffn(), s_.vocab);
    tokens_ = reinterpret_cast<int32_t*>(b + l.tokens);
    // Pinned, so that the loss's copy is asynchronous; a blocking-sync event
    // (Loss() waits without spinning a core the CPU optimizer wants).
    CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&host_loss_),
                               static_cast<size_t>(s_.tokens()) * sizeof(float)),
                "pinned memory for the loss");
    CUDA_RETURN(
        cudaEventCreateWithFlags(&loss_ready_, cudaEventDisableTiming | cudaEventBlockingSync),
        "loss event");
    return Status();
  }

  Status SetBatch(std::span<const int32_t> inputs, std::span<const int32_t> targets) override {
    const int64_t N = s_.tokens(), V = s_.vocab;
    if (static_cast<int64_t>(inputs.size()) != N || static_cast<int64_t>(targets.size()) != N)
      return InvalidArgumentError("SetBatch: " + std::to_string(inputs.size()) + " inputs and " +
                                  std::to_string(targets.size()) + " targets, model takes " +
                                  std::to_string(N));
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i] < 0 || inputs[i] >= V || targets[i] < 0 || targets[i] >= V)
        return InvalidArgumentError("SetBatch: token out of range at " + std::to_string(i));
    STRATA_RETURN_IF_ERROR(Prepare());
    // inputs [N], targets [N], the positions sorted by token (a stable
    // counting sort: ascending within a token) [N], each token's offset [V + 1].
    host_tokens_.assign(static_cast<size_t>(3 * N + V + 1), 0);
    int32_t* in = host_tokens_.data();
    int32_t* order = in + 2 * N;
    int32_t* offsets = in + 3 * N;
    std::copy(inputs.begin(), inputs.end(), in);
    std::copy(targets.begin(), targets.end(), in + N);
    for (int64_t n = 0; n < N; ++n) ++offsets[in[n] + 1];
    for (int64_t v = 0; v < V; ++v) offsets[v + 1] += offsets[v];
    std::vector<int32_t> next(offsets, offsets + V);
    for (int64_t n = 0; n < N; ++n) order[next[in[n]]++] = static_cast<int32_t>(n);
    // Pageable source: the driver stages it before cudaMemcpyAsync returns,
    // without waiting for the stream.
    CUDA_RETURN(cudaMemcpyAsync(tokens_, host_tokens_.data(), host_tokens_.size() * 4,
                                cudaMemcpyHostToDevice, stream_),
                "upload tokens");
    return Status();
  }

  Status EmbedForward(const std::vector<void*>& p, float* h0) override {
    if (p.size() != 3) return InvalidArgumentError("embedding: expected 3 tensors");
    return Check(cuda::EmbedForward(tokens_, s_.seq_len, s_.hidden, s_.tokens(), p[0], p[1], p[2],
                                    dtype_, h0, stream_),
                 "EmbedForward");
  }

  Status BlockForward(const std::vector<void*>& p, const float* h_in, float* h_out) override {
    if (p.size() != 4) return InvalidArgumentError("block: expected 4 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    const void *w1 = p[0], *b1 = p[1], *w2 = p[2], *b2 = p[3];
    STRATA_RETURN_IF_ERROR(
        Check(cuda::RmsForward(h_in, N, H, dtype_, ut_, rms_, stream_), "RmsForward"));
    // a = u · W1ᵀ (fp32); g = gelu(a + b1) (operand type)
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, F, H, ut_, H, w1, H, 0.f, a_, CUDA_R_32F, F));
    STRATA_RETURN_IF_ERROR(Check(cuda::BiasGelu(a_, b1, N, F, dtype_, gt_, stream_), "BiasGelu"));
    // h_out = h_in + b2 + g · W2ᵀ (fp32)
    STRATA_RETURN_IF_ERROR(
        Check(cuda::AddRowBias(h_in, b2, N, H, dtype_, h_out, stream_), "AddRowBias"));
    return Gemm(false, true, N, H, F, gt_, F, w2, F, 1.f, h_out, CUDA_R_32F, H);
  }

  Status HeadForwardAsync(const std::vector<void*>& p, const float* h, double loss_scale) override {
    if (p.size() != 2) return InvalidArgumentError("head: expected 2 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    STRATA_RETURN_IF_ERROR(
        Check(cuda::RmsForward(h, N, H, dtype_, ut_, rms_, stream_), "RmsForward"));
    // z = y · Wᵀ (fp32); the bias is added by the softmax kernel.
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, V, H, ut_, H, p[0], H, 0.f, z_, CUDA_R_32F, V));
    STRATA_RETURN_IF_ERROR(
        Check(cuda::SoftmaxXent(z_, p[1], dtype_, tokens_ + N, N, V,
                                static_cast<float>(loss_scale / N), loss_, stream_),
              "SoftmaxXent"));
    // The loss leaves on the stream; Loss() waits for this copy only.
    CUDA_RETURN(cudaMemcpyAsync(host_loss_, loss_, N * 4, cudaMemcpyDeviceToHost, stream_),
                "download loss");
    CUDA_RETURN(cudaEventRecord(loss_ready_, stream_), "record the loss event");
    loss_pending_ = true;
    return Status();
  }

  StatusOr<double> Loss() override {
    if (!loss_pending_) return FailedPreconditionError("Loss: no HeadForwardAsync before it");
    CUDA_RETURN(cudaEventSynchronize(loss_ready_), "wait for the loss");
    const int64_t N = s_.tokens();
    double total = 0;
    for (int64_t i = 0; i < N; ++i) total += host_loss_[i];
    return total / static_cast<double>(N);
  }

  Status HeadBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h,
                      float* dh) override {
    if (p.size() != 2 || g.size() != 2) return InvalidArgumentError("head: expected 2 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    STRATA_RETURN_IF_ERROR(
        Check(cuda::RmsForward(h, N, H, dtype_, ut_, rms_, stream_), "RmsForward"));
    // db = Σ dz, and dz in the operand type.
    const void* dz = narrow_ ? zt_ : z_;
    STRATA_RETURN_IF_ERROR(Check(cuda::ColumnSumCast(z_, N, V, dtype_, narrow_ ? zt_ : nullptr,
                                                     partial_, partial_floats_, g[1], stream_),
                                 "ColumnSumCast"));
    // dW = dzᵀ · y (parameter type, into the engine's buffer); dy = dz · W (fp32)
    STRATA_RETURN_IF_ERROR(Gemm(true, false, V, H, N, dz, V, ut_, H, 0.f, g[0], type_, H));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, H, V, dz, V, p[0], H, 0.f, du_, CUDA_R_32F, H));
    return Check(cuda::RmsBackward(h, rms_, du_, N, H, /*accumulate=*/false, dh, stream_),
                 "RmsBackward");
  }

  Status BlockBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h_in,
                       float* dh) override {
    if (p.size() != 4 || g.size() != 4) return InvalidArgumentError("block: expected 4 tensors");
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    const void *w1 = p[0], *b1 = p[1], *w2 = p[2];
    void *gw1 = g[0], *gb1 = g[1], *gw2 = g[2], *gb2 = g[3];
    // Recompute the forward activations from the saved input.
    STRATA_RETURN_IF_ERROR(
        Check(cuda::RmsForward(h_in, N, H, dtype_, ut_, rms_, stream_), "RmsForward"));
    STRATA_RETURN_IF_ERROR(Gemm(false, true, N, F, H, ut_, H, w1, H, 0.f, a_, CUDA_R_32F, F));
    STRATA_RETURN_IF_ERROR(Check(cuda::BiasGelu(a_, b1, N, F, dtype_, gt_, stream_), "BiasGelu"));
    // db2 = Σ dh, and dh in the operand type.
    const void* dht = narrow_ ? dht_ : dh;
    STRATA_RETURN_IF_ERROR(Check(cuda::ColumnSumCast(dh, N, H, dtype_, narrow_ ? dht_ : nullptr,
                                                     partial_, partial_floats_, gb2, stream_),
                                 "ColumnSumCast"));
    // dW2 = dhᵀ · g; then dg = dh · W2 overwrites g (stream order: after dW2 read it).
    STRATA_RETURN_IF_ERROR(Gemm(true, false, H, F, N, dht, H, gt_, F, 0.f, gw2, type_, F));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, F, H, dht, H, w2, F, 0.f, gt_, type_, F));
    // da = dg ⊙ gelu'(a + b1) in place; db1 = Σ da.
    STRATA_RETURN_IF_ERROR(Check(cuda::GeluBackwardBiasGrad(a_, b1, N, F, dtype_, gt_, partial_,
                                                            partial_floats_, gb1, stream_),
                                 "GeluBackwardBiasGrad"));
    // dW1 = daᵀ · u; du = da · W1 (fp32); dh += rms backward (the residual).
    STRATA_RETURN_IF_ERROR(Gemm(true, false, F, H, N, gt_, F, ut_, H, 0.f, gw1, type_, H));
    STRATA_RETURN_IF_ERROR(Gemm(false, false, N, H, F, gt_, F, w1, H, 0.f, du_, CUDA_R_32F, H));
    return Check(cuda::RmsBackward(h_in, rms_, du_, N, H, /*accumulate=*/true, dh, stream_),
                 "RmsBackward");
  }

  Status EmbedBackward(const std::vector<void*>& g, const float* dh) override {
    if (g.size() != 3) return InvalidArgumentError("embedding: expected 3 tensors");
    const int64_t N = s_.tokens();
    return Check(cuda::EmbedBackward(tokens_ + 2 * N, tokens_ + 3 * N, s_.vocab, s_.seq_len,
                                     s_.hidden, dh, dtype_, g[0], g[1], g[2], stream_),
                 "EmbedBackward");
  }

  Status CopyToHost(const float* device, float* host, int64_t n) override {
    CUDA_RETURN(cudaMemcpyAsync(host, device, n * 4, cudaMemcpyDeviceToHost, stream_),
                "CopyToHost");
    return CudaStatus(cudaStreamSynchronize(stream_), "CopyToHost synchronize");
  }

 private:
  static Status Check(cudaError_t e, const char* kernel) { return CudaStatus(e, kernel); }

  // Row-major C[m × n] = op(A) · op(B) + beta · C, as column-major
  // Cᵀ = op(B)ᵀ · op(A)ᵀ. A and B have the operand type (the parameter
  // dtype); C is ctype (fp32, or the operand type); fp32 accumulation.
  Status Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
              const void* b, int64_t ldb, float beta, void* c, cudaDataType ctype, int64_t ldc) {
    const float alpha = 1.f;
    return CublasStatus(
        cublas_.GemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                       static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                       type_, static_cast<int>(ldb), a, type_, static_cast<int>(lda), &beta, c,
                       ctype, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }

  const CublasApi& cublas_;
  ModelShape s_;
  int dtype_;
  bool narrow_;        // 16-bit parameters: activations get operand copies
  cudaDataType type_;  // the GEMM operand type: the parameter dtype
  cudaStream_t stream_;
  WorkspaceFn alloc_;
  cublasHandle_t blas_ = nullptr;
  // Workspace slots (BackendLayout). `void*` ones hold the operand type.
  float *a_ = nullptr, *du_ = nullptr, *z_ = nullptr, *rms_ = nullptr, *loss_ = nullptr,
        *partial_ = nullptr;
  void *gt_ = nullptr, *ut_ = nullptr, *dht_ = nullptr, *zt_ = nullptr;
  int64_t partial_floats_ = 0;  // the partial slot's floats (model.cc's layout)
  int32_t* tokens_ = nullptr;
  std::vector<int32_t> host_tokens_;
  float* host_loss_ = nullptr;  // pinned, N floats
  cudaEvent_t loss_ready_ = nullptr;
  bool loss_pending_ = false;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const ModelShape& shape, DType dtype,
                                                  void* stream, WorkspaceFn alloc) {
  // Every kernel loaded now, before any launch (see cuda::LoadKernels).
  STRATA_RETURN_IF_ERROR(CudaStatus(cuda::LoadKernels(), "loading the example's CUDA kernels"));
  // cuBLAS is opened now, at the first backend (its Status names the library).
  STRATA_ASSIGN_OR_RETURN(const CublasApi* blas, Cublas());
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(
      *blas, shape, dtype, static_cast<cudaStream_t>(stream), std::move(alloc)));
}

}  // namespace strata::example
