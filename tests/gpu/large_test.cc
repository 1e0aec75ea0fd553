// Device kernels past 2^31 elements (64-bit indexing) with every array at
// its own unaligned offset, on CUDA only: the arrays take 13-32 GB, so each
// case first asks the GPU for its free memory and skips, saying how much it
// needs, where it does not fit (an 80 GB H100 runs them all). Without a GPU
// they skip with the reason.
//
// Checking 2^31 random elements on the CPU would take minutes; instead the
// arrays hold constants (Device::Fill) except three windows of fresh random
// data — the start, around element 2^31 and the end — and the results are
// compared there against the CPU (Adam: the CPU optimizer's scalar kernel,
// within 2 ulp as in adam_test.cc; the others exactly), plus elements of the
// constant regions against the constant's result.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"
#include "tests/gpu/device_test_util.h"
#include "tests/test_util.h"

namespace strata::gpu::testing {
namespace {

constexpr size_t kTwo31 = size_t{1} << 31;
constexpr size_t kN = kTwo31 + (1 << 20) + 4099;  // past 2^31, not a multiple of 8
constexpr size_t kWin = 1 << 16;                  // elements per random window

// The windows' first elements: the start, across 2^31, the end.
std::vector<size_t> Windows() { return {0, kTwo31 - kWin / 2, kN - kWin}; }

// A CUDA device with an arena of `need` bytes, or null with *why_not set.
std::unique_ptr<Device> BigCudaDevice(size_t need, std::string* why_not) {
  const CudaDeviceList list = ListCudaDevices();
  if (list.devices.empty()) {
    *why_not = "no CUDA device: " + list.reason;
    return nullptr;
  }
  const size_t budget = (need + (size_t{64} << 20)) / (size_t{2} << 20) * (size_t{2} << 20);
  if (list.devices[0].free_bytes < budget + (size_t{1} << 30)) {
    *why_not = "needs " + std::to_string(budget >> 20) +
               " MiB of GPU memory (+1 GiB headroom), cuda:0 has " +
               std::to_string(list.devices[0].free_bytes >> 20) + " MiB free";
    return nullptr;
  }
  auto d = CudaBackend::Make(budget);
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) *why_not = d.status().ToString();
  return d.ok() ? std::move(d).value() : nullptr;
}

void Put(Device& d, void* dev, const void* host, size_t bytes) {
  ASSERT_OK(d.CopyH2D(dev, host, bytes, d.h2d()));
  ASSERT_OK(d.h2d().Synchronize());  // a pageable H2D is only staged on return
}
template <typename T>
std::vector<T> Get(Device& d, const void* dev, size_t n) {
  std::vector<T> v(n);
  EXPECT_OK(d.CopyD2H(v.data(), dev, n * sizeof(T), d.d2h()));
  return v;
}

int64_t UlpDistance(float a, float b) {
  auto key = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};
  };
  return std::llabs(key(a) - key(b));
}

// AdamStep over one shard of kN elements, twice: every array at a different
// unaligned offset (the scalar path), then all 16-byte aligned (the vector
// path); windows against the CPU optimizer, and the path counts.
TEST(LargeTensorTest, AdamStepPastTwoToThe31Elements) {
  Watchdog watchdog(300);
  // param, m, v fp32 + a bf16 grad + a bf16 copy, each with 8 spare elements.
  const size_t need = (kN + 8) * (3 * 4 + 2 + 2) + 5 * 256;
  std::string why_not;
  std::unique_ptr<Device> dev = BigCudaDevice(need, &why_not);
  if (dev == nullptr) GTEST_SKIP() << why_not;
  Device& d = *dev;
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto p = d.Allocate((kN + 8) * 4).value(), m = d.Allocate((kN + 8) * 4).value(),
       v = d.Allocate((kN + 8) * 4).value(), g = d.Allocate((kN + 8) * 2).value(),
       c = d.Allocate((kN + 8) * 2).value();
  auto opt = cpu_adam::CpuOptimizer::Create({.threads = 1, .isa = "scalar"}).value();
  struct Offsets {
    size_t p, m, v, g, c;
    bool vector;
  };
  for (const Offsets o : {Offsets{1, 2, 3, 5, 7, false}, Offsets{0, 4, 0, 8, 0, true}}) {
    SCOPED_TRACE(o.vector ? "aligned: vector path" : "unaligned: scalar path");
    float* dp = p.as<float>() + o.p;
    float* dm = m.as<float>() + o.m;
    float* dv = v.as<float>() + o.v;
    uint16_t* dg = g.as<uint16_t>() + o.g;
    uint16_t* dc = c.as<uint16_t>() + o.c;
    ASSERT_OK(d.Fill(dp, DType::kFp32, kN, 0.25f, d.compute()));
    ASSERT_OK(d.Fill(dm, DType::kFp32, kN, 0.001f, d.compute()));
    ASSERT_OK(d.Fill(dv, DType::kFp32, kN, 1e-5f, d.compute()));
    ASSERT_OK(d.Fill(dg, DType::kBf16, kN, -0.5f, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    struct Win {
      std::vector<float> p, m, v;
      std::vector<uint16_t> g, copy;
    };
    std::vector<Win> wins;
    for (size_t k = 0; k < Windows().size(); ++k) {
      Win w;
      w.p = strata::testing::RandomFloats(rng, kWin, -1.f, 1.f);
      w.m = strata::testing::RandomFloats(rng, kWin, -0.01f, 0.01f);
      w.v = strata::testing::RandomFloats(rng, kWin, 1e-6f, 1e-4f);
      w.g.resize(kWin);
      w.copy.assign(kWin, 0);
      wins.push_back(std::move(w));
    }
    for (size_t k = 0; k < wins.size(); ++k) {
      const auto gf = strata::testing::RandomFloats(rng, kWin, -3.f, 3.f);
      for (size_t i = 0; i < kWin; ++i)
        host::StoreFromFloat(wins[k].g.data(), DType::kBf16, i, gf[i]);
      const size_t at = Windows()[k];
      Put(d, dp + at, wins[k].p.data(), kWin * 4);
      Put(d, dm + at, wins[k].m.data(), kWin * 4);
      Put(d, dv + at, wins[k].v.data(), kWin * 4);
      Put(d, dg + at, wins[k].g.data(), kWin * 2);
    }
    AdamHyperParams hp;
    hp.decoupled_weight_decay = true;
    hp.lr = 3e-3;
    hp.weight_decay = 0.05;
    hp.step = 4;
    hp.grad_scale = 0.5;
    AdamShard sh{dp, dg, DType::kBf16, dm, dv, dc, DType::kBf16, kN};
    const AdamPathCounts before = d.adam_path_counts();
    ASSERT_OK(d.AdamStep({&sh, 1}, hp, nullptr, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    const AdamPathCounts after = d.adam_path_counts();
    EXPECT_EQ(after.vector_shards - before.vector_shards, o.vector ? 1u : 0u);
    EXPECT_EQ(after.scalar_shards - before.scalar_shards, o.vector ? 0u : 1u);

    cpu_adam::HyperParams chp;
    chp.algorithm = cpu_adam::Algorithm::kAdamW;
    chp.lr = hp.lr;
    chp.beta1 = hp.beta1;
    chp.beta2 = hp.beta2;
    chp.eps = hp.eps;
    chp.weight_decay = hp.weight_decay;
    chp.step = hp.step;
    chp.grad_scale = hp.grad_scale;
    // The constant region's element, once on the CPU.
    float cp = 0.25f, cm = 0.001f, cv = 1e-5f;
    uint16_t cg;
    const float half = -0.5f;
    host::StoreFromFloat(&cg, DType::kBf16, 0, half);
    uint16_t ccopy = 0;
    ASSERT_TRUE(opt->Step({&cp, &cg, DType::kBf16, &cm, &cv, 1, &ccopy, DType::kBf16, chp}).ok());
    for (size_t k = 0; k < wins.size(); ++k) {
      Win& w = wins[k];
      const size_t at = Windows()[k];
      SCOPED_TRACE(::testing::Message() << "window at " << at);
      ASSERT_TRUE(opt->Step({w.p.data(), w.g.data(), DType::kBf16, w.m.data(), w.v.data(), kWin,
                             w.copy.data(), DType::kBf16, chp})
                      .ok());
      const auto gp = Get<float>(d, dp + at, kWin), gm = Get<float>(d, dm + at, kWin),
                 gv = Get<float>(d, dv + at, kWin);
      const auto gc = Get<uint16_t>(d, dc + at, kWin);
      int bad = 0;
      for (size_t i = 0; i < kWin && bad < 5; ++i) {
        if (UlpDistance(gp[i], w.p[i]) > 2 || UlpDistance(gm[i], w.m[i]) > 2 ||
            UlpDistance(gv[i], w.v[i]) > 2) {
          ++bad;
          ADD_FAILURE() << "element " << at + i << ": param " << gp[i] << " vs " << w.p[i] << ", m "
                        << gm[i] << " vs " << w.m[i] << ", v " << gv[i] << " vs " << w.v[i];
        }
        uint16_t want;
        host::StoreFromFloat(&want, DType::kBf16, 0, gp[i]);
        if (gc[i] != want && bad++ < 5) ADD_FAILURE() << "copy " << at + i;
      }
      // Constant-region neighbours: just before and after the window.
      for (size_t i : {at == 0 ? at + kWin : at - 1, at + kWin < kN ? at + kWin : at - 1}) {
        const auto x = Get<float>(d, dp + i, 1);
        EXPECT_LE(UlpDistance(x[0], cp), 2) << "constant element " << i;
      }
    }
  }
}

// Fill, Cast, AddToFp32, SumSquares and UnscaleAndCheck over kN elements at
// unaligned offsets: a bf16 x (offset 3) and an fp32 accumulator (offset 1).
TEST(LargeTensorTest, KernelsPastTwoToThe31Elements) {
  Watchdog watchdog(300);
  const size_t need = (kN + 8) * (2 + 4) + 3 * 256;
  std::string why_not;
  std::unique_ptr<Device> dev = BigCudaDevice(need, &why_not);
  if (dev == nullptr) GTEST_SKIP() << why_not;
  Device& d = *dev;
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto xb = d.Allocate((kN + 8) * 2).value(), ab = d.Allocate((kN + 8) * 4).value(),
       flags = d.Allocate(16).value();
  uint16_t* x = xb.as<uint16_t>() + 3;
  float* acc = ab.as<float>() + 1;
  int32_t* found = flags.as<int32_t>();
  double* sum = reinterpret_cast<double*>(flags.as<char>() + 8);
  ASSERT_OK(d.Fill(x, DType::kBf16, kN, 1.5f, d.compute()));
  ASSERT_OK(d.Fill(acc, DType::kFp32, kN, 0.25f, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  std::vector<std::vector<uint16_t>> wx;
  double window_sq = 0;
  for (size_t at : Windows()) {
    const auto f = strata::testing::RandomFloats(rng, kWin, -4.f, 4.f);
    std::vector<uint16_t> b(kWin);
    for (size_t i = 0; i < kWin; ++i) {
      host::StoreFromFloat(b.data(), DType::kBf16, i, f[i]);
      const double r = host::LoadAsFloat(b.data(), DType::kBf16, i);
      window_sq += r * r;
    }
    Put(d, x + at, b.data(), kWin * 2);
    wx.push_back(std::move(b));
  }
  // SumSquares: the constants' part and the windows', in double.
  ASSERT_OK(d.FillDouble(sum, 1, 0.0, d.compute()));
  ASSERT_OK(d.SumSquares(x, DType::kBf16, kN, sum, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  const double want_sum = 2.25 * static_cast<double>(kN - Windows().size() * kWin) + window_sq;
  EXPECT_NEAR(Get<double>(d, sum, 1)[0], want_sum, want_sum * 1e-9);
  // acc += x: exact in fp32 for these values.
  ASSERT_OK(d.AddToFp32(acc, x, DType::kBf16, kN, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  for (size_t k = 0; k < Windows().size(); ++k) {
    const size_t at = Windows()[k];
    const auto got = Get<float>(d, acc + at, kWin);
    for (size_t i = 0; i < kWin; ++i)
      ASSERT_EQ(got[i], 0.25f + host::LoadAsFloat(wx[k].data(), DType::kBf16, i))
          << "acc " << at + i;
  }
  EXPECT_EQ(Get<float>(d, acc + kTwo31 + kWin, 1)[0], 1.75f);
  EXPECT_EQ(Get<float>(d, acc + kN - kWin - 1, 1)[0], 1.75f);
  // Cast bf16 → fp32 over all of it (overwrites acc).
  ASSERT_OK(d.Cast(x, DType::kBf16, acc, DType::kFp32, kN, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  const size_t mid = Windows()[1];
  const auto cast = Get<float>(d, acc + mid, kWin);
  for (size_t i = 0; i < kWin; ++i)
    ASSERT_EQ(cast[i], host::LoadAsFloat(wx[1].data(), DType::kBf16, i)) << "cast " << mid + i;
  // UnscaleAndCheck: an inf past 2^31 is found; the values are halved.
  const float inf = std::numeric_limits<float>::infinity();
  Put(d, acc + kTwo31 + 7, &inf, 4);
  ASSERT_OK(d.FillInt32(found, 1, 0, d.compute()));
  ASSERT_OK(d.UnscaleAndCheck(acc, DType::kFp32, kN, 0.5f, found, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_NE(Get<int32_t>(d, found, 1)[0], 0);
  EXPECT_EQ(Get<float>(d, acc + kN - 1, 1)[0],
            0.5f * host::LoadAsFloat(wx[2].data(), DType::kBf16, kWin - 1));
}

}  // namespace
}  // namespace strata::gpu::testing
