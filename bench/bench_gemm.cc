// bench_gemm: the example model's GEMMs of one micro-batch, timed raw with
// cuBLAS — the bound its compute could reach — for `strata report` to set
// against the model's measured compute time (CUDA builds only).
//
//   build/bench/bench_gemm --layers L --hidden H --tokens N [--vocab V]
//       [--dtype bf16|fp16|fp32] [--reps R] [--json]
//
// The list is the CUDA backend's (examples/train/cuda_backend.cc), same
// shapes, transposes, leading dimensions, output types and math mode
// (tensor cores for 16-bit operands, fp32 accumulation, no TF32, no
// reduced-precision reductions), F = 4H:
//   per block: forward u·W1ᵀ (N×F×H), g·W2ᵀ (N×H×F); backward the recomputed
//              u·W1ᵀ, dW2 = dhᵀ·g (H×F×N), dg = dh·W2 (N×F×H),
//              dW1 = dgᵀ·u (F×H×N), du = dg·W1 (N×H×F): 7 GEMMs of 2NHF flops;
//   head:      forward u·Woutᵀ (N×V×H); backward dWout (V×H×N), du (N×H×V).
// Operands hold 1.0 (values do not change a GEMM's speed). Times R
// micro-batches with CUDA events (median), after 2 warm-up ones. Without a
// GPU it says so and exits 0.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "bench_gemm: %s\nusage: bench_gemm --layers L --hidden H --tokens N [--vocab V] "
               "[--dtype bf16|fp16|fp32] [--reps R] [--json]\n",
               why);
  std::exit(2);
}

void Cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gemm: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void Blas(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_gemm: %s: cuBLAS status %d\n", what, static_cast<int>(e));
    std::exit(1);
  }
}

struct Gemm {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  bool c_is_fp32;  // else the operand type
  float beta;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t L = 0, H = 0, N = 0, V = 256;
  int reps = 10;
  std::string dtype = "bf16";
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--layers")
      L = std::atoll(next().c_str());
    else if (a == "--hidden")
      H = std::atoll(next().c_str());
    else if (a == "--tokens")
      N = std::atoll(next().c_str());
    else if (a == "--vocab")
      V = std::atoll(next().c_str());
    else if (a == "--dtype")
      dtype = next();
    else if (a == "--reps")
      reps = std::atoi(next().c_str());
    else if (a == "--json")
      json = true;
    else
      Usage(("unknown argument " + a).c_str());
  }
  if (L < 1 || H < 1 || N < 1 || V < 1 || reps < 1) Usage("--layers, --hidden, --tokens >= 1");
  if (dtype != "bf16" && dtype != "fp16" && dtype != "fp32") Usage("--dtype bf16|fp16|fp32");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf(json ? "{\"device\": \"none\", \"reason\": \"no CUDA device\"}\n"
                     : "bench_gemm: no CUDA device; nothing measured\n");
    return 0;
  }
  const int64_t F = 4 * H;
  std::vector<Gemm> list;
  for (int64_t l = 0; l < L; ++l) {
    list.push_back({false, true, N, F, H, H, H, F, true, 0.f});  // a = u·W1ᵀ
    list.push_back({false, true, N, H, F, F, F, H, true, 1.f});  // h += g·W2ᵀ
  }
  list.push_back({false, true, N, V, H, H, H, V, true, 0.f});   // logits
  list.push_back({true, false, V, H, N, V, H, H, false, 0.f});  // dWout
  list.push_back({false, false, N, H, V, V, H, H, true, 0.f});  // du
  for (int64_t l = 0; l < L; ++l) {
    list.push_back({false, true, N, F, H, H, H, F, true, 0.f});    // recompute a
    list.push_back({true, false, H, F, N, H, F, F, false, 0.f});   // dW2
    list.push_back({false, false, N, F, H, H, F, F, false, 0.f});  // dg
    list.push_back({true, false, F, H, N, F, H, H, false, 0.f});   // dW1
    list.push_back({false, false, N, H, F, F, H, H, true, 0.f});   // du
  }
  const cudaDataType type =
      dtype == "bf16" ? CUDA_R_16BF : (dtype == "fp16" ? CUDA_R_16F : CUDA_R_32F);
  const size_t esize = dtype == "fp32" ? 4 : 2;
  size_t elems = 0;
  double flops = 0;
  for (const Gemm& g : list) {
    elems = std::max({elems, size_t(g.m * g.k), size_t(g.k * g.n), size_t(g.m * g.n)});
    flops += 2.0 * g.m * g.n * g.k;
  }
  void *a = nullptr, *b = nullptr, *c = nullptr;
  Cuda(cudaMalloc(&a, elems * esize), "cudaMalloc A");
  Cuda(cudaMalloc(&b, elems * esize), "cudaMalloc B");
  Cuda(cudaMalloc(&c, elems * 4), "cudaMalloc C");
  {
    std::vector<unsigned char> one(elems * esize);
    const uint16_t bits = dtype == "bf16" ? 0x3F80 : 0x3C00;
    const float f = 1.f;
    for (size_t i = 0; i < elems; ++i)
      std::memcpy(one.data() + i * esize, esize == 2 ? static_cast<const void*>(&bits) : &f, esize);
    Cuda(cudaMemcpy(a, one.data(), one.size(), cudaMemcpyHostToDevice), "fill A");
    Cuda(cudaMemcpy(b, one.data(), one.size(), cudaMemcpyHostToDevice), "fill B");
    Cuda(cudaMemset(c, 0, elems * 4), "fill C");
  }
  cudaStream_t stream;
  Cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  cublasHandle_t blas;
  Blas(cublasCreate(&blas), "cublasCreate");
  Blas(cublasSetStream(blas, stream), "cublasSetStream");
  Blas(cublasSetMathMode(
           blas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                           CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
       "cublasSetMathMode");
  auto micro_batch = [&] {
    for (const Gemm& g : list) {
      const float alpha = 1.f;
      // Row-major C = op(A)·op(B) as column-major Cᵀ = op(B)ᵀ·op(A)ᵀ (as the backend).
      Blas(cublasGemmEx(blas, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                        static_cast<int>(g.n), static_cast<int>(g.m), static_cast<int>(g.k), &alpha,
                        b, type, static_cast<int>(g.ldb), a, type, static_cast<int>(g.lda), &g.beta,
                        c, g.c_is_fp32 ? CUDA_R_32F : type, static_cast<int>(g.ldc),
                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
           "cublasGemmEx");
    }
  };
  cudaEvent_t t0, t1;
  Cuda(cudaEventCreate(&t0), "cudaEventCreate");
  Cuda(cudaEventCreate(&t1), "cudaEventCreate");
  for (int w = 0; w < 2; ++w) micro_batch();
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    Cuda(cudaEventRecord(t0, stream), "cudaEventRecord");
    micro_batch();
    Cuda(cudaEventRecord(t1, stream), "cudaEventRecord");
    Cuda(cudaEventSynchronize(t1), "cudaEventSynchronize");
    float ms = 0;
    Cuda(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
    s.push_back(ms * 1e-3);
  }
  std::sort(s.begin(), s.end());
  const double med = s[s.size() / 2];
  cudaDeviceProp prop{};
  Cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (json)
    std::printf(
        "{\"device\": \"%s\", \"layers\": %lld, \"hidden\": %lld, \"tokens\": %lld, \"vocab\": "
        "%lld, \"dtype\": \"%s\", \"gemms_per_micro_batch\": %zu, \"flops_per_micro_batch\": "
        "%.6g, \"gemm_s_per_micro_batch\": %.6g, \"tflops\": %.6g, \"reps\": %d}\n",
        prop.name, static_cast<long long>(L), static_cast<long long>(H), static_cast<long long>(N),
        static_cast<long long>(V), dtype.c_str(), list.size(), flops, med, flops / med / 1e12,
        reps);
  else
    std::printf(
        "%s: %zu GEMMs per micro-batch (%s, N=%lld H=%lld L=%lld V=%lld): %.3f ms "
        "(median of %d), %.1f TFLOP/s\n",
        prop.name, list.size(), dtype.c_str(), static_cast<long long>(N), static_cast<long long>(H),
        static_cast<long long>(L), static_cast<long long>(V), med * 1e3, reps, flops / med / 1e12);
  cublasDestroy(blas);
  cudaStreamDestroy(stream);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 0;
}
