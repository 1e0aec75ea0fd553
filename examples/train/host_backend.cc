// Host backend of the example model: OpenBLAS sgemm (one thread) on fp32
// copies of one module's parameters, plus plain loops for the element-wise
// parts. Used on
// the host device (strata.device = host, or no GPU). Activations live in
// engine workspaces (fp32); parameter/gradient fp32 copies in host vectors.
#include <cblas.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include "examples/train/model.h"
#include "examples/train/ops.h"

namespace strata::example {
namespace {

// See HostBlasArithmetic in model.h.
constexpr int kBlasThreads = 1;

// "1.50 MiB"; "512 B" below a KiB.
std::string Bytes(uint64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 5) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, kUnits[u]);
}
std::string BytesBoth(uint64_t b) { return fmt::format("{} bytes ({})", b, Bytes(b)); }

// The value of a "Key:   N kB" line of a /proc file, in bytes.
bool ReadProcKb(const char* file, std::string_view key, uint64_t* bytes) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    if (line.compare(0, key.size(), key) != 0 || line.size() <= key.size() ||
        line[key.size()] != ':')
      continue;
    try {
      *bytes = std::stoull(line.substr(key.size() + 1)) * 1024;
    } catch (...) {
      return false;
    }
    return true;
  }
  return false;
}

class HostBackend final : public Backend {
 public:
  HostBackend(const ModelShape& s, DType dtype, WorkspaceFn alloc)
      : s_(s), dtype_(dtype), alloc_(std::move(alloc)) {
    openblas_set_num_threads(kBlasThreads);
  }

  Status SetBatch(std::span<const int32_t> inputs, std::span<const int32_t> targets) override {
    const int64_t n = s_.tokens();
    if (static_cast<int64_t>(inputs.size()) != n || static_cast<int64_t>(targets.size()) != n)
      return InvalidArgumentError("SetBatch: " + std::to_string(inputs.size()) + " inputs and " +
                                  std::to_string(targets.size()) + " targets, model takes " +
                                  std::to_string(n));
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i] < 0 || inputs[i] >= s_.vocab || targets[i] < 0 || targets[i] >= s_.vocab)
        return InvalidArgumentError("SetBatch: token out of range at " + std::to_string(i));
    inputs_.assign(inputs.begin(), inputs.end());
    targets_.assign(targets.begin(), targets.end());
    return Status();
  }

  Status EmbedForward(const std::vector<void*>& p, float* h0) override {
    STRATA_RETURN_IF_ERROR(Expect(p, 3, "embedding"));
    const float* tab[3];
    for (int i = 0; i < 3; ++i) tab[i] = Param(p[i], s_.vocab * s_.hidden, i);
    ops::EmbedForward(inputs_.data(), s_.batch, s_.seq_len, s_.hidden, tab[0], tab[1], tab[2], h0);
    return Status();
  }

  Status BlockForward(const std::vector<void*>& p, const float* h_in, float* h_out) override {
    STRATA_RETURN_IF_ERROR(Expect(p, 4, "block"));
    STRATA_RETURN_IF_ERROR(Prepare());
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    const float* w1 = Param(p[0], F * H, 0);
    const float* b1 = Param(p[1], F, 1);
    const float* w2 = Param(p[2], H * F, 2);
    const float* b2 = Param(p[3], H, 3);
    ops::RmsNormForward(h_in, N, H, u_, rms_);
    // a = u · W1ᵀ + b1; g = gelu(a)
    Gemm(false, true, N, F, H, u_, H, w1, H, 0.f, a_, F);
    ops::AddBiasGelu(a_, b1, N, F, g_);
    // h_out = h_in + b2 + g · W2ᵀ
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < H; ++j) h_out[n * H + j] = h_in[n * H + j] + b2[j];
    Gemm(false, true, N, H, F, g_, F, w2, F, 1.f, h_out, H);
    return Status();
  }

  StatusOr<double> Loss() override { return loss_; }

  Status HeadForwardAsync(const std::vector<void*>& p, const float* h, double loss_scale) override {
    STRATA_RETURN_IF_ERROR(Expect(p, 2, "head"));
    STRATA_RETURN_IF_ERROR(Prepare());
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    const float* w = Param(p[0], V * H, 0);
    const float* b = Param(p[1], V, 1);
    ops::RmsNormForward(h, N, H, u_, rms_);
    for (int64_t n = 0; n < N; ++n) std::memcpy(z_ + n * V, b, static_cast<size_t>(V) * 4);
    Gemm(false, true, N, V, H, u_, H, w, H, 1.f, z_, V);
    // z becomes d(loss·scale)/dz in place.
    loss_ = ops::SoftmaxCrossEntropy(z_, targets_.data(), N, V, static_cast<float>(loss_scale / N));
    return Status();
  }

  Status HeadBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h,
                      float* dh) override {
    STRATA_RETURN_IF_ERROR(Expect(p, 2, "head"));
    STRATA_RETURN_IF_ERROR(Expect(g, 2, "head gradients"));
    STRATA_RETURN_IF_ERROR(Prepare());
    const int64_t N = s_.tokens(), H = s_.hidden, V = s_.vocab;
    const float* w = Param(p[0], V * H, 0);
    ops::RmsNormForward(h, N, H, u_, rms_);
    float* gw = Grad(0, V * H);
    float* gb = Grad(1, V);
    Gemm(true, false, V, H, N, z_, V, u_, H, 0.f, gw, H);   // dW = dzᵀ · y
    ops::ColumnSum(z_, N, V, gb);                           // db = Σ dz
    Gemm(false, false, N, H, V, z_, V, w, H, 0.f, du_, H);  // dy = dz · W
    ops::RmsNormBackward(h, u_, rms_, du_, N, H, /*accumulate=*/false, dh);
    StoreGrad(g[0], gw, V * H);
    StoreGrad(g[1], gb, V);
    return Status();
  }

  Status BlockBackward(const std::vector<void*>& p, const std::vector<void*>& g, const float* h_in,
                       float* dh) override {
    STRATA_RETURN_IF_ERROR(Expect(p, 4, "block"));
    STRATA_RETURN_IF_ERROR(Expect(g, 4, "block gradients"));
    STRATA_RETURN_IF_ERROR(Prepare());
    const int64_t N = s_.tokens(), H = s_.hidden, F = s_.ffn();
    const float* w1 = Param(p[0], F * H, 0);
    const float* b1 = Param(p[1], F, 1);
    const float* w2 = Param(p[2], H * F, 2);
    // Recompute the forward activations from the saved input.
    ops::RmsNormForward(h_in, N, H, u_, rms_);
    Gemm(false, true, N, F, H, u_, H, w1, H, 0.f, a_, F);
    ops::AddBiasGelu(a_, b1, N, F, g_);  // a_ keeps the pre-activation (with bias)
    float* gw1 = Grad(0, F * H);
    float* gb1 = Grad(1, F);
    float* gw2 = Grad(2, H * F);
    float* gb2 = Grad(3, H);
    Gemm(true, false, H, F, N, dh, H, g_, F, 0.f, gw2, F);   // dW2 = dhᵀ · g
    ops::ColumnSum(dh, N, H, gb2);                           // db2 = Σ dh
    Gemm(false, false, N, F, H, dh, H, w2, F, 0.f, g_, F);   // dg = dh · W2 (over g)
    ops::GeluBackward(a_, g_, N * F);                        // da = dg ⊙ gelu'(a) (in g_)
    Gemm(true, false, F, H, N, g_, F, u_, H, 0.f, gw1, H);   // dW1 = daᵀ · u
    ops::ColumnSum(g_, N, F, gb1);                           // db1 = Σ da
    Gemm(false, false, N, H, F, g_, F, w1, H, 0.f, du_, H);  // du = da · W1
    ops::RmsNormBackward(h_in, u_, rms_, du_, N, H, /*accumulate=*/true,
                         dh);  // residual: dh += ...
    StoreGrad(g[0], gw1, F * H);
    StoreGrad(g[1], gb1, F);
    StoreGrad(g[2], gw2, H * F);
    StoreGrad(g[3], gb2, H);
    return Status();
  }

  Status EmbedBackward(const std::vector<void*>& g, const float* dh) override {
    STRATA_RETURN_IF_ERROR(Expect(g, 3, "embedding gradients"));
    const int64_t VH = s_.vocab * s_.hidden;
    float* gt[3];
    for (int i = 0; i < 3; ++i) gt[i] = Grad(i, VH);
    ops::EmbedBackward(inputs_.data(), s_.batch, s_.seq_len, s_.hidden, s_.vocab, dh, gt[0], gt[1],
                       gt[2]);
    for (int i = 0; i < 3; ++i) StoreGrad(g[i], gt[i], VH);
    return Status();
  }

  Status CopyToHost(const float* device, float* host, int64_t n) override {
    std::memcpy(host, device, static_cast<size_t>(n) * 4);
    return Status();
  }

 private:
  static Status Expect(const std::vector<void*>& v, size_t n, const char* what) {
    if (v.size() != n)
      return InvalidArgumentError(std::string(what) + ": " + std::to_string(v.size()) +
                                  " tensors, expected " + std::to_string(n));
    return Status();
  }

  Status Prepare() override {
    if (a_) return Status();
    // One workspace: a, g [N × F]; u, du [N × H]; z [N × V]; rms [N] — slots
    // of the CUDA backend's workspace, allocated at its full size so that the
    // arena's layout matches the CUDA device's.
    const BackendLayout l = BackendWorkspaceLayout(s_);
    STRATA_ASSIGN_OR_RETURN(void* base, alloc_(l.total));
    char* b = static_cast<char*>(base);
    a_ = reinterpret_cast<float*>(b + l.a);
    g_ = reinterpret_cast<float*>(b + l.g);
    u_ = reinterpret_cast<float*>(b + l.u);
    du_ = reinterpret_cast<float*>(b + l.du);
    z_ = reinterpret_cast<float*>(b + l.z);
    rms_ = reinterpret_cast<float*>(b + l.rms);
    return Status();
  }

  // fp32 view of parameter `slot` (numel n): the pointer itself for fp32,
  // else a converted copy in host memory.
  const float* Param(const void* p, int64_t n, int slot) {
    if (dtype_ == DType::kFp32) return static_cast<const float*>(p);
    auto& buf = params_[slot];
    buf.resize(static_cast<size_t>(n));
    const uint16_t* src = static_cast<const uint16_t*>(p);
    if (dtype_ == DType::kBf16) {
      for (int64_t i = 0; i < n; ++i) buf[i] = ops::Bf16ToFloat(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = ops::HalfToFloat(src[i]);
    }
    return buf.data();
  }
  float* Grad(int slot, int64_t n) {
    auto& buf = grads_[slot];
    buf.resize(static_cast<size_t>(n));
    return buf.data();
  }
  void StoreGrad(void* dst, const float* src, int64_t n) {
    if (dtype_ == DType::kFp32) {
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    }
    uint16_t* d = static_cast<uint16_t*>(dst);
    if (dtype_ == DType::kBf16) {
      for (int64_t i = 0; i < n; ++i) d[i] = ops::FloatToBf16(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = ops::FloatToHalf(src[i]);
    }
  }

  // Row-major C[m × n] = op(A) · op(B) + beta · C.
  static void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.f, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }

  ModelShape s_;
  DType dtype_;
  WorkspaceFn alloc_;
  std::vector<int32_t> inputs_, targets_;
  double loss_ = 0;  // of the last HeadForwardAsync
  float *a_ = nullptr, *g_ = nullptr, *u_ = nullptr, *du_ = nullptr, *z_ = nullptr, *rms_ = nullptr;
  std::vector<float> params_[4], grads_[4];
};

}  // namespace

Status CheckHostBackendMemory(const ModelShape& shape) {
  // OpenBLAS 0.3.x maps a BUFFER_SIZE (128 MiB on x86-64) buffer, plus a
  // little, for a thread's first GEMM (measured: 131 MB of VmSize).
  constexpr uint64_t kOpenBlasBuffer = uint64_t{132} << 20;
  int64_t largest = 0;
  for (const ParamInfo& p : ParameterList(shape)) largest = std::max(largest, p.numel);
  const uint64_t copies = 8 * static_cast<uint64_t>(largest) * 4;  // 4 parameter + 4 gradient slots
  const std::string what = fmt::format(
      "the example model's host backend (fp32 copies of a module's parameters and gradients, {}, "
      "and OpenBLAS's GEMM buffer, {})",
      Bytes(copies), Bytes(kOpenBlasBuffer));
  // What cannot be read is not checked.
  uint64_t available = 0;
  if (ReadProcKb("/proc/meminfo", "MemAvailable", &available) && copies > available)
    return ResourceExhaustedError(fmt::format(
        "{} needs {} of memory but only {} are available (MemAvailable in /proc/meminfo)", what,
        BytesBoth(copies), BytesBoth(available)));
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return Status();
  const uint64_t limit = static_cast<uint64_t>(as.rlim_cur);
  uint64_t mapped = 0;
  ReadProcKb("/proc/self/status", "VmSize", &mapped);
  const uint64_t headroom = limit > mapped ? limit - mapped : 0;
  const uint64_t need = copies + kOpenBlasBuffer;
  if (need <= headroom) return Status();
  return ResourceExhaustedError(fmt::format(
      "{} needs {} of address space but only {} are available (RLIMIT_AS, `ulimit -v`, is {} "
      "with {} already mapped)",
      what, BytesBoth(need), BytesBoth(headroom), BytesBoth(limit), BytesBoth(mapped)));
}

std::string HostBlasArithmetic() {
  const char* config = openblas_get_config();
  const char* core = openblas_get_corename();
  return std::string(config ? config : "OpenBLAS (no config string)") + "; kernels " +
         (core ? core : "unknown") + "; " + std::to_string(kBlasThreads) + " thread";
}

std::string BlasKernelsFor(std::string_view picked, bool avx512, bool avx2_fma) {
  if (picked != "Prescott") return "";
  if (avx512) return "SkylakeX";
  if (avx2_fma) return "Haswell";
  return "";
}

std::string BetterBlasKernelsHere(std::string* why) {
  const char* core = openblas_get_corename();
  const std::string picked = core != nullptr ? core : "";
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  const bool avx512 = false, avx2_fma = false;
#endif
  const std::string kernels = BlasKernelsFor(picked, avx512, avx2_fma);
  if (kernels.empty() || why == nullptr) return kernels;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  unsigned family = 0, model = 0;
#if defined(__x86_64__)
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0) {
    family = (eax >> 8) & 0xf;
    model = (eax >> 4) & 0xf;
    if (family == 6 || family == 15) model |= ((eax >> 16) & 0xf) << 4;
    if (family == 15) family += (eax >> 20) & 0xff;
  }
#endif
  *why = fmt::format(
      "OpenBLAS ({}) does not know this CPU (x86 family {} model {}) and picked its generic {} "
      "kernels; running with OPENBLAS_CORETYPE={} (the CPU has {}). Set OPENBLAS_CORETYPE to "
      "choose other kernels.",
      openblas_get_config() != nullptr ? openblas_get_config() : "?", family, model, picked,
      kernels, kernels == "SkylakeX" ? "AVX-512" : "AVX2 and FMA");
  return kernels;
}

std::unique_ptr<Backend> NewHostBackend(const ModelShape& shape, DType dtype, WorkspaceFn alloc) {
  return std::make_unique<HostBackend>(shape, dtype, std::move(alloc));
}

}  // namespace strata::example
