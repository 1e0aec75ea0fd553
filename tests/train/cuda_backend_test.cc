// The example model's CUDA backend against its host backend (which
// model_test.cc checks against a double-precision reference), on random data,
// odd and tensor-core-friendly sizes, every dtype; and each kernel of
// cuda_kernels.h against a plain CPU loop (ops.h). Built when
// STRATA_HAVE_CUDA; every case skips, with the reason, without a CUDA device.
//
// Tolerances: the CUDA backend rounds each GEMM operand it produces (u,
// gelu(a), dh, dg, da, dz) to the parameter dtype, where the host backend
// keeps fp32, so bf16 (8 significant bits) is compared loosely, fp16 (11)
// tighter, fp32 at fp32 noise. Errors are measured over a whole tensor
// (relative L2) and per element against the tensor's largest value.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "examples/train/cublas_api.h"
#include "examples/train/cuda_kernels.h"
#include "examples/train/model.h"
#include "examples/train/ops.h"
#include "src/common/dtype.h"
#include "src/common/half.h"
#include "tests/test_util.h"

namespace strata::example {
namespace {

// Skips the test, naming why, when no CUDA device can be used.
#define SKIP_WITHOUT_CUDA_DEVICE()                                                    \
  do {                                                                                \
    int count_ = 0;                                                                   \
    const cudaError_t e_ = cudaGetDeviceCount(&count_);                               \
    if (e_ != cudaSuccess)                                                            \
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount: " << cudaGetErrorName(e_); \
    if (count_ == 0) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none"; \
  } while (0)

#define CUDA_ASSERT(expr)                                                \
  do {                                                                   \
    const cudaError_t e_ = (expr);                                       \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorName(e_); \
  } while (0)

// ---- host-side values in a dtype ---------------------------------------------------------
float RoundTo(float v, DType t) {
  if (t == DType::kBf16) return Bf16BitsToFloat(FloatToBf16Bits(v));
  if (t == DType::kFp16) return HalfBitsToFloat(FloatToHalfBits(v));
  return v;
}
// Relative rounding error of one value stored in t (half an ulp).
double Eps(DType t) { return t == DType::kBf16 ? 0x1p-8 : t == DType::kFp16 ? 0x1p-11 : 1e-6; }

std::vector<uint8_t> Encode(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::kFp32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = t == DType::kBf16 ? FloatToBf16Bits(v[i]) : FloatToHalfBits(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
std::vector<float> Decode(const std::vector<uint8_t>& b, DType t) {
  std::vector<float> out(b.size() / DTypeSize(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == DType::kFp32) {
      std::memcpy(&out[i], b.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      out[i] = t == DType::kBf16 ? Bf16BitsToFloat(h) : HalfBitsToFloat(h);
    }
  }
  return out;
}
std::vector<float> Rounded(std::vector<float> v, DType t) {
  for (float& f : v) f = RoundTo(f, t);
  return v;
}

// ---- device memory -------------------------------------------------------------------------
class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes) {
    if (cudaMalloc(&p_, std::max<size_t>(bytes, 16)) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceMem() { cudaFree(p_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

template <typename V>
std::unique_ptr<DeviceMem> Upload(const V& v) {
  const size_t bytes = v.size() * sizeof(v[0]);
  auto d = std::make_unique<DeviceMem>(bytes);
  if (d->get() != nullptr) cudaMemcpy(d->get(), v.data(), bytes, cudaMemcpyHostToDevice);
  return d;
}
std::vector<uint8_t> DownloadBytes(const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  cudaMemcpy(out.data(), p, bytes, cudaMemcpyDeviceToHost);
  return out;
}
std::vector<float> DownloadFloats(const void* p, size_t n) {
  std::vector<float> out(n);
  cudaMemcpy(out.data(), p, n * 4, cudaMemcpyDeviceToHost);
  return out;
}

// got vs want: relative L2 error over the tensor ≤ rel_l2, and every element
// within max_rel × max|want| (+ a floor for all-tiny tensors).
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double rel_l2,
                 double max_rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double diff2 = 0, norm2 = 0, peak = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    diff2 += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm2 += static_cast<double>(want[i]) * want[i];
    peak = std::max(peak, std::abs(static_cast<double>(want[i])));
  }
  EXPECT_LE(std::sqrt(diff2), rel_l2 * std::sqrt(norm2) + 1e-12) << what << ": relative L2 error";
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], max_rel * peak + 1e-7) << what << "[" << i << "]";
}

// ---- the whole backend: CUDA vs host -------------------------------------------------------
struct Case {
  DType dtype;
  int64_t hidden, seq_len, batch;
};

class CudaVsHostBackend : public ::testing::TestWithParam<Case> {};

// What one micro-batch through a backend (every module forward, then
// backward) leaves: the loss, the residual stream after every module but the
// head, the gradient w.r.t. the embedding's output and every parameter
// gradient (in the parameter dtype).
struct RunResult {
  double loss = 0;
  std::vector<std::vector<float>> hs;
  std::vector<float> dh;
  std::vector<std::vector<uint8_t>> grads;
};

TEST_P(CudaVsHostBackend, LossActivationsAndEveryGradientMatch) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const Case c = GetParam();
  const DType dt = c.dtype;
  uint64_t seed = 0;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  ModelShape s;
  s.layers = 2;
  s.hidden = c.hidden;
  s.seq_len = c.seq_len;
  s.batch = c.batch;
  s.vocab = 256;
  const int64_t N = s.tokens(), H = s.hidden, L = s.layers;
  std::vector<int32_t> x(N), y(N);
  for (int64_t i = 0; i < N; ++i) {
    x[i] = static_cast<int32_t>(rng() % 256);
    y[i] = static_cast<int32_t>(rng() % 256);
  }
  const std::vector<ParamInfo> list = ParameterList(s);
  std::vector<std::vector<uint8_t>> params;
  for (const ParamInfo& pi : list)
    params.push_back(
        Encode(testing::RandomFloats(rng, static_cast<size_t>(pi.numel), -0.6f, 0.6f), dt));
  const double scale = dt == DType::kFp16 ? 64.0 : 1.0;

  // Host backend: host memory.
  RunResult host;
  {
    std::vector<std::unique_ptr<std::vector<float>>> ws;
    auto alloc = [&](int64_t bytes) -> StatusOr<void*> {
      ws.push_back(std::make_unique<std::vector<float>>(static_cast<size_t>(bytes / 4 + 1)));
      return static_cast<void*>(ws.back()->data());
    };
    std::unique_ptr<Backend> be = NewHostBackend(s, dt, alloc);
    ASSERT_TRUE(be->Prepare().ok());
    ASSERT_TRUE(be->SetBatch(x, y).ok());
    std::vector<std::vector<uint8_t>> grads;
    for (const ParamInfo& pi : list) grads.emplace_back(pi.numel * DTypeSize(dt), 0xAB);
    auto view = [](auto& bufs, size_t from, size_t n) {
      std::vector<void*> v;
      for (size_t i = from; i < from + n; ++i) v.push_back(bufs[i].data());
      return v;
    };
    host.hs.assign(static_cast<size_t>(L + 1), std::vector<float>(N * H));
    host.dh.assign(N * H, 0.f);
    ASSERT_TRUE(be->EmbedForward(view(params, 0, 3), host.hs[0].data()).ok());
    for (int64_t l = 1; l <= L; ++l)
      ASSERT_TRUE(be->BlockForward(view(params, 3 + 4 * (l - 1), 4), host.hs[l - 1].data(),
                                   host.hs[l].data())
                      .ok());
    const size_t head = 3 + 4 * static_cast<size_t>(L);
    StatusOr<double> loss = be->HeadForward(view(params, head, 2), host.hs[L].data(), scale);
    ASSERT_TRUE(loss.ok()) << loss.status();
    host.loss = *loss;
    ASSERT_TRUE(be->HeadBackward(view(params, head, 2), view(grads, head, 2), host.hs[L].data(),
                                 host.dh.data())
                    .ok());
    for (int64_t l = L; l >= 1; --l)
      ASSERT_TRUE(be->BlockBackward(view(params, 3 + 4 * (l - 1), 4),
                                    view(grads, 3 + 4 * (l - 1), 4), host.hs[l - 1].data(),
                                    host.dh.data())
                      .ok());
    ASSERT_TRUE(be->EmbedBackward(view(grads, 0, 3), host.dh.data()).ok());
    host.grads = std::move(grads);
  }

  // CUDA backend, twice (the second run must give the same bits).
  cudaStream_t stream;
  CUDA_ASSERT(cudaStreamCreate(&stream));
  std::vector<std::unique_ptr<DeviceMem>> dparams;
  for (const auto& p : params) dparams.push_back(Upload(p));
  RunResult gpu[2];
  for (RunResult& run : gpu) {
    std::vector<std::unique_ptr<DeviceMem>> ws;
    auto alloc = [&](int64_t bytes) -> StatusOr<void*> {
      ws.push_back(std::make_unique<DeviceMem>(static_cast<size_t>(bytes)));
      if (ws.back()->get() == nullptr) return ResourceExhaustedError("cudaMalloc");
      return ws.back()->get();
    };
    StatusOr<std::unique_ptr<Backend>> made = NewCudaBackend(s, dt, stream, alloc);
    ASSERT_TRUE(made.ok()) << made.status();
    Backend& be = **made;
    ASSERT_TRUE(be.Prepare().ok());
    ASSERT_TRUE(be.SetBatch(x, y).ok());
    std::vector<std::unique_ptr<DeviceMem>> dgrads;
    for (const ParamInfo& pi : list)
      dgrads.push_back(Upload(std::vector<uint8_t>(pi.numel * DTypeSize(dt), 0xAB)));
    DeviceMem dhs((L + 2) * N * H * 4);
    float* hs = dhs.as<float>();
    float* dh = hs + (L + 1) * N * H;
    auto view = [](auto& bufs, size_t from, size_t n) {
      std::vector<void*> v;
      for (size_t i = from; i < from + n; ++i) v.push_back(bufs[i]->get());
      return v;
    };
    ASSERT_TRUE(be.EmbedForward(view(dparams, 0, 3), hs).ok());
    for (int64_t l = 1; l <= L; ++l)
      ASSERT_TRUE(
          be.BlockForward(view(dparams, 3 + 4 * (l - 1), 4), hs + (l - 1) * N * H, hs + l * N * H)
              .ok());
    const size_t head = 3 + 4 * static_cast<size_t>(L);
    StatusOr<double> loss = be.HeadForward(view(dparams, head, 2), hs + L * N * H, scale);
    ASSERT_TRUE(loss.ok()) << loss.status();
    run.loss = *loss;
    ASSERT_TRUE(
        be.HeadBackward(view(dparams, head, 2), view(dgrads, head, 2), hs + L * N * H, dh).ok());
    for (int64_t l = L; l >= 1; --l)
      ASSERT_TRUE(be.BlockBackward(view(dparams, 3 + 4 * (l - 1), 4),
                                   view(dgrads, 3 + 4 * (l - 1), 4), hs + (l - 1) * N * H, dh)
                      .ok());
    ASSERT_TRUE(be.EmbedBackward(view(dgrads, 0, 3), dh).ok());
    for (int64_t l = 0; l <= L; ++l) {
      run.hs.emplace_back(N * H);
      ASSERT_TRUE(be.CopyToHost(hs + l * N * H, run.hs.back().data(), N * H).ok());
    }
    run.dh.resize(N * H);
    ASSERT_TRUE(be.CopyToHost(dh, run.dh.data(), N * H).ok());
    CUDA_ASSERT(cudaStreamSynchronize(stream));
    for (size_t k = 0; k < list.size(); ++k)
      run.grads.push_back(DownloadBytes(dgrads[k]->get(), list[k].numel * DTypeSize(dt)));
  }
  CUDA_ASSERT(cudaStreamDestroy(stream));

  const double rel = dt == DType::kBf16 ? 5e-2 : dt == DType::kFp16 ? 1.5e-2 : 1e-4;
  const double peak = dt == DType::kBf16 ? 0.15 : dt == DType::kFp16 ? 0.05 : 1e-3;
  const double loss_rel = dt == DType::kBf16 ? 1e-2 : dt == DType::kFp16 ? 3e-3 : 1e-5;
  EXPECT_NEAR(gpu[0].loss, host.loss, loss_rel * host.loss);
  for (int64_t l = 0; l <= L; ++l)
    ExpectClose(gpu[0].hs[l], host.hs[l], rel, peak, "h" + std::to_string(l));
  ExpectClose(gpu[0].dh, host.dh, rel, peak, "dh (embedding output)");
  for (size_t k = 0; k < list.size(); ++k)
    ExpectClose(Decode(gpu[0].grads[k], dt), Decode(host.grads[k], dt), rel, peak,
                "gradient " + list[k].name);

  EXPECT_EQ(gpu[0].loss, gpu[1].loss);
  for (size_t k = 0; k < list.size(); ++k)
    EXPECT_EQ(gpu[0].grads[k], gpu[1].grads[k]) << list[k].name << " differs between two runs";
}

INSTANTIATE_TEST_SUITE_P(
    EveryDType, CudaVsHostBackend,
    ::testing::Values(
        // odd sizes: no dimension a multiple of a vector width (cuBLAS's non-tensor-core paths)
        Case{DType::kFp32, 9, 5, 3}, Case{DType::kBf16, 9, 5, 3}, Case{DType::kFp16, 9, 5, 3},
        // multiples of 8: cuBLAS's tensor-core kernels for bf16/fp16
        Case{DType::kFp32, 64, 24, 3}, Case{DType::kBf16, 64, 24, 3}, Case{DType::kFp16, 64, 24, 3},
        // hidden > 256: rows wider than one 256-thread block (rms norm,
        // softmax) and column sums over several column tiles and many chunks
        Case{DType::kFp32, 328, 9, 2}, Case{DType::kBf16, 328, 9, 2},
        // more than 65,535 rows (tokens): row grids stride in y, one-block-
        // per-row kernels use a grid x beyond 65,535, column chunks capped
        Case{DType::kFp32, 8, 1031, 64}, Case{DType::kBf16, 8, 1031, 64}),
    [](const auto& info) {
      return std::string(DTypeName(info.param.dtype)) + "_h" + std::to_string(info.param.hidden) +
             "_n" + std::to_string(info.param.seq_len * info.param.batch);
    });

// ---- the column sums' chunking (host code: runs without a GPU) ------------------------------
// cuBLAS is opened when the first CUDA backend is created, not linked: a
// library that is not there is a Status naming it and dlerror() (no GPU needed).
TEST(CublasLibrary, MissingLibraryIsUnavailableNamingIt) {
  const Status s = ProbeCublasLibrary("libcublas-strata-no-such.so.13");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  const std::string msg(s.message());
  EXPECT_NE(msg.find("cuBLAS could not be loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dlopen(\"libcublas-strata-no-such.so.13\")"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot open shared object file"), std::string::npos) << msg;
}

// The toolkit's cuBLAS, the one the headers are from, loads and has every
// function the backend binds.
TEST(CublasLibrary, ToolkitLibraryLoadsAndBinds) {
  EXPECT_TRUE(CublasSoname().starts_with("libcublas.so.")) << CublasSoname();
  auto api = Cublas();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_NE((*api)->GemmEx, nullptr);
  EXPECT_EQ(*api, *Cublas());  // opened once
}

TEST(CudaColumnChunks, FillsAnH100AndStaysInsideThePartialBuffer) {
  const int64_t cap = int64_t{cuda::kColumnChunks} * 8192;  // the 270M shape: F = 8192
  auto blocks = [](int64_t C, int chunks) { return (C + 255) / 256 * chunks; };
  // hidden 2048: 8 column tiles; 128 chunks make 1024 blocks (132 SMs × ~8).
  EXPECT_EQ(cuda::ColumnChunks(4096, 2048, cap), 128);
  EXPECT_GE(blocks(2048, cuda::ColumnChunks(4096, 2048, cap)), cuda::kColumnSumBlocks);
  // F = 8192 already has 32 tiles: the 32 chunks of before.
  EXPECT_EQ(cuda::ColumnChunks(4096, 8192, cap), cuda::kColumnChunks);
  for (int64_t C : {1, 24, 45, 256, 2048, 8192, 32000})
    for (int64_t N : {1, 37, 4096, 70001}) {
      const int k = cuda::ColumnChunks(N, C, cap);
      EXPECT_GE(k, 1);
      EXPECT_LE(k * C, std::max(cap, C)) << "N " << N << " C " << C;  // fits the buffer
      EXPECT_LE(k, std::min<int64_t>(N, 65535));
      EXPECT_EQ(k, cuda::ColumnChunks(N, C, cap));  // a function of the shape only
    }
  // A buffer of only 32 × C floats keeps the old chunking.
  EXPECT_EQ(cuda::ColumnChunks(4096, 2048, int64_t{32} * 2048), 32);
}

// ---- each kernel against a CPU loop --------------------------------------------------------
class CudaKernels : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CUDA_DEVICE();
    rng_ = testing::MakeRng(&seed_);
  }
  int dtype() const { return static_cast<int>(GetParam()); }
  std::vector<float> Random(size_t n, float lo = -1.f, float hi = 1.f) {
    return testing::RandomFloats(rng_, n, lo, hi);
  }
  // Synchronizes the device and checks the launch's and the kernel's status.
  static void Finish(cudaError_t launch) {
    ASSERT_EQ(launch, cudaSuccess) << cudaGetErrorName(launch);
    const cudaError_t e = cudaDeviceSynchronize();
    ASSERT_EQ(e, cudaSuccess) << cudaGetErrorName(e);
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  static constexpr int64_t kN = 37, kH = 45, kF = 4 * 45, kV = 256, kSeq = 7;
};

TEST_P(CudaKernels, RmsForwardAndBackward) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const DType t = GetParam();
  const std::vector<float> h = Random(kN * kH, -3.f, 3.f), du = Random(kN * kH);
  std::vector<float> u(kN * kH), r(kN), dh0 = Random(kN * kH);
  ops::RmsNormForward(h.data(), kN, kH, u.data(), r.data());
  auto dh_d = Upload(h), du_d = Upload(du);
  DeviceMem ut(kN * kH * 4), rd(kN * 4);
  Finish(cuda::RmsForward(dh_d->as<float>(), kN, kH, dtype(), ut.get(), rd.as<float>(), nullptr));
  ExpectClose(DownloadFloats(rd.get(), kN), r, 1e-5, 1e-5, "r");
  ExpectClose(Decode(DownloadBytes(ut.get(), kN * kH * DTypeSize(t)), t), Rounded(u, t), 2 * Eps(t),
              2 * Eps(t), "u");
  for (bool accumulate : {false, true}) {
    std::vector<float> want = dh0;
    ops::RmsNormBackward(h.data(), u.data(), r.data(), du.data(), kN, kH, accumulate, want.data());
    auto out = Upload(dh0);
    Finish(cuda::RmsBackward(dh_d->as<float>(), rd.as<float>(), du_d->as<float>(), kN, kH,
                             accumulate, out->as<float>(), nullptr));
    ExpectClose(DownloadFloats(out->get(), kN * kH), want, 1e-5, 2e-5,
                accumulate ? "dh +=" : "dh =");
  }
}

TEST_P(CudaKernels, BiasGeluAndItsBackward) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const DType t = GetParam();
  const std::vector<float> a = Random(kN * kF, -4.f, 4.f), b = Rounded(Random(kF), t);
  const std::vector<float> dg = Rounded(Random(kN * kF), t);
  auto a_d = Upload(a), b_d = Upload(Encode(b, t));
  DeviceMem g(kN * kF * 4), partial(cuda::kColumnChunks * kF * 4), db(kF * 4);
  const int64_t partial_floats = cuda::kColumnChunks * kF;
  Finish(cuda::BiasGelu(a_d->as<float>(), b_d->get(), kN, kF, dtype(), g.get(), nullptr));
  std::vector<float> want(kN * kF), da(kN * kF), want_db(kF, 0.f);
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t j = 0; j < kF; ++j) {
      const float v = a[n * kF + j] + b[j];
      want[n * kF + j] = ops::Gelu(v);
      da[n * kF + j] = dg[n * kF + j] * ops::GeluGrad(v);
    }
  ops::ColumnSum(da.data(), kN, kF, want_db.data());
  ExpectClose(Decode(DownloadBytes(g.get(), kN * kF * DTypeSize(t)), t), Rounded(want, t),
              2 * Eps(t), 2 * Eps(t), "gelu");
  auto d = Upload(Encode(dg, t));
  Finish(cuda::GeluBackwardBiasGrad(a_d->as<float>(), b_d->get(), kN, kF, dtype(), d->get(),
                                    partial.as<float>(), partial_floats, db.get(), nullptr));
  ExpectClose(Decode(DownloadBytes(d->get(), kN * kF * DTypeSize(t)), t), Rounded(da, t),
              2 * Eps(t), 2 * Eps(t), "da");
  ExpectClose(Decode(DownloadBytes(db.get(), kF * DTypeSize(t)), t), Rounded(want_db, t),
              2 * Eps(t) + 1e-5, 2 * Eps(t) + 1e-5, "db");
}

TEST_P(CudaKernels, ColumnSumCastAndAddRowBias) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const DType t = GetParam();
  const std::vector<float> x = Random(kN * kH), b = Rounded(Random(kH), t);
  std::vector<float> sum(kH);
  ops::ColumnSum(x.data(), kN, kH, sum.data());
  auto x_d = Upload(x), b_d = Upload(Encode(b, t));
  DeviceMem xt(kN * kH * 4), partial(cuda::kColumnChunks * kH * 4), db(kH * 4), out(kN * kH * 4);
  for (bool cast : {true, false}) {
    Finish(cuda::ColumnSumCast(x_d->as<float>(), kN, kH, dtype(), cast ? xt.get() : nullptr,
                               partial.as<float>(), cuda::kColumnChunks * kH, db.get(), nullptr));
    ExpectClose(Decode(DownloadBytes(db.get(), kH * DTypeSize(t)), t), Rounded(sum, t),
                2 * Eps(t) + 1e-5, 2 * Eps(t) + 1e-5, "column sum");
  }
  ExpectClose(Decode(DownloadBytes(xt.get(), kN * kH * DTypeSize(t)), t), Rounded(x, t), 0, 0,
              "cast");
  Finish(cuda::AddRowBias(x_d->as<float>(), b_d->get(), kN, kH, dtype(), out.as<float>(), nullptr));
  std::vector<float> want(kN * kH);
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t j = 0; j < kH; ++j) want[n * kH + j] = x[n * kH + j] + b[j];
  ExpectClose(DownloadFloats(out.get(), kN * kH), want, 0, 0, "x + b");
}

// Wide and tall column sums: hidden 2048 (8 column tiles, so 128 row chunks
// to fill a large GPU) and more than 65,535 rows (chunks capped at 65,535);
// the sum matches the CPU loop and a second run gives the same bits.
TEST_P(CudaKernels, ColumnSumsOverManyChunksAreDeterministic) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const DType t = GetParam();
  struct Shape {
    int64_t N, C;
  };
  for (const Shape sh : {Shape{300, 2048}, Shape{70001, 24}}) {
    SCOPED_TRACE("N " + std::to_string(sh.N) + " C " + std::to_string(sh.C));
    const std::vector<float> x = Random(static_cast<size_t>(sh.N * sh.C));
    std::vector<float> sum(static_cast<size_t>(sh.C));
    ops::ColumnSum(x.data(), sh.N, sh.C, sum.data());
    const int64_t partial_floats = int64_t{cuda::kColumnChunks} * 8192;
    auto x_d = Upload(x);
    DeviceMem partial(static_cast<size_t>(partial_floats) * 4), db(static_cast<size_t>(sh.C) * 4);
    std::vector<uint8_t> first;
    for (int run = 0; run < 2; ++run) {
      Finish(cuda::ColumnSumCast(x_d->as<float>(), sh.N, sh.C, dtype(), nullptr,
                                 partial.as<float>(), partial_floats, db.get(), nullptr));
      std::vector<uint8_t> got = DownloadBytes(db.get(), static_cast<size_t>(sh.C) * DTypeSize(t));
      if (run == 0) {
        // fp32 sums of up to 70,001 values in a different order: ~1e-6 relative.
        ExpectClose(Decode(got, t), Rounded(sum, t), 2 * Eps(t) + 1e-5, 2 * Eps(t) + 1e-5,
                    "column sum");
        first = std::move(got);
      } else {
        EXPECT_EQ(got, first) << "a second run gave other bits";
      }
    }
  }
}

TEST_P(CudaKernels, SoftmaxCrossEntropyWithBias) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const DType t = GetParam();
  const std::vector<float> z = Random(kN * kV, -5.f, 5.f), b = Rounded(Random(kV), t);
  std::vector<int32_t> y(kN);
  for (int32_t& v : y) v = static_cast<int32_t>(rng_() % kV);
  const float scale = 3.f / kN;
  std::vector<float> want = z;
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t j = 0; j < kV; ++j) want[n * kV + j] += b[j];
  const double want_loss = ops::SoftmaxCrossEntropy(want.data(), y.data(), kN, kV, scale);
  auto z_d = Upload(z), b_d = Upload(Encode(b, t)), y_d = Upload(y);
  DeviceMem loss(kN * 4);
  Finish(cuda::SoftmaxXent(z_d->as<float>(), b_d->get(), dtype(), y_d->as<int32_t>(), kN, kV, scale,
                           loss.as<float>(), nullptr));
  double got_loss = 0;
  for (float l : DownloadFloats(loss.get(), kN)) got_loss += l;
  EXPECT_NEAR(got_loss / kN, want_loss, 1e-5 * want_loss);
  ExpectClose(DownloadFloats(z_d->get(), kN * kV), want, 1e-5, 1e-5, "dz");
}

TEST_P(CudaKernels, EmbeddingForwardAndBackward) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const DType t = GetParam();
  const int64_t batch = 3, N = batch * kSeq, V = kV, H = kH;
  std::vector<int32_t> x(N);
  for (int32_t& v : x) v = static_cast<int32_t>(rng_() % 11);  // few tokens: long runs
  std::vector<float> tab[3];
  for (auto& tb : tab) tb = Rounded(Random(V * H), t);
  std::vector<float> want(N * H);
  ops::EmbedForward(x.data(), batch, kSeq, H, tab[0].data(), tab[1].data(), tab[2].data(),
                    want.data());
  auto x_d = Upload(x);
  std::unique_ptr<DeviceMem> tab_d[3];
  for (int i = 0; i < 3; ++i) tab_d[i] = Upload(Encode(tab[i], t));
  DeviceMem h0(N * H * 4);
  Finish(cuda::EmbedForward(x_d->as<int32_t>(), kSeq, H, N, tab_d[0]->get(), tab_d[1]->get(),
                            tab_d[2]->get(), dtype(), h0.as<float>(), nullptr));
  ExpectClose(DownloadFloats(h0.get(), N * H), want, 1e-6, 1e-6, "h0");

  // Positions sorted by token (stable) and each token's offset, as SetBatch builds them.
  std::vector<int32_t> offsets(V + 1, 0), order(N);
  for (int32_t v : x) ++offsets[v + 1];
  for (int64_t v = 0; v < V; ++v) offsets[v + 1] += offsets[v];
  std::vector<int32_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t n = 0; n < N; ++n) order[next[x[n]]++] = static_cast<int32_t>(n);
  const std::vector<float> dh = Random(N * H);
  std::vector<float> g[3];
  for (auto& gg : g) gg.resize(V * H);
  ops::EmbedBackward(x.data(), batch, kSeq, H, V, dh.data(), g[0].data(), g[1].data(), g[2].data());
  auto order_d = Upload(order), offsets_d = Upload(offsets), dh_d = Upload(dh);
  std::unique_ptr<DeviceMem> g_d[3];
  for (auto& gd : g_d) gd = Upload(std::vector<uint8_t>(V * H * DTypeSize(t), 0xAB));
  Finish(cuda::EmbedBackward(order_d->as<int32_t>(), offsets_d->as<int32_t>(), V, kSeq, H,
                             dh_d->as<float>(), dtype(), g_d[0]->get(), g_d[1]->get(),
                             g_d[2]->get(), nullptr));
  // Same order of additions as the CPU loop: equal after rounding to the dtype.
  for (int i = 0; i < 3; ++i)
    ExpectClose(Decode(DownloadBytes(g_d[i]->get(), V * H * DTypeSize(t)), t), Rounded(g[i], t), 0,
                0, "table gradient " + std::to_string(i));
}

INSTANTIATE_TEST_SUITE_P(EveryDType, CudaKernels,
                         ::testing::Values(DType::kFp32, DType::kBf16, DType::kFp16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace strata::example
