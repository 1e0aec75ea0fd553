// examples/train/model.h — the example model `strata train` drives: a
// byte-level residual-MLP language model that uses only the public Engine API
// (include/strata/*.h), as a training framework would.
//
//   module 0        embedding: h0[t] = tok[x_t] + prev1[x_{t-1}] + prev2[x_{t-2}]
//   module 1..L     block i:   u = rms(h); h += W2 · gelu(W1 · u + b1) + b2
//   module L+1      head:      y = rms(h); logits = Wout · y + bout; softmax cross-entropy
//
// rms(h) = h / sqrt(mean(h²) + 1e-5) has no parameters. The two embedding
// tables of the previous tokens are the model's context mix: it can learn a
// trigram model of the text. Width F of the MLP is 4 × hidden.
//
// Parameters are bf16 (config bf16.enabled), fp16 (fp16.enabled; the loss is
// multiplied by Engine::loss_scale()) or fp32; the engine keeps the fp32
// master copy and the optimizer states wherever the config says.
//
// Compute: a Backend per device. The host backend (Engine::DeviceIsHost())
// runs OpenBLAS sgemm on fp32 copies of the parameters plus plain loops; the
// CUDA backend (built when STRATA_HAVE_CUDA) runs cuBLAS GEMMs on the
// parameters as they are (bf16/fp16 on tensor cores with fp32 accumulation,
// fp32 without TF32) and fused kernels on Engine::ComputeStream(). Activations (the residual stream
// of every layer, the MLP scratch, the logits) are engine workspaces, counted against the HBM
// budget on both; the host backend's fp32 copies of one module's parameters
// and gradients are plain host memory (a GPU reads bf16 directly).
// Backward recomputes each block's MLP activations from its saved input
// (activation checkpointing), so only (L+1) × tokens × hidden floats are kept.
//
// Threading: one thread drives a Model (the Engine's thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/config.h"
#include "strata/dtype.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::example {

// The most residual blocks ShapeFromConfig accepts (and `strata plan` lays out).
inline constexpr int64_t kMaxModelLayers = 100000;

struct ModelShape {
  int64_t layers = 4;
  int64_t hidden = 256;
  int64_t seq_len = 64;
  int64_t vocab = 256;
  int64_t batch = 1;  // sequences per micro-batch
  int64_t ffn() const { return 4 * hidden; }
  int64_t tokens() const { return batch * seq_len; }
  // Elements over all tensors, from the sizes (no list is built).
  int64_t num_parameters() const;
};

// strata.model: the example model's section of the config. The library keeps
// it as JSON text (StrataConfig::application_sections["model"]); this
// program reads and checks it (model_config.cc).
struct ModelConfig {
  int64_t layers = 4;    // residual blocks, >= 1
  int64_t hidden = 256;  // width, >= 8
  int64_t seq_len = 64;  // tokens per sequence, >= 2
  int64_t vocab = 256;   // byte-level: must be 256
  int64_t seed = 1234;   // initialization and data; >= 0
  int64_t steps = 0;     // optimizer steps; 0 = use --steps or the command's default

  bool operator==(const ModelConfig&) const = default;
};

// strata.model of `config`, absent keys at their defaults. A wrong type or
// value is InvalidArgument naming strata.model.<key>, the value and what is
// allowed; an unknown key is a warning "unknown key strata.model.<key>
// (ignored)" appended to `warnings` (when given).
StatusOr<ModelConfig> ModelConfigFromConfig(const Config& config,
                                            std::vector<std::string>* warnings = nullptr);
// The ranges above; the first one broken is the error.
Status ValidateModelConfig(const ModelConfig& model);
// Writes `model` as the config's strata.model (every key).
void SetModelConfig(const ModelConfig& model, Config* config);

// Shape and parameter dtype from a config (strata.model, micro-batch size,
// fp16/bf16 sections). Validates what the config parser cannot know.
StatusOr<ModelShape> ShapeFromConfig(const Config& config);
DType ParamDTypeFromConfig(const Config& config);

// ---------------------------------------------------------------------------
// Data: text from a small stochastic grammar, generated from a seed (no files).
// ---------------------------------------------------------------------------
class TextData {
 public:
  // About `bytes` bytes of sentences; the same seed gives the same text.
  TextData(uint64_t seed, int64_t bytes = 1 << 20);
  // Micro-batch `index`: batch sequences of seq_len + 1 bytes (inputs are the
  // first seq_len, targets the last seq_len), at offsets drawn from
  // (seed, index). Returns inputs and targets, batch × seq_len each.
  void Batch(int64_t index, int64_t batch, int64_t seq_len, std::vector<int32_t>* inputs,
             std::vector<int32_t>* targets) const;
  const std::string& text() const { return text_; }

 private:
  uint64_t seed_;
  std::string text_;
};

// ---------------------------------------------------------------------------
// Backend: the per-module compute on device pointers.
// ---------------------------------------------------------------------------
// Pointers are device pointers (host pointers on the host device). Parameter
// and gradient pointers have the parameter dtype; activations are fp32.
// Layouts, row-major: tok/prev1/prev2/head.w [V × H], w1 [F × H], b1 [F],
// w2 [H × F], b2 [H], head.b [V]; activations [N × H], N = batch × seq_len.
// Gradients are written (not accumulated) into the grad pointers.
class Backend {
 public:
  virtual ~Backend() = default;
  // Allocates the backend's scratch (through the WorkspaceFn) so that a
  // budget problem shows before the first micro-batch.
  virtual Status Prepare() = 0;
  // Uploads the micro-batch's tokens (N inputs, N targets).
  virtual Status SetBatch(std::span<const int32_t> inputs, std::span<const int32_t> targets) = 0;
  virtual Status EmbedForward(const std::vector<void*>& p, float* h0) = 0;
  virtual Status BlockForward(const std::vector<void*>& p, const float* h_in, float* h_out) = 0;
  // Enqueues the loss (mean over tokens, unscaled) and stores d loss·scale /
  // d logits; Loss() gives the value. On CUDA nothing waits here: the
  // backward can be enqueued at once, and Loss() waits for the loss's copy
  // only (an event right after it), not for the work enqueued since.
  virtual Status HeadForwardAsync(const std::vector<void*>& p, const float* h,
                                  double loss_scale) = 0;
  // The loss of the last HeadForwardAsync.
  virtual StatusOr<double> Loss() = 0;
  // HeadForwardAsync, then Loss().
  StatusOr<double> HeadForward(const std::vector<void*>& p, const float* h, double loss_scale) {
    STRATA_RETURN_IF_ERROR(HeadForwardAsync(p, h, loss_scale));
    return Loss();
  }
  // dh = d(loss·scale)/dh of the head's input; writes the head's gradients.
  virtual Status HeadBackward(const std::vector<void*>& p, const std::vector<void*>& g,
                              const float* h, float* dh) = 0;
  // dh: in = gradient w.r.t. the block's output, out = w.r.t. its input.
  virtual Status BlockBackward(const std::vector<void*>& p, const std::vector<void*>& g,
                               const float* h_in, float* dh) = 0;
  virtual Status EmbedBackward(const std::vector<void*>& g, const float* dh) = 0;
  // Copies n floats of a device activation to the host (tests, debugging).
  virtual Status CopyToHost(const float* device, float* host, int64_t n) = 0;
};

// Workspace allocator for backends: Engine::AllocateWorkspace in production,
// host memory in tests that run a backend without an engine.
using WorkspaceFn = std::function<StatusOr<void*>(int64_t bytes)>;

// The one scratch workspace a backend asks for in Prepare(), as byte offsets
// of its slots (each on a 256-byte boundary, sized for fp32 elements whatever
// the parameter dtype, so the layout does not depend on it):
//   a, g [N × F]     MLP pre-activation (fp32); gelu output, then its gradient
//                    (the CUDA backend keeps these in the parameter dtype)
//   u, du [N × H]    rms-normalized input (the GEMM operand), its gradient
//   z [N × V]        logits, then d(loss·scale)/dz
//   rms, loss [N]    rms factors, per-token losses
//   dht [N × H]      the residual gradient in the parameter dtype (CUDA)
//   zt [N × V]       dz in the parameter dtype (CUDA)
//   partial          kBackendColumnChunks × max(F, V) column partial sums (CUDA)
//   tokens           int32 inputs, targets [N], positions by token [N],
//                    token offsets [V + 1]
// The host backend uses a, g, u, du, z and rms and asks for the same bytes,
// so the HBM arena is laid out, and fragments, alike on both devices.
inline constexpr int kBackendColumnChunks = 32;
struct BackendLayout {
  int64_t a, g, u, du, z, rms, loss, dht, zt, partial, tokens;
  int64_t total;  // bytes
};
BackendLayout BackendWorkspaceLayout(const ModelShape& shape);
int64_t BackendWorkspaceBytes(const ModelShape& shape);

std::unique_ptr<Backend> NewHostBackend(const ModelShape& shape, DType dtype, WorkspaceFn alloc);
// The host backend's GEMMs run on one OpenBLAS thread, whatever
// OPENBLAS_NUM_THREADS, the CPU count or the resource limits say
// (NewHostBackend sets it): a thread count changes how OpenBLAS splits a GEMM,
// and with it the last bits of the losses. What can still change them is the
// library build and the CPU kernels it picks (DYNAMIC_ARCH builds pick by
// CPU; OPENBLAS_CORETYPE overrides): this names both, e.g. "OpenBLAS 0.3.21
// NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY SkylakeX MAX_THREADS=64; kernels
// SkylakeX; 1 thread".
std::string HostBlasArithmetic();
// OpenBLAS picks its kernels by the CPU's model number when it loads; a build
// older than the CPU (Debian 12's 0.3.21 on Intel family 6 model 207, say)
// falls back to its generic "Prescott" kernels (SSE3), which ran the example
// model's GEMMs at half the speed of its AVX-512 kernels on such a CPU. The
// kernels to ask for instead (OPENBLAS_CORETYPE): "SkylakeX" when the CPU has
// AVX-512 F, CD, BW, DQ and VL, "Haswell" with AVX2 and FMA; "" to keep what
// OpenBLAS picked (any other choice than Prescott, or neither instruction set).
std::string BlasKernelsFor(std::string_view picked, bool avx512, bool avx2_fma);
// BlasKernelsFor this process's OpenBLAS and CPU, and a sentence saying why
// (the CPU's family and model, what OpenBLAS picked); "" when none is needed.
std::string BetterBlasKernelsHere(std::string* why);
// Before the host backend's first GEMM: its fp32 copies of one module's
// parameters and gradients must fit in MemAvailable, and those plus
// OpenBLAS's GEMM buffer (about 128 MiB of address space, mapped on the first
// GEMM) under RLIMIT_AS. OpenBLAS retries a refused mapping forever (a silent
// 100 % CPU hang), so this is checked first: ResourceExhausted naming the bytes.
Status CheckHostBackendMemory(const ModelShape& shape);
// nullptr with NotSupported when this build has no CUDA.
StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const ModelShape& shape, DType dtype,
                                                  void* stream, WorkspaceFn alloc);

// ---------------------------------------------------------------------------
// Model: registers parameters with an Engine and runs micro-batches through
// its hooks.
// ---------------------------------------------------------------------------
class Model {
 public:
  // Registers every parameter (module 0 = embedding, 1..L = blocks, L+1 =
  // head), calls Engine::Plan(), then allocates the activations as engine
  // workspaces. Fails (nothing trained) when the plan or the activations do
  // not fit the HBM budget, naming the bytes asked and the budget.
  static StatusOr<std::unique_ptr<Model>> Create(Engine* engine, const ModelShape& shape,
                                                 DType dtype, uint64_t seed);
  ~Model();

  // One micro-batch: forward through every module, backward in reverse
  // (gradients handed to the engine). Returns the unscaled mean loss. Does not
  // call Engine::Step().
  StatusOr<double> MicroBatch(std::span<const int32_t> inputs, std::span<const int32_t> targets);

  const ModelShape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int num_modules() const { return static_cast<int>(shape_.layers) + 2; }
  // Bytes of activations allocated as engine workspaces.
  int64_t workspace_bytes() const { return workspace_bytes_; }

 private:
  Model(Engine* engine, const ModelShape& shape, DType dtype)
      : engine_(engine), shape_(shape), dtype_(dtype) {}
  Engine* engine_;
  ModelShape shape_;
  DType dtype_;
  std::unique_ptr<Backend> backend_;
  std::vector<void*> workspaces_;
  std::vector<float*> hs_;  // residual stream: hs_[0] after embedding, hs_[i] after block i
  float* dh_ = nullptr;
  int64_t workspace_bytes_ = 0;
};

// Initial values of parameter `name` (numel floats), deterministic in seed.
void InitParameter(const std::string& name, const ModelShape& shape, uint64_t seed,
                   std::span<float> out);
// Parameter names and sizes per module, in registration order.
struct ParamInfo {
  std::string name;
  int64_t numel;
  int module;
};
std::vector<ParamInfo> ParameterList(const ModelShape& shape);

}  // namespace strata::example
