// Device::AdamStep against the CPU optimizer (src/cpu_adam, scalar ISA) on
// fresh random data: every grad dtype and copy-out dtype, Adam and AdamW,
// odd sizes, tails, unaligned starts, more tensors than one CUDA launch
// takes, 10 steps; fp32 state within 2 ulp per element. The host backend
// runs everywhere; the CUDA cases skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "src/common/half.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"
#include "tests/gpu/device_test_util.h"
#include "tests/test_util.h"

namespace strata::gpu::testing {
namespace {

template <typename B>
using AdamStepTest = DeviceTest<B>;
TYPED_TEST_SUITE(AdamStepTest, Backends);

// Distance in units in the last place between two finite floats.
int64_t UlpDistance(float a, float b) {
  auto key = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};  // monotonic in f
  };
  return std::llabs(key(a) - key(b));
}

std::vector<uint8_t> ToDType(const std::vector<float>& f, DType t) {
  std::vector<uint8_t> out(f.size() * DTypeSize(t));
  for (size_t i = 0; i < f.size(); ++i) host::StoreFromFloat(out.data(), t, i, f[i]);
  return out;
}

struct Case {
  size_t count;
  size_t offset;  // elements past a 256-byte boundary (unaligned starts)
  DType grad;
  bool copy;
  DType copy_dtype;
};

// The CPU side of one tensor and where it lives on the device.
struct Tensor {
  Case c;
  std::vector<float> p, m, v;
  std::vector<uint8_t> g, copy;
  DeviceBuffer dp, dm, dv, dg, dc;
};

// A pageable H2D returns once the source is staged, not once the device
// holds it (device.h, Memory): wait for the h2d stream before work on
// another stream reads the data.
void Put(Device& d, void* dev, const void* host, size_t bytes) {
  ASSERT_OK(d.CopyH2D(dev, host, bytes, d.h2d()));
  ASSERT_OK(d.h2d().Synchronize());
}
template <typename T>
std::vector<T> Get(Device& d, const void* dev, size_t n) {
  std::vector<T> v(n);
  EXPECT_OK(d.CopyD2H(v.data(), dev, n * sizeof(T), d.d2h()));
  return v;
}

cpu_adam::HyperParams CpuHp(const AdamHyperParams& h) {
  cpu_adam::HyperParams c;
  c.algorithm = h.decoupled_weight_decay ? cpu_adam::Algorithm::kAdamW : cpu_adam::Algorithm::kAdam;
  c.lr = h.lr;
  c.beta1 = h.beta1;
  c.beta2 = h.beta2;
  c.eps = h.eps;
  c.weight_decay = h.weight_decay;
  c.bias_correction = h.bias_correction;
  c.step = h.step;
  c.grad_scale = h.grad_scale;
  return c;
}

void RunAndCompare(Device& d, std::vector<Case> cases, bool adamw) {
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " adamw " << adamw);
  auto opt = cpu_adam::CpuOptimizer::Create({.threads = 1, .isa = "scalar"}).value();
  std::vector<Tensor> ts(cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    Tensor& t = ts[k];
    t.c = cases[k];
    const size_t n = t.c.count, off = t.c.offset;
    t.p = strata::testing::RandomFloats(rng, n, -1.f, 1.f);
    t.m = strata::testing::RandomFloats(rng, n, -0.01f, 0.01f);
    t.v = strata::testing::RandomFloats(rng, n, 1e-6f, 1e-4f);
    auto alloc = [&](size_t elem) { return d.Allocate((n + off) * elem + 64).value(); };
    t.dp = alloc(4), t.dm = alloc(4), t.dv = alloc(4), t.dg = alloc(4);
    Put(d, t.dp.as<float>() + off, t.p.data(), n * 4);
    Put(d, t.dm.as<float>() + off, t.m.data(), n * 4);
    Put(d, t.dv.as<float>() + off, t.v.data(), n * 4);
    if (t.c.copy) {
      t.dc = alloc(4);
      t.copy.assign(n * DTypeSize(t.c.copy_dtype), 0);
    }
  }
  AdamHyperParams hp;
  hp.decoupled_weight_decay = adamw;
  hp.lr = 3e-3;
  hp.weight_decay = 0.05;
  for (int step = 1; step <= 10; ++step) {
    hp.step = step;
    hp.grad_scale = 0.7 / 1024;  // unscale × a clip coefficient
    std::vector<AdamShard> shards;
    std::vector<cpu_adam::ShardStep> cpu;
    for (Tensor& t : ts) {
      const size_t n = t.c.count, off = t.c.offset, gs = DTypeSize(t.c.grad);
      t.g = ToDType(strata::testing::RandomFloats(rng, n, -2000.f, 2000.f), t.c.grad);
      Put(d, t.dg.as<char>() + off * gs, t.g.data(), n * gs);
      AdamShard s;
      s.param = t.dp.as<float>() + off;
      s.grad = t.dg.as<char>() + off * gs;
      s.grad_dtype = t.c.grad;
      s.exp_avg = t.dm.as<float>() + off;
      s.exp_avg_sq = t.dv.as<float>() + off;
      if (t.c.copy) {
        s.copy_out = t.dc.as<char>() + off * DTypeSize(t.c.copy_dtype);
        s.copy_dtype = t.c.copy_dtype;
      }
      s.count = n;
      shards.push_back(s);
      cpu_adam::ShardStep c;
      c.param = t.p.data();
      c.grad = t.g.data();
      c.grad_dtype = t.c.grad;
      c.exp_avg = t.m.data();
      c.exp_avg_sq = t.v.data();
      c.count = n;
      c.copy_out = t.c.copy ? t.copy.data() : nullptr;
      c.copy_dtype = t.c.copy_dtype;
      c.hp = CpuHp(hp);
      cpu.push_back(c);
    }
    ASSERT_OK(d.AdamStep(shards, hp, nullptr, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    ASSERT_TRUE(opt->StepMany(cpu).ok());
  }
  for (Tensor& t : ts) {
    SCOPED_TRACE(::testing::Message() << "count " << t.c.count << " offset " << t.c.offset
                                      << " grad " << DTypeName(t.c.grad) << " copy "
                                      << (t.c.copy ? DTypeName(t.c.copy_dtype) : "none"));
    const size_t n = t.c.count, off = t.c.offset;
    const auto p = Get<float>(d, t.dp.as<float>() + off, n);
    const auto m = Get<float>(d, t.dm.as<float>() + off, n);
    const auto v = Get<float>(d, t.dv.as<float>() + off, n);
    int bad = 0;
    for (size_t i = 0; i < n && bad < 5; ++i) {
      for (auto [got, want, name] :
           {std::tuple{p[i], t.p[i], "param"}, std::tuple{m[i], t.m[i], "exp_avg"},
            std::tuple{v[i], t.v[i], "exp_avg_sq"}}) {
        if (!std::isfinite(got) || UlpDistance(got, want) > 2) {
          ++bad;
          ADD_FAILURE() << name << "[" << i << "] = " << got << ", CPU " << want;
        }
      }
    }
    if (t.c.copy) {
      const size_t cs = DTypeSize(t.c.copy_dtype);
      const auto copy = Get<uint8_t>(d, t.dc.as<char>() + off * cs, n * cs);
      for (size_t i = 0; i < n; ++i) {
        std::vector<uint8_t> want(4);
        host::StoreFromFloat(want.data(), t.c.copy_dtype, 0, p[i]);  // of the device's param
        ASSERT_EQ(0, std::memcmp(copy.data() + i * cs, want.data(), cs)) << "copy " << i;
      }
    }
  }
}

TYPED_TEST(AdamStepTest, MatchesTheCpuOptimizerForEveryDtype) {
  Device& d = this->dev();
  for (bool adamw : {true, false}) {
    std::vector<Case> cases;
    const size_t sizes[] = {1, 7, 8, 9, 4097, 65536 * 2 + 13};
    size_t k = 0;
    for (DType g : {DType::kFp32, DType::kFp16, DType::kBf16})
      for (int c = 0; c < 4; ++c)
        for (size_t off : {size_t{0}, size_t{3}}) {
          const DType cd = c == 1 ? DType::kFp32 : c == 2 ? DType::kFp16 : DType::kBf16;
          cases.push_back({sizes[k++ % 6], off, g, c != 0, cd});
        }
    RunAndCompare(d, cases, adamw);
  }
}

// More tensors than one CUDA launch's table holds (256), and tensors of
// mixed dtypes in one call (several groups).
TYPED_TEST(AdamStepTest, ManySmallTensorsInOneCall) {
  Device& d = this->dev();
  std::vector<Case> cases;
  for (size_t i = 0; i < 300; ++i)
    cases.push_back({1 + (i * 37) % 300, i % 5, i % 3 == 0 ? DType::kBf16 : DType::kFp32,
                     i % 2 == 0, DType::kBf16});
  RunAndCompare(d, cases, true);
}

TYPED_TEST(AdamStepTest, SkipFlagLeavesEverythingUntouched) {
  Device& d = this->dev();
  auto rng = strata::testing::MakeRng();
  const size_t n = 1000;
  auto buf = d.Allocate(4 * n * 4 + 256).value();
  float* p = buf.as<float>();
  const auto init = strata::testing::RandomFloats(rng, 4 * n, 0.001f, 1.f);
  Put(d, p, init.data(), init.size() * 4);
  auto flag = d.Allocate(4).value();
  AdamShard s{p, p + n, DType::kFp32, p + 2 * n, p + 3 * n, nullptr, DType::kBf16, n};
  ASSERT_OK(d.FillInt32(flag.as<int32_t>(), 1, 1, d.compute()));
  ASSERT_OK(d.AdamStep({&s, 1}, AdamHyperParams{}, flag.as<int32_t>(), d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_EQ(Get<float>(d, p, 4 * n), init);
  ASSERT_OK(d.FillInt32(flag.as<int32_t>(), 1, 0, d.compute()));
  ASSERT_OK(d.AdamStep({&s, 1}, AdamHyperParams{}, flag.as<int32_t>(), d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_NE(Get<float>(d, p, n), std::vector<float>(init.begin(), init.begin() + n));
}

TYPED_TEST(AdamStepTest, BadArgumentsAreRejectedBeforeAnythingRuns) {
  Device& d = this->dev();
  auto buf = d.Allocate(4096 * 4).value();
  float* p = buf.as<float>();
  std::vector<float> host(100);
  AdamShard ok{p, p + 100, DType::kFp32, p + 200, p + 300, nullptr, DType::kBf16, 100};
  AdamHyperParams hp;
  ASSERT_OK(d.AdamStep({&ok, 1}, hp, nullptr, d.compute()));
  AdamShard overlap = ok;
  overlap.exp_avg = p + 50;
  EXPECT_EQ(d.AdamStep({&overlap, 1}, hp, nullptr, d.compute()).code(),
            StatusCode::kInvalidArgument);
  AdamShard on_host = ok;
  on_host.grad = host.data();
  const Status s = d.AdamStep({&on_host, 1}, hp, nullptr, d.compute());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("shard 0 grad"), std::string::npos) << s;
  AdamShard misaligned = ok;
  misaligned.exp_avg_sq = reinterpret_cast<float*>(buf.as<char>() + 1202);
  EXPECT_EQ(d.AdamStep({&misaligned, 1}, hp, nullptr, d.compute()).code(),
            StatusCode::kInvalidArgument);
  hp.step = 0;
  EXPECT_EQ(d.AdamStep({&ok, 1}, hp, nullptr, d.compute()).code(), StatusCode::kInvalidArgument);
  ASSERT_OK(d.compute().Synchronize());
}

// The host reference is the CPU optimizer's scalar kernel, bitwise.
TEST(HostAdamTest, BitwiseEqualToTheCpuScalarKernel) {
  auto rng = strata::testing::MakeRng();
  auto opt = cpu_adam::CpuOptimizer::Create({.threads = 1, .isa = "scalar"}).value();
  for (bool adamw : {true, false})
    for (DType g : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      const size_t n = 5003;
      auto p = strata::testing::RandomFloats(rng, n);
      auto m = strata::testing::RandomFloats(rng, n, -0.1f, 0.1f);
      auto v = strata::testing::RandomFloats(rng, n, 1e-5f, 1e-2f);
      auto grad = ToDType(strata::testing::RandomFloats(rng, n, -50.f, 50.f), g);
      auto p2 = p, m2 = m, v2 = v;
      std::vector<uint16_t> c1(n), c2(n);
      AdamHyperParams hp;
      hp.decoupled_weight_decay = adamw;
      hp.weight_decay = 0.1;
      hp.step = 3;
      hp.grad_scale = 0.25;
      host::AdamStep({p.data(), grad.data(), g, m.data(), v.data(), c1.data(), DType::kFp16, n},
                     host::MakeAdamCoeffs(hp));
      cpu_adam::ShardStep s;
      s.param = p2.data();
      s.grad = grad.data();
      s.grad_dtype = g;
      s.exp_avg = m2.data();
      s.exp_avg_sq = v2.data();
      s.copy_out = c2.data();
      s.copy_dtype = DType::kFp16;
      s.count = n;
      s.hp = CpuHp(hp);
      ASSERT_TRUE(opt->Step(s).ok());
      EXPECT_EQ(0, std::memcmp(p.data(), p2.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(m.data(), m2.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(v.data(), v2.data(), n * 4));
      EXPECT_EQ(c1, c2);
    }
}

// bf16 moments (AdamShard::exp_avg_bf16): the host reference is the CPU
// optimizer's bf16 state format, bitwise (its scalar kernel, and the
// vector kernel the dispatcher picks: the same bits), over two steps so
// that the second reads what the first rounded.
TEST(HostAdamTest, Bf16MomentsAreTheCpuBf16Format) {
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (const char* isa : {"scalar", ""})
    for (bool adamw : {true, false})
      for (DType g : {DType::kFp32, DType::kBf16}) {
        SCOPED_TRACE(::testing::Message()
                     << "isa '" << isa << "' adamw " << adamw << " grad " << DTypeName(g));
        auto opt = cpu_adam::CpuOptimizer::Create({.threads = 1, .isa = isa}).value();
        const size_t n = 1037;  // a tail for every vector width
        auto p = strata::testing::RandomFloats(rng, n);
        std::vector<uint16_t> m(n), v(n);
        for (size_t i = 0; i < n; ++i) {
          host::StoreFromFloat(m.data(), DType::kBf16, i,
                               strata::testing::RandomFloats(rng, 1, -0.1f, 0.1f)[0]);
          host::StoreFromFloat(v.data(), DType::kBf16, i,
                               strata::testing::RandomFloats(rng, 1, 1e-5f, 1e-2f)[0]);
        }
        auto p2 = p;
        auto m2 = m, v2 = v;
        std::vector<uint16_t> c1(n), c2(n);
        for (int step = 1; step <= 2; ++step) {
          auto grad = ToDType(strata::testing::RandomFloats(rng, n, -50.f, 50.f), g);
          AdamHyperParams hp;
          hp.decoupled_weight_decay = adamw;
          hp.weight_decay = 0.1;
          hp.step = step;
          hp.grad_scale = 0.25;
          AdamShard a;
          a.param = p.data();
          a.grad = grad.data();
          a.grad_dtype = g;
          a.exp_avg_bf16 = m.data();
          a.exp_avg_sq_bf16 = v.data();
          a.copy_out = c1.data();
          a.copy_dtype = DType::kBf16;
          a.count = n;
          host::AdamStep(a, host::MakeAdamCoeffs(hp));
          cpu_adam::ShardStep s;
          s.states = cpu_adam::StateFormat::kBf16;
          s.param = p2.data();
          s.exp_avg_c = m2.data();
          s.exp_avg_sq_c = v2.data();
          s.grad = grad.data();
          s.grad_dtype = g;
          s.copy_out = c2.data();
          s.copy_dtype = DType::kBf16;
          s.count = n;
          s.hp = CpuHp(hp);
          ASSERT_TRUE(opt->Step(s).ok());
        }
        EXPECT_EQ(0, std::memcmp(p.data(), p2.data(), n * 4));
        EXPECT_EQ(m, m2);
        EXPECT_EQ(v, v2);
        EXPECT_EQ(c1, c2);
      }
}

// The device's bf16 moments (CUDA: the kernel's bf16 loads and stores, the
// vector path and the scalar tails) against the host reference, bitwise;
// and a shard mixing the two kinds of moments is refused.
TYPED_TEST(AdamStepTest, Bf16MomentsMatchTheHostReference) {
  Device& d = this->dev();
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (size_t off : {size_t{0}, size_t{3}}) {
    const size_t n = 65536 + 9;
    auto p = strata::testing::RandomFloats(rng, n);
    std::vector<uint16_t> m(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      host::StoreFromFloat(m.data(), DType::kBf16, i,
                           strata::testing::RandomFloats(rng, 1, -0.1f, 0.1f)[0]);
      host::StoreFromFloat(v.data(), DType::kBf16, i,
                           strata::testing::RandomFloats(rng, 1, 1e-5f, 1e-2f)[0]);
    }
    auto g = ToDType(strata::testing::RandomFloats(rng, n, -50.f, 50.f), DType::kBf16);
    DeviceBuffer dp = d.Allocate((n + off) * 4 + 64).value();
    DeviceBuffer dm = d.Allocate((n + off) * 2 + 64).value();
    DeviceBuffer dv = d.Allocate((n + off) * 2 + 64).value();
    DeviceBuffer dg = d.Allocate((n + off) * 2 + 64).value();
    Put(d, dp.as<float>() + off, p.data(), n * 4);
    Put(d, dm.as<uint16_t>() + off, m.data(), n * 2);
    Put(d, dv.as<uint16_t>() + off, v.data(), n * 2);
    Put(d, dg.as<uint16_t>() + off, g.data(), n * 2);
    AdamHyperParams hp;
    hp.step = 4;
    hp.weight_decay = 0.05;
    AdamShard s;
    s.param = dp.as<float>() + off;
    s.grad = dg.as<uint16_t>() + off;
    s.grad_dtype = DType::kBf16;
    s.exp_avg_bf16 = dm.as<uint16_t>() + off;
    s.exp_avg_sq_bf16 = dv.as<uint16_t>() + off;
    s.count = n;
    ASSERT_OK(d.AdamStep({&s, 1}, hp, nullptr, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    AdamShard r = s;
    r.param = p.data();
    r.grad = g.data();
    r.exp_avg_bf16 = m.data();
    r.exp_avg_sq_bf16 = v.data();
    host::AdamStep(r, host::MakeAdamCoeffs(hp));
    EXPECT_EQ(Get<float>(d, s.param, n), p);
    EXPECT_EQ(Get<uint16_t>(d, s.exp_avg_bf16, n), m);
    EXPECT_EQ(Get<uint16_t>(d, s.exp_avg_sq_bf16, n), v);
    ASSERT_OK(d.d2h().Synchronize());
    AdamShard mixed = s;
    mixed.exp_avg = dp.as<float>();
    const Status bad = d.AdamStep({&mixed, 1}, hp, nullptr, d.compute());
    EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(bad.message()).find("both bf16"), std::string::npos) << bad;
  }
}

// The compact formats' state of n elements (random, nonzero): a bf16 or fp32
// master, bf16 moments or int8 codes with one scale per 256 elements.
struct CompactState {
  std::vector<float> p;        // fp32 master (int8)
  std::vector<uint16_t> pc;    // bf16 master
  std::vector<uint16_t> m, v;  // bf16 moments (bf16 master)
  std::vector<uint8_t> mq, vq;
  std::vector<float> ms, vs;  // int8 codes and scales
};
CompactState RandomCompact(std::mt19937_64& rng, size_t n, bool int8) {
  CompactState c;
  const auto p = strata::testing::RandomFloats(rng, n);
  const auto m = strata::testing::RandomFloats(rng, n, -0.1f, 0.1f);
  const auto v = strata::testing::RandomFloats(rng, n, 1e-5f, 1e-2f);
  if (int8) {
    c.p = p;
    std::uniform_int_distribution<int> code(0, 255);
    c.mq.resize(n), c.vq.resize(n);
    for (size_t i = 0; i < n; ++i) c.mq[i] = static_cast<uint8_t>(code(rng));
    for (size_t i = 0; i < n; ++i) c.vq[i] = static_cast<uint8_t>(code(rng));
    const size_t nb = (n + 255) / 256;
    c.ms = strata::testing::RandomFloats(rng, nb, 1e-4f, 1e-3f);
    c.vs = strata::testing::RandomFloats(rng, nb, 1e-8f, 1e-7f);
  } else {
    c.pc.resize(n), c.m.resize(n), c.v.resize(n);
    for (size_t i = 0; i < n; ++i) {
      host::StoreFromFloat(c.pc.data(), DType::kBf16, i, p[i]);
      host::StoreFromFloat(c.m.data(), DType::kBf16, i, m[i]);
      host::StoreFromFloat(c.v.data(), DType::kBf16, i, v[i]);
    }
  }
  return c;
}
// A shard over elements [at, at + n) of `c` (host pointers).
AdamShard CompactShard(CompactState& c, bool int8, size_t at, size_t n, uint64_t index0) {
  AdamShard a;
  if (int8) {
    a.param = c.p.data() + at;
    a.exp_avg_q8 = c.mq.data() + at;
    a.exp_avg_sq_q8 = c.vq.data() + at;
    a.exp_avg_scale = c.ms.data() + at / 256;
    a.exp_avg_sq_scale = c.vs.data() + at / 256;
  } else {
    a.param_bf16 = c.pc.data() + at;
    a.exp_avg_bf16 = c.m.data() + at;
    a.exp_avg_sq_bf16 = c.v.data() + at;
  }
  a.count = n;
  a.index0 = index0 + at;
  return a;
}
bool SameState(const CompactState& a, const CompactState& b) {
  return std::memcmp(a.p.data(), b.p.data(), a.p.size() * 4) == 0 && a.pc == b.pc && a.m == b.m &&
         a.v == b.v && a.mq == b.mq && a.vq == b.vq &&
         std::memcmp(a.ms.data(), b.ms.data(), a.ms.size() * 4) == 0 &&
         std::memcmp(a.vs.data(), b.vs.data(), a.vs.size() * 4) == 0;
}

// A bf16 master and int8 moments (AdamShard::param_bf16, exp_avg_q8): the
// host reference is the CPU optimizer's format of the same name, bitwise
// (its scalar kernel, and the vector kernel the dispatcher picks), over
// three steps that read what the last rounded; and the shard cut does not
// change the bits (the rounding stream is keyed by the global index, the
// blocks are aligned to it).
TEST(HostAdamTest, CompactFormatsAreTheCpuFormats) {
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (bool int8 : {false, true})
    for (const char* isa : {"scalar", ""})
      for (bool adamw : {true, false})
        for (DType g : {DType::kFp32, DType::kBf16}) {
          SCOPED_TRACE(::testing::Message() << (int8 ? "int8" : "bf16-master") << " isa '" << isa
                                            << "' adamw " << adamw << " grad " << DTypeName(g));
          auto opt = cpu_adam::CpuOptimizer::Create({.threads = 1, .isa = isa}).value();
          const size_t n = 1037;  // a partial block, a tail for every vector width
          const uint64_t index0 = int8 ? 512 : 777;
          CompactState dev = RandomCompact(rng, n, int8), split = dev, cpu = dev;
          std::vector<uint16_t> c1(n), c2(n);
          for (int step = 1; step <= 3; ++step) {
            auto grad = ToDType(strata::testing::RandomFloats(rng, n, -50.f, 50.f), g);
            AdamHyperParams hp;
            hp.decoupled_weight_decay = adamw;
            hp.weight_decay = 0.1;
            hp.step = step;
            hp.grad_scale = 0.25;
            hp.seed = 0x5eed + static_cast<uint64_t>(step);
            const host::AdamCoeffs coeffs = host::MakeAdamCoeffs(hp);
            AdamShard a = CompactShard(dev, int8, 0, n, index0);
            a.grad = grad.data();
            a.grad_dtype = g;
            a.copy_out = c1.data();
            a.copy_dtype = DType::kBf16;
            host::AdamStep(a, coeffs);
            for (auto [at, len] : {std::pair<size_t, size_t>{0, 512}, {512, n - 512}}) {
              AdamShard b = CompactShard(split, int8, at, len, index0);
              b.grad = grad.data() + at * DTypeSize(g);
              b.grad_dtype = g;
              host::AdamStep(b, coeffs);
            }
            cpu_adam::ShardStep s;
            s.states = int8 ? cpu_adam::StateFormat::kInt8 : cpu_adam::StateFormat::kBf16Master;
            if (int8) {
              s.param = cpu.p.data();
              s.exp_avg_c = cpu.mq.data();
              s.exp_avg_sq_c = cpu.vq.data();
              s.exp_avg_scale = cpu.ms.data();
              s.exp_avg_sq_scale = cpu.vs.data();
            } else {
              s.param_c = cpu.pc.data();
              s.exp_avg_c = cpu.m.data();
              s.exp_avg_sq_c = cpu.v.data();
            }
            s.element_offset = index0;
            s.seed = hp.seed;
            s.grad = grad.data();
            s.grad_dtype = g;
            s.copy_out = c2.data();
            s.copy_dtype = DType::kBf16;
            s.count = n;
            s.hp = CpuHp(hp);
            ASSERT_TRUE(opt->Step(s).ok());
          }
          EXPECT_TRUE(SameState(dev, cpu));
          EXPECT_TRUE(SameState(dev, split));
          EXPECT_EQ(c1, c2);
        }
}

// The device's compact formats (CUDA: the compact kernel, its block
// reduction and partial last block, several shards in one launch) against
// the host reference, bitwise; a skipped step writes nothing; bad shards
// are refused naming the field.
TYPED_TEST(AdamStepTest, CompactFormatsMatchTheHostReference) {
  Device& d = this->dev();
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (bool int8 : {false, true}) {
    SCOPED_TRACE(int8 ? "int8" : "bf16-master");
    const size_t n = 65536 + 9;
    const uint64_t index0 = int8 ? 1024 : 4097;
    CompactState ref = RandomCompact(rng, n, int8);
    auto g = ToDType(strata::testing::RandomFloats(rng, n, -50.f, 50.f), DType::kBf16);
    const size_t nb = (n + 255) / 256;
    DeviceBuffer dp = d.Allocate(n * 4).value(), dm = d.Allocate(n * 2).value(),
                 dv = d.Allocate(n * 2).value(), dg = d.Allocate(n * 2).value(),
                 ds0 = d.Allocate(nb * 4).value(), ds1 = d.Allocate(nb * 4).value(),
                 dc = d.Allocate(n * 2).value();
    CompactState dev;  // device pointers through a CompactState's layout
    if (int8) {
      Put(d, dp.data(), ref.p.data(), n * 4);
      Put(d, dm.data(), ref.mq.data(), n);
      Put(d, dv.data(), ref.vq.data(), n);
      Put(d, ds0.data(), ref.ms.data(), nb * 4);
      Put(d, ds1.data(), ref.vs.data(), nb * 4);
    } else {
      Put(d, dp.data(), ref.pc.data(), n * 2);
      Put(d, dm.data(), ref.m.data(), n * 2);
      Put(d, dv.data(), ref.v.data(), n * 2);
    }
    Put(d, dg.data(), g.data(), n * 2);
    // Three shards: two whole blocks, then the rest (a partial last block).
    const size_t cuts[] = {0, 512, 1024 + 256 * 7, n};
    auto shard = [&](size_t at, size_t len) {
      AdamShard s;
      if (int8) {
        s.param = dp.as<float>() + at;
        s.exp_avg_q8 = dm.as<uint8_t>() + at;
        s.exp_avg_sq_q8 = dv.as<uint8_t>() + at;
        s.exp_avg_scale = ds0.as<float>() + at / 256;
        s.exp_avg_sq_scale = ds1.as<float>() + at / 256;
      } else {
        s.param_bf16 = dp.as<uint16_t>() + at;
        s.exp_avg_bf16 = dm.as<uint16_t>() + at;
        s.exp_avg_sq_bf16 = dv.as<uint16_t>() + at;
      }
      s.grad = dg.as<uint16_t>() + at;
      s.grad_dtype = DType::kBf16;
      s.copy_out = dc.as<uint16_t>() + at;
      s.copy_dtype = DType::kBf16;
      s.count = len;
      s.index0 = index0 + at;
      return s;
    };
    std::vector<AdamShard> shards;
    for (int k = 0; k < 3; ++k) shards.push_back(shard(cuts[k], cuts[k + 1] - cuts[k]));
    AdamHyperParams hp;
    hp.step = 4;
    hp.weight_decay = 0.05;
    hp.seed = 99;
    // A skipped step first: nothing changes.
    DeviceBuffer flag = d.Allocate(4).value();
    ASSERT_OK(d.FillInt32(flag.as<int32_t>(), 1, 1, d.compute()));
    ASSERT_OK(d.AdamStep(shards, hp, flag.as<int32_t>(), d.compute()));
    ASSERT_OK(d.FillInt32(flag.as<int32_t>(), 1, 0, d.compute()));
    ASSERT_OK(d.AdamStep(shards, hp, flag.as<int32_t>(), d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    std::vector<uint16_t> copy(n);
    AdamShard r = CompactShard(ref, int8, 0, n, index0);
    r.grad = g.data();
    r.grad_dtype = DType::kBf16;
    r.copy_out = copy.data();
    r.copy_dtype = DType::kBf16;
    host::AdamStep(r, host::MakeAdamCoeffs(hp));
    if (int8) {
      EXPECT_EQ(Get<float>(d, dp.data(), n), ref.p);
      EXPECT_EQ(Get<uint8_t>(d, dm.data(), n), ref.mq);
      EXPECT_EQ(Get<uint8_t>(d, dv.data(), n), ref.vq);
      EXPECT_EQ(Get<float>(d, ds0.data(), nb), ref.ms);
      EXPECT_EQ(Get<float>(d, ds1.data(), nb), ref.vs);
    } else {
      EXPECT_EQ(Get<uint16_t>(d, dp.data(), n), ref.pc);
      EXPECT_EQ(Get<uint16_t>(d, dm.data(), n), ref.m);
      EXPECT_EQ(Get<uint16_t>(d, dv.data(), n), ref.v);
    }
    EXPECT_EQ(Get<uint16_t>(d, dc.data(), n), copy);
    ASSERT_OK(d.d2h().Synchronize());
    // Refusals, before anything is enqueued.
    AdamShard bad = shards[1];
    if (int8) {
      bad.index0 += 3;
      Status st = d.AdamStep({&bad, 1}, hp, nullptr, d.compute());
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(st.message()).find("index0"), std::string::npos) << st;
      bad = shards[1];
      bad.exp_avg_sq_scale = nullptr;
      st = d.AdamStep({&bad, 1}, hp, nullptr, d.compute());
      EXPECT_NE(std::string(st.message()).find("exp_avg_sq_scale"), std::string::npos) << st;
    } else {
      bad.exp_avg_bf16 = nullptr;
      bad.exp_avg_sq_bf16 = nullptr;
      bad.exp_avg = dg.as<float>();
      bad.exp_avg_sq = dc.as<float>();
      const Status st = d.AdamStep({&bad, 1}, hp, nullptr, d.compute());
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(st.message()).find("param_bf16"), std::string::npos) << st;
    }
  }
}

}  // namespace
}  // namespace strata::gpu::testing
