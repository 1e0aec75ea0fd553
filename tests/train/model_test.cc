// The example model: the host backend against an independent double-precision
// reference (every dtype, odd sizes), the data generator, and training through
// the Engine on the host device (loss decreases; placement never changes a bit).
#include "examples/train/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "apps/strata/train/train.h"
#include "examples/train/ops.h"
#include "src/common/dtype.h"
#include "src/common/half.h"
#include "tests/test_util.h"

namespace strata::example {
namespace {

using cli::Train;
using cli::TrainResult;

// ---- reference: the whole model in double, naive loops --------------------------------
struct RefModel {
  ModelShape s;
  // name → values (already rounded to the parameter dtype)
  std::map<std::string, std::vector<double>> p, g;

  double Gelu(double a) const {
    return 0.5 * a * (1 + std::tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)));
  }

  // Returns the mean loss and fills g with d(loss · scale)/dparam.
  double Run(const std::vector<int32_t>& x, const std::vector<int32_t>& y, double scale) {
    const int64_t N = s.tokens(), H = s.hidden, F = s.ffn(), V = s.vocab, L = s.layers,
                  T = s.seq_len;
    for (auto& [name, v] : p) g[name].assign(v.size(), 0.0);
    // Forward, keeping every layer's input.
    std::vector<std::vector<double>> hs(static_cast<size_t>(L + 1), std::vector<double>(N * H));
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = n % T;
      for (int64_t j = 0; j < H; ++j) {
        double v = p["embed.tok"][x[n] * H + j];
        if (t >= 1) v += p["embed.prev1"][x[n - 1] * H + j];
        if (t >= 2) v += p["embed.prev2"][x[n - 2] * H + j];
        hs[0][n * H + j] = v;
      }
    }
    auto rms = [&](const std::vector<double>& h, std::vector<double>* u, std::vector<double>* r) {
      u->assign(N * H, 0);
      r->assign(N, 0);
      for (int64_t n = 0; n < N; ++n) {
        double ss = 0;
        for (int64_t j = 0; j < H; ++j) ss += h[n * H + j] * h[n * H + j];
        (*r)[n] = std::sqrt(ss / H + 1e-5);
        for (int64_t j = 0; j < H; ++j) (*u)[n * H + j] = h[n * H + j] / (*r)[n];
      }
    };
    auto rms_back = [&](const std::vector<double>& u, const std::vector<double>& r,
                        const std::vector<double>& du, std::vector<double>* dh) {
      for (int64_t n = 0; n < N; ++n) {
        double dot = 0;
        for (int64_t j = 0; j < H; ++j) dot += du[n * H + j] * u[n * H + j];
        for (int64_t j = 0; j < H; ++j)
          (*dh)[n * H + j] += (du[n * H + j] - u[n * H + j] * dot / H) / r[n];
      }
    };
    std::vector<double> u, r;
    for (int64_t l = 1; l <= L; ++l) {
      const std::string b = "block" + std::to_string(l);
      auto &w1 = p[b + ".w1"], &b1 = p[b + ".b1"], &w2 = p[b + ".w2"], &b2 = p[b + ".b2"];
      rms(hs[l - 1], &u, &r);
      for (int64_t n = 0; n < N; ++n) {
        std::vector<double> gv(F);
        for (int64_t f = 0; f < F; ++f) {
          double a = b1[f];
          for (int64_t j = 0; j < H; ++j) a += w1[f * H + j] * u[n * H + j];
          gv[f] = Gelu(a);
        }
        for (int64_t j = 0; j < H; ++j) {
          double o = hs[l - 1][n * H + j] + b2[j];
          for (int64_t f = 0; f < F; ++f) o += w2[j * F + f] * gv[f];
          hs[l][n * H + j] = o;
        }
      }
    }
    rms(hs[L], &u, &r);
    double loss = 0;
    std::vector<double> dz(N * V);
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> z(V);
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        z[v] = p["head.b"][v];
        for (int64_t j = 0; j < H; ++j) z[v] += p["head.w"][v * H + j] * u[n * H + j];
        mx = std::max(mx, z[v]);
      }
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
      loss += std::log(sum) - (z[y[n]] - mx);
      for (int64_t v = 0; v < V; ++v)
        dz[n * V + v] = (std::exp(z[v] - mx) / sum - (v == y[n])) * scale / N;
    }
    loss /= N;
    // Backward.
    std::vector<double> dh(N * H, 0), du(N * H, 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < V; ++v) {
        g["head.b"][v] += dz[n * V + v];
        for (int64_t j = 0; j < H; ++j) {
          g["head.w"][v * H + j] += dz[n * V + v] * u[n * H + j];
          du[n * H + j] += dz[n * V + v] * p["head.w"][v * H + j];
        }
      }
    rms_back(u, r, du, &dh);
    for (int64_t l = L; l >= 1; --l) {
      const std::string b = "block" + std::to_string(l);
      auto &w1 = p[b + ".w1"], &b1 = p[b + ".b1"], &w2 = p[b + ".w2"];
      rms(hs[l - 1], &u, &r);
      std::vector<double> du2(N * H, 0);
      for (int64_t n = 0; n < N; ++n) {
        std::vector<double> a(F), gv(F);
        for (int64_t f = 0; f < F; ++f) {
          a[f] = b1[f];
          for (int64_t j = 0; j < H; ++j) a[f] += w1[f * H + j] * u[n * H + j];
          gv[f] = Gelu(a[f]);
        }
        for (int64_t j = 0; j < H; ++j) g[b + ".b2"][j] += dh[n * H + j];
        for (int64_t f = 0; f < F; ++f) {
          double dg = 0;
          for (int64_t j = 0; j < H; ++j) {
            g[b + ".w2"][j * F + f] += dh[n * H + j] * gv[f];
            dg += dh[n * H + j] * w2[j * F + f];
          }
          // gelu' by central difference of the double gelu (independent of the analytic form)
          const double e = 1e-6;
          const double da = dg * (Gelu(a[f] + e) - Gelu(a[f] - e)) / (2 * e);
          g[b + ".b1"][f] += da;
          for (int64_t j = 0; j < H; ++j) {
            g[b + ".w1"][f * H + j] += da * u[n * H + j];
            du2[n * H + j] += da * w1[f * H + j];
          }
        }
      }
      rms_back(u, r, du2, &dh);
    }
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = n % T;
      for (int64_t j = 0; j < H; ++j) {
        g["embed.tok"][x[n] * H + j] += dh[n * H + j];
        if (t >= 1) g["embed.prev1"][x[n - 1] * H + j] += dh[n * H + j];
        if (t >= 2) g["embed.prev2"][x[n - 2] * H + j] += dh[n * H + j];
      }
    }
    return loss;
  }
};

float Round(float v, DType t) {
  if (t == DType::kBf16) return Bf16BitsToFloat(FloatToBf16Bits(v));
  if (t == DType::kFp16) return HalfBitsToFloat(FloatToHalfBits(v));
  return v;
}
float LoadAs(const std::vector<uint8_t>& buf, DType t, size_t i) {
  if (t == DType::kFp32) {
    float f;
    std::memcpy(&f, buf.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, buf.data() + 2 * i, 2);
  return t == DType::kBf16 ? Bf16BitsToFloat(h) : HalfBitsToFloat(h);
}

class BackendVsReference : public ::testing::TestWithParam<DType> {};

TEST_P(BackendVsReference, LossAndEveryGradientMatch) {
  const DType dt = GetParam();
  uint64_t seed = 0;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  ModelShape s;
  s.layers = 2;
  s.hidden = 9;  // odd sizes: no multiple of a vector width anywhere
  s.seq_len = 5;
  s.batch = 3;
  s.vocab = 256;
  const int64_t N = s.tokens();
  std::vector<int32_t> x(N), y(N);
  for (int64_t i = 0; i < N; ++i)
    x[i] = static_cast<int32_t>(rng() % 256), y[i] = static_cast<int32_t>(rng() % 256);

  RefModel ref{s, {}, {}};
  std::vector<std::vector<uint8_t>> pbuf, gbuf;
  std::vector<ParamInfo> list = ParameterList(s);
  const size_t es = dt == DType::kFp32 ? 4 : 2;
  for (const ParamInfo& pi : list) {
    std::vector<float> v = testing::RandomFloats(rng, static_cast<size_t>(pi.numel), -0.6f, 0.6f);
    std::vector<uint8_t> buf(v.size() * es);
    std::vector<double>& rv = ref.p[pi.name];
    for (size_t i = 0; i < v.size(); ++i) {
      const float f = Round(v[i], dt);
      rv.push_back(f);
      if (dt == DType::kFp32)
        std::memcpy(buf.data() + 4 * i, &f, 4);
      else {
        const uint16_t h = dt == DType::kBf16 ? FloatToBf16Bits(f) : FloatToHalfBits(f);
        std::memcpy(buf.data() + 2 * i, &h, 2);
      }
    }
    pbuf.push_back(std::move(buf));
    gbuf.emplace_back(static_cast<size_t>(pi.numel) * es, 0xAB);  // garbage: must be overwritten
  }
  const double scale = dt == DType::kFp16 ? 64.0 : 1.0;
  const double want_loss = ref.Run(x, y, scale);

  std::vector<std::unique_ptr<std::vector<float>>> host_ws;
  auto alloc = [&](int64_t bytes) -> StatusOr<void*> {
    host_ws.push_back(std::make_unique<std::vector<float>>(static_cast<size_t>(bytes / 4 + 1)));
    return static_cast<void*>(host_ws.back()->data());
  };
  std::unique_ptr<Backend> be = NewHostBackend(s, dt, alloc);
  ASSERT_TRUE(be->Prepare().ok());
  ASSERT_TRUE(be->SetBatch(x, y).ok());
  auto ptrs = [&](auto& bufs, size_t from, size_t n) {
    std::vector<void*> v;
    for (size_t i = from; i < from + n; ++i) v.push_back(bufs[i].data());
    return v;
  };
  const int64_t H = s.hidden, L = s.layers;
  std::vector<std::vector<float>> hs(static_cast<size_t>(L + 1), std::vector<float>(N * H));
  std::vector<float> dh(N * H);
  ASSERT_TRUE(be->EmbedForward(ptrs(pbuf, 0, 3), hs[0].data()).ok());
  for (int64_t l = 1; l <= L; ++l)
    ASSERT_TRUE(
        be->BlockForward(ptrs(pbuf, 3 + 4 * (l - 1), 4), hs[l - 1].data(), hs[l].data()).ok());
  const size_t head = 3 + 4 * static_cast<size_t>(L);
  StatusOr<double> loss = be->HeadForward(ptrs(pbuf, head, 2), hs[L].data(), scale);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, want_loss, 1e-4 * want_loss);
  ASSERT_TRUE(
      be->HeadBackward(ptrs(pbuf, head, 2), ptrs(gbuf, head, 2), hs[L].data(), dh.data()).ok());
  for (int64_t l = L; l >= 1; --l)
    ASSERT_TRUE(be->BlockBackward(ptrs(pbuf, 3 + 4 * (l - 1), 4), ptrs(gbuf, 3 + 4 * (l - 1), 4),
                                  hs[l - 1].data(), dh.data())
                    .ok());
  ASSERT_TRUE(be->EmbedBackward(ptrs(gbuf, 0, 3), dh.data()).ok());

  // Gradients are stored in the parameter dtype: allow its rounding plus fp32 noise.
  const double rel = dt == DType::kFp32 ? 1e-4 : dt == DType::kFp16 ? 2e-3 : 1e-2;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::vector<double>& want = ref.g[list[k].name];
    double scale_g = 0;
    for (double v : want) scale_g = std::max(scale_g, std::abs(v));
    ASSERT_GT(scale_g, 0) << list[k].name;
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(LoadAs(gbuf[k], dt, i), want[i], rel * std::abs(want[i]) + 1e-3 * scale_g)
          << list[k].name << "[" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(EveryDType, BackendVsReference,
                         ::testing::Values(DType::kFp32, DType::kBf16, DType::kFp16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// OpenBLAS's generic fallback on a CPU it does not know is replaced by the
// kernels the CPU's instructions allow; any kernels it recognized are kept.
TEST(HostBlas, KernelsForACpuOpenBlasDoesNotKnow) {
  EXPECT_EQ(BlasKernelsFor("Prescott", true, true), "SkylakeX");
  EXPECT_EQ(BlasKernelsFor("Prescott", false, true), "Haswell");
  EXPECT_EQ(BlasKernelsFor("Prescott", false, false), "");
  EXPECT_EQ(BlasKernelsFor("SkylakeX", true, true), "");
  EXPECT_EQ(BlasKernelsFor("Haswell", true, true), "");
  EXPECT_EQ(BlasKernelsFor("Zen", false, true), "");
  EXPECT_EQ(BlasKernelsFor("", true, true), "");
  // This process: OpenBLAS either recognized the CPU or is told to use
  // what the CPU allows.
  std::string why;
  const std::string here = BetterBlasKernelsHere(&why);
  if (!here.empty()) {
    EXPECT_THAT(why, ::testing::HasSubstr("OPENBLAS_CORETYPE=" + here));
  }
}

// The example's own bf16/fp16 conversions (ops.h; it uses the public API
// only) round exactly as the engine's (src/common/half.h): every 16-bit
// pattern to fp32, and fp32 to 16 bits over a stride through all 2^32
// patterns (every exponent, NaNs and infinities) and random ones.
TEST(Ops, HalfAndBf16ConversionsAreTheEnginesBitForBit) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    ASSERT_EQ(std::bit_cast<uint32_t>(ops::Bf16ToFloat(b)),
              std::bit_cast<uint32_t>(Bf16BitsToFloat(b)))
        << h;
    ASSERT_EQ(std::bit_cast<uint32_t>(ops::HalfToFloat(b)),
              std::bit_cast<uint32_t>(HalfBitsToFloat(b)))
        << h;
  }
  std::mt19937 rng(11);
  auto check = [](uint32_t u) {
    const float f = std::bit_cast<float>(u);
    ASSERT_EQ(ops::FloatToBf16(f), FloatToBf16Bits(f)) << std::hex << u;
    ASSERT_EQ(ops::FloatToHalf(f), FloatToHalfBits(f)) << std::hex << u;
  };
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) check(static_cast<uint32_t>(u));
  for (int i = 0; i < 1'000'000; ++i) check(static_cast<uint32_t>(rng()));
  for (uint32_t u : {0u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x477ff000u,
                     0x477fefffu, 0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x32ffffffu})
    check(u);
}

TEST(TextData, DeterministicAndShifted) {
  TextData a(7, 4096), b(7, 4096), c(8, 4096);
  EXPECT_EQ(a.text(), b.text());
  EXPECT_NE(a.text(), c.text());
  std::vector<int32_t> x1, y1, x2, y2;
  a.Batch(3, 4, 16, &x1, &y1);
  b.Batch(3, 4, 16, &x2, &y2);
  EXPECT_EQ(x1, x2);
  EXPECT_EQ(y1, y2);
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t + 1 < 16; ++t) EXPECT_EQ(y1[i * 16 + t], x1[i * 16 + t + 1]);
  a.Batch(4, 4, 16, &x2, &y2);
  EXPECT_NE(x1, x2);
}

// ---- training through the engine on the host device ------------------------------------
Config TinyConfig(OffloadDevice opt, OffloadDevice par, const std::string& dir) {
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = opt;
  c.zero_optimization.offload_param.device = par;
  if (opt == OffloadDevice::kNvme)
    c.zero_optimization.offload_optimizer.nvme_path = {dir + "/nvme"};
  if (par == OffloadDevice::kNvme) c.zero_optimization.offload_param.nvme_path = {dir + "/nvme"};
  c.zero_optimization.sub_group_size = 20000;
  c.zero_optimization.stage3_max_live_parameters = 30000;
  c.zero_optimization.stage3_param_persistence_threshold = 1000;
  // One gradient chunk per module and a parameter buffer per module (the
  // regression tests below cover the small-buffer defaults).
  c.zero_optimization.reduce_bucket_size = 1 << 20;
  c.zero_optimization.offload_param.buffer_count = 8;
  c.optimizer.lr = 3e-3;
  c.gradient_clipping = 1.0;
  c.bf16_enabled = true;
  c.train_micro_batch_size_per_gpu = 4;
  c.gradient_accumulation_steps = 2;
  c.train_batch_size = 8;
  c.strata.device = DeviceKind::kHost;
  c.strata.hbm_budget_bytes = 4 << 20;
  c.strata.threads = 2;
  SetModelConfig(ModelConfig{.layers = 2, .hidden = 32, .seq_len = 32}, &c);
  return c;
}

TEST(Train, LossDecreasesOnTinyDemo) {
  testing::ScratchDir dir;
  Config c = TinyConfig(OffloadDevice::kNvme, OffloadDevice::kNvme, dir.str());
  StatusOr<TrainResult> r = Train(c, 25);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->losses.size(), 25u);
  EXPECT_NEAR(r->losses.front(), std::log(256.0), 0.5);  // starts near uniform
  double tail = 0;
  for (size_t i = 20; i < 25; ++i) tail += r->losses[i] / 5;
  EXPECT_LT(tail, r->losses.front() - 1.0);
  EXPECT_GT(r->nvme_read_bytes, 0);
  EXPECT_GT(r->nvme_written_bytes, 0);
  EXPECT_LE(r->hbm_high_water_bytes, c.strata.hbm_budget_bytes);
}

std::vector<double> TrainLosses(OffloadDevice opt, OffloadDevice par, const std::string& dir,
                                TrainResult* out) {
  StatusOr<TrainResult> r = Train(TinyConfig(opt, par, dir), 4);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  *out = *r;
  return r->losses;
}

// Offload none / cpu / nvme for the optimizer states, with the parameters in
// HBM, DRAM or NVMe alongside them.
TEST(Train, SameSeedSameLossesBitwiseAcrossPlacements) {
  testing::ScratchDir dir;
  using D = OffloadDevice;
  TrainResult ref;
  const std::vector<double> want = TrainLosses(D::kNone, D::kNone, dir.str(), &ref);
  ASSERT_EQ(want.size(), 4u);
  ASSERT_NE(want.front(), want.back());  // training changed something
  EXPECT_EQ(ref.nvme_read_bytes, 0);
  const std::pair<D, D> placements[] = {
      {D::kCpu, D::kCpu}, {D::kNvme, D::kNvme}, {D::kNone, D::kCpu}, {D::kNvme, D::kCpu}};
  for (auto [opt, par] : placements) {
    SCOPED_TRACE(std::string(OffloadDeviceName(opt)) + "/" + std::string(OffloadDeviceName(par)));
    TrainResult r;
    const std::vector<double> got = TrainLosses(opt, par, dir.str(), &r);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(double)), 0);
    const bool nvme = opt == D::kNvme || par == D::kNvme;
    EXPECT_EQ(r.nvme_read_bytes > 0, nvme);
    EXPECT_EQ(r.nvme_written_bytes > 0, nvme);
  }
}

// Regression test for an engine bug this model found: with offload_param nvme
// and offload_optimizer none or cpu, fetching a module failed with "pinned
// pool: no free buffer" (one pinned pool shared by every purpose).
TEST(Train, ParamsOnNvmeWithOptimizerStatesInDram) {
  testing::ScratchDir dir;
  using D = OffloadDevice;
  TrainResult ref, r;
  // The defaults that trip it: 5 parameter buffers, small gradient chunks.
  auto config = [&](D opt) {
    Config c = TinyConfig(opt, D::kNvme, dir.str());
    c.zero_optimization.offload_param.buffer_count = 5;
    c.zero_optimization.reduce_bucket_size = 4000;
    return c;
  };
  const std::vector<double> want = TrainLosses(D::kNone, D::kNone, dir.str(), &ref);
  for (D opt : {D::kNone, D::kCpu}) {
    StatusOr<TrainResult> got_r = Train(config(opt), 4);
    ASSERT_TRUE(got_r.ok()) << got_r.status();
    const std::vector<double>& got = got_r->losses;
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(double)), 0);
  }
}

TEST(Train, Fp16UsesTheLossScale) {
  testing::ScratchDir dir;
  Config c = TinyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.bf16_enabled = false;
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 12;
  StatusOr<TrainResult> r = Train(c, 12);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dtype, "fp16");
  EXPECT_LT(r->losses.back(), r->losses.front() - 0.3);
  EXPECT_GT(r->steps.back().loss_scale, 1.0);
}

TEST(Train, ActivationsThatDoNotFitFailBeforeTraining) {
  testing::ScratchDir dir;
  Config c = TinyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  // Activations far beyond 4 MiB.
  SetModelConfig(ModelConfig{.layers = 2, .hidden = 32, .seq_len = 2048}, &c);
  int calls = 0;
  StatusOr<TrainResult> r =
      Train(c, 3, [&](int64_t, int64_t, double, const StepStats&, const TrainResult&) { ++calls; });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("activations"));
  EXPECT_EQ(calls, 0);
}

TEST(Train, UnusableNvmePathFailsBeforeTraining) {
  Config c = TinyConfig(OffloadDevice::kNvme, OffloadDevice::kCpu, "/proc/strata-no-such");
  StatusOr<TrainResult> r = Train(c, 3);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("/proc/strata-no-such/nvme"));
}

}  // namespace
}  // namespace strata::example

namespace strata::example {
namespace {

using cli::Train;
using cli::TrainResult;

// Regression test for an engine bug the demo found: with the optimizer states
// on NVMe at demo size (5.1M parameters, sub_group_size 1e6, buffer_count 4)
// the losses drifted by ~1e-3 from step 4 on (unaligned shard tails went
// through the page cache and raced O_DIRECT writes). Takes ~10 s.
TEST(Train, NvmeOptimizerStatesAreBitwiseAtDemoSize) {
  testing::ScratchDir dir;
  auto config = [&](OffloadDevice opt) {
    Config c = TinyConfig(opt, OffloadDevice::kCpu, dir.str());
    SetModelConfig(ModelConfig{.layers = 4, .hidden = 384, .seq_len = 64}, &c);
    c.zero_optimization.sub_group_size = 1'000'000;
    c.zero_optimization.stage3_max_live_parameters = 2'000'000;
    c.zero_optimization.reduce_bucket_size = 2'000'000;
    c.strata.hbm_budget_bytes = 26 << 20;  // slots for 2 blocks + 2 gradients, and the activations
    return c;
  };
  StatusOr<TrainResult> want = Train(config(OffloadDevice::kCpu), 5);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int rep = 0; rep < 2; ++rep) {
    StatusOr<TrainResult> got = Train(config(OffloadDevice::kNvme), 5);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < want->losses.size(); ++i)
      EXPECT_EQ(got->losses[i], want->losses[i]) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace strata::example

#include "strata/build_config.h"

namespace strata::example {
namespace {

// Without CUDA in the build the GPU backend says so; with CUDA but no usable
// device (this CI), setting it up fails with a Status naming the call, never a
// crash.
TEST(CudaBackend, FailsCleanlyWithoutAGpu) {
  ModelShape s;
  s.layers = 1;
  s.hidden = 16;
  s.seq_len = 4;
  std::vector<std::vector<float>> mem;
  auto alloc = [&](int64_t bytes) -> StatusOr<void*> {
    mem.emplace_back(static_cast<size_t>(bytes / 4 + 1));
    return static_cast<void*>(mem.back().data());
  };
  StatusOr<std::unique_ptr<Backend>> be = NewCudaBackend(s, DType::kBf16, nullptr, alloc);
  if (!STRATA_HAVE_CUDA) {
    ASSERT_FALSE(be.ok());
    EXPECT_EQ(be.status().code(), StatusCode::kNotSupported);
    return;
  }
  if (!be.ok()) {
    // Creation loads the backend's kernels (before any launch: lazy loading
    // may synchronize the context); without a GPU that is where it stops.
    EXPECT_THAT(std::string(be.status().message()),
                ::testing::HasSubstr("loading the example's CUDA kernels"));
    return;
  }
  Status st = (*be)->Prepare();
  if (st.ok())
    GTEST_SKIP() << "a GPU is present: the CUDA backend set up (not exercised further here)";
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("cublas"));
}

}  // namespace
}  // namespace strata::example
