// The CpuOptimizer API: PyTorch AdamW on fixed data, non-finite gradients,
// validation errors, asynchronous steps, pinning, topology and ISA queries.
#include "src/cpu_adam/cpu_adam.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/half.h"
#include "tests/test_util.h"

namespace strata::cpu_adam {
namespace {

std::unique_ptr<CpuOptimizer> Make(Options o = {}) {
  auto opt = CpuOptimizer::Create(o);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

// torch.optim.AdamW(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
// zero-initialized moments, three steps. Expected values computed in double
// with PyTorch's order (single_tensor path):
//   p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g²
//   p -= lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)
// e.g. step 1, p=1, g=0.5: p = 0.999 - 1.0 * 0.05 / (0.5 + 1e-8) = 0.899000002.
TEST(AdamWSemanticsTest, MatchesPyTorchOnFixedData) {
  struct Row { float g0, g1; double p, m0, m1, v0, v1; };
  // Element 0: p=1, g = 0.5, -0.25, 0.125. Element 1: p=-2, g = 2^-10, 2^-9,
  // -2^-8 (exact in fp32, so the only differences are fp32 rounding).
  const Row rows[3] = {
      {0.5f, 0x1p-10f, 0.899000002, 0.05, 9.765625e-05, 0.00025, 9.53674316406e-10},
      {-0.25f, 0x1p-9f, 0.8714672987, 0.02, 0.000283203125, 0.00031225, 4.76741790771e-09},
      {0.125f, -0x1p-8f, 0.8365529176, 0.0305, -0.0001357421875, 0.00032756275, 2.00214395523e-08},
  };
  const double p1[3] = {-2.09799897601, -2.19241855463, -2.17084676555};
  for (const char* isa : {"auto", "scalar"}) {
    Options o;
    o.isa = isa;
    auto opt = Make(o);
    ASSERT_NE(opt, nullptr);
    std::vector<float> p = {1.f, -2.f}, m = {0.f, 0.f}, v = {0.f, 0.f}, g(2);
    for (int t = 1; t <= 3; ++t) {
      g = {rows[t - 1].g0, rows[t - 1].g1};
      ShardStep s;
      s.param = p.data();
      s.grad = g.data();
      s.exp_avg = m.data();
      s.exp_avg_sq = v.data();
      s.count = 2;
      s.hp.algorithm = Algorithm::kAdamW;
      s.hp.lr = 0.1f;
      s.hp.weight_decay = 0.01f;
      s.hp.step = t;
      ASSERT_TRUE(opt->Step(s).ok());
      const Row& r = rows[t - 1];
      // fp32 master: within a few ulps of the double computation.
      EXPECT_NEAR(p[0], r.p, 4 * std::fabs(r.p) * 0x1p-24) << isa << " step " << t;
      EXPECT_NEAR(p[1], p1[t - 1], 4 * std::fabs(p1[t - 1]) * 0x1p-24) << isa << " step " << t;
      EXPECT_NEAR(m[0], r.m0, 4 * std::fabs(r.m0) * 0x1p-24);
      EXPECT_NEAR(m[1], r.m1, 8 * std::fabs(r.m1) * 0x1p-24);
      EXPECT_NEAR(v[0], r.v0, 4 * std::fabs(r.v0) * 0x1p-24);
      EXPECT_NEAR(v[1], r.v1, 4 * std::fabs(r.v1) * 0x1p-24);
    }
  }
}

TEST(NonFiniteTest, ChunksWithInfOrNanAreSkippedAndReported) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  const size_t n = 10 * 1024 + 5;
  const size_t bad_inf = 3 * 1024 + 17, bad_nan = 10 * 1024 + 2;  // in chunks 3 and 10 (the tail)
  for (DType gd : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    auto p = testing::RandomFloats(rng, n), m = testing::RandomFloats(rng, n, -0.1f, 0.1f),
         v = testing::RandomFloats(rng, n, 1e-5f, 1e-2f), gf = testing::RandomFloats(rng, n);
    std::vector<uint8_t> g(n * DTypeSize(gd));
    for (size_t i = 0; i < n; ++i) {
      float x = gf[i];
      if (i == bad_inf) x = -std::numeric_limits<float>::infinity();
      if (i == bad_nan) x = std::numeric_limits<float>::quiet_NaN();
      if (gd == DType::kFp32) std::memcpy(&g[i * 4], &x, 4);
      else {
        const uint16_t h = gd == DType::kFp16 ? FloatToHalfBits(x) : FloatToBf16Bits(x);
        std::memcpy(&g[i * 2], &h, 2);
      }
    }
    std::vector<uint16_t> copy(n, 0x1234);
    const auto p0 = p, m0 = m, v0 = v;
    for (const char* isa : {"auto", "scalar"}) {
      p = p0, m = m0, v = v0;
      copy.assign(n, 0x1234);
      Options o;
      o.isa = isa;
      o.block_elems = 2048;
      auto opt = Make(o);
      ShardStep s;
      s.param = p.data();
      s.grad = g.data();
      s.grad_dtype = gd;
      s.exp_avg = m.data();
      s.exp_avg_sq = v.data();
      s.count = n;
      s.copy_out = copy.data();
      s.copy_dtype = DType::kBf16;
      s.check_finite = true;
      auto r = opt->Step(s);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->nonfinite()) << isa << " " << DTypeName(gd);
      EXPECT_EQ(r->nonfinite_shards, 1u);
      for (size_t i = 0; i < n; ++i) {
        const size_t chunk = i / 1024;
        const bool skipped = chunk == 3 || chunk == 10;
        if (skipped) {
          ASSERT_EQ(FloatBits(p[i]), FloatBits(p0[i])) << i;
          ASSERT_EQ(FloatBits(m[i]), FloatBits(m0[i])) << i;
          ASSERT_EQ(FloatBits(v[i]), FloatBits(v0[i])) << i;
          ASSERT_EQ(copy[i], 0x1234) << i;
        } else {
          ASSERT_NE(FloatBits(m[i]), FloatBits(m0[i])) << i;
          ASSERT_EQ(copy[i], FloatToBf16Bits(p[i])) << i;
          ASSERT_TRUE(std::isfinite(p[i]));
        }
      }
      // The read-only check agrees, and a clean gradient passes both.
      auto all = opt->AllFinite(g.data(), gd, n, 1.f);
      ASSERT_TRUE(all.ok());
      EXPECT_FALSE(*all);
      auto head = opt->AllFinite(g.data(), gd, 3 * 1024, 1.f);
      ASSERT_TRUE(head.ok());
      EXPECT_TRUE(*head);
      s.count = 3 * 1024;
      auto clean = opt->Step(s);
      ASSERT_TRUE(clean.ok());
      EXPECT_FALSE(clean->nonfinite());
    }
  }
}

TEST(NonFiniteTest, OverflowFromTheMultiplierIsDetected) {
  auto opt = Make();
  std::vector<float> g(100, 1e30f);
  auto ok = opt->AllFinite(g.data(), DType::kFp32, g.size(), 1.f);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(*ok);
  auto over = opt->AllFinite(g.data(), DType::kFp32, g.size(), 1e10f);  // 1e40 overflows fp32
  ASSERT_TRUE(over.ok());
  EXPECT_FALSE(*over);
}

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto rng = testing::MakeRng();
    p = testing::RandomFloats(rng, n);
    g = testing::RandomFloats(rng, n);
    m = testing::RandomFloats(rng, n);
    v = testing::RandomFloats(rng, n, 0.1f, 1.f);
    s.param = p.data();
    s.grad = g.data();
    s.exp_avg = m.data();
    s.exp_avg_sq = v.data();
    s.count = n;
    opt = Make();
  }
  void ExpectInvalid(const ShardStep& bad, const std::string& needle) {
    const auto p0 = p;
    auto r = opt->Step(bad);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string_view::npos) << r.status();
    EXPECT_EQ(p, p0) << "nothing may be written on a bad descriptor";
  }
  const size_t n = 100;
  std::vector<float> p, g, m, v;
  ShardStep s;
  std::unique_ptr<CpuOptimizer> opt;
};

TEST_F(ValidationTest, BadDescriptorsNameTheField) {
  ShardStep b = s;
  b.exp_avg_sq = nullptr;
  ExpectInvalid(b, "exp_avg_sq is null");
  b = s;
  b.param = nullptr;
  ExpectInvalid(b, "param is null");
  b = s;
  b.exp_avg = b.param + 50;  // overlaps param
  ExpectInvalid(b, "param and exp_avg overlap");
  b = s;
  b.hp.beta1 = 1.f;
  ExpectInvalid(b, "beta1");
  b = s;
  b.hp.lr = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(b, "lr");
  b = s;
  b.hp.step = 0;
  ExpectInvalid(b, "step must be >= 1");
  b = s;
  b.hp.grad_scale = std::numeric_limits<float>::infinity();
  ExpectInvalid(b, "grad_scale");
  b = s;
  b.grad_dtype = static_cast<DType>(7);
  ExpectInvalid(b, "grad_dtype");
  // In StepMany the bad shard is named and no shard is written.
  ShardStep bad = s;
  bad.exp_avg = nullptr;
  std::vector<float> p2 = p;
  ShardStep good = s;
  good.param = p2.data();
  good.exp_avg = nullptr;
  good.hp.algorithm = Algorithm::kAdagrad;  // needs no exp_avg
  const ShardStep both[] = {good, bad};
  auto r = opt->StepMany(both);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("shard 1"), std::string_view::npos) << r.status();
  EXPECT_EQ(p2, p);
}

TEST_F(ValidationTest, ZeroCountIsANoOp) {
  ShardStep z;
  z.count = 0;  // all pointers null: fine
  auto r = opt->Step(z);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->nonfinite());
  auto none = opt->StepMany({});
  EXPECT_TRUE(none.ok());
}

TEST(OptionsTest, BadOptionsAreRejected) {
  Options o;
  o.block_elems = 1000;
  auto a = CpuOptimizer::Create(o);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("block_elems"), std::string_view::npos);
  o = Options{};
  o.numa_node = 4096;
  auto b = CpuOptimizer::Create(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(b.status().message().find("4096"), std::string_view::npos);
  o = Options{};
  o.isa = "neon9";
  EXPECT_EQ(CpuOptimizer::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = Options{};
  o.threads = -2;
  EXPECT_EQ(CpuOptimizer::Create(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(AsyncTest, StepAsyncMatchesStepBitwise) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  const size_t n = 50001;
  auto p = testing::RandomFloats(rng, n), g = testing::RandomFloats(rng, n),
       m = testing::RandomFloats(rng, n, -0.1f, 0.1f), v = testing::RandomFloats(rng, n, 1e-5f, 1e-2f);
  auto p2 = p, m2 = m, v2 = v;
  Options o;
  o.threads = 2;
  o.block_elems = 4096;
  auto opt = Make(o);
  ShardStep s;
  s.param = p.data();
  s.grad = g.data();
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  s.count = n;
  s.hp.step = 5;
  s.hp.weight_decay = 0.01f;
  ShardStep s2 = s;
  s2.param = p2.data();
  s2.exp_avg = m2.data();
  s2.exp_avg_sq = v2.data();
  auto h = opt->StepAsync({&s2, 1});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(opt->Step(s).ok());  // concurrently on the same optimizer
  auto r = h->Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(p == p2 && m == m2 && v == v2);
  EXPECT_FALSE(h->valid());
  EXPECT_EQ(h->Wait().status().code(), StatusCode::kFailedPrecondition);
}

TEST(AsyncTest, HandleDestructorWaitsAndManyHandlesRun) {
  auto rng = testing::MakeRng();
  const size_t n = 20000;
  std::vector<std::vector<float>> p(6), g(6), m(6), v(6);
  std::vector<ShardStep> steps(6);
  for (int k = 0; k < 6; ++k) {
    p[k] = testing::RandomFloats(rng, n);
    g[k] = testing::RandomFloats(rng, n);
    m[k] = testing::RandomFloats(rng, n);
    v[k] = testing::RandomFloats(rng, n, 0.1f, 1.f);
    steps[k].param = p[k].data();
    steps[k].grad = g[k].data();
    steps[k].exp_avg = m[k].data();
    steps[k].exp_avg_sq = v[k].data();
    steps[k].count = n;
  }
  const auto p0 = p;
  auto opt = Make();
  {
    std::vector<StepHandle> handles;
    for (int k = 0; k < 6; ++k) {
      auto h = opt->StepAsync({&steps[k], 1});
      ASSERT_TRUE(h.ok());
      handles.push_back(std::move(*h));
    }
  }  // destructors wait
  for (int k = 0; k < 6; ++k) EXPECT_NE(p[k], p0[k]) << k;
  // A bad descriptor fails at submission, not in Wait.
  ShardStep bad = steps[0];
  bad.grad = nullptr;
  EXPECT_EQ(opt->StepAsync({&bad, 1}).status().code(), StatusCode::kInvalidArgument);
}

// Zero: exactly the range, on fresh random data, for sizes around the
// block and the inline threshold, with 1 and 3 threads.
TEST(ZeroTest, ZeroesExactlyTheRange) {
  for (int threads : {1, 3}) {
    Options o;
    o.threads = threads;
    o.block_elems = 1024;
    o.accumulate_inline_elems = 2048;
    auto opt = Make(o);
    std::mt19937 rng(threads);
    std::uniform_real_distribution<float> u(0.5f, 2.f);
    for (size_t n : {size_t{1}, size_t{1023}, size_t{2047}, size_t{2049}, size_t{3 * 1024 + 5},
                     size_t{200001}}) {
      std::vector<float> v(n + 16);
      for (float& x : v) x = u(rng);
      const std::vector<float> before = v;
      ASSERT_TRUE(opt->Zero(v.data() + 8, n).ok());
      for (size_t i = 0; i < v.size(); ++i) {
        const bool inside = i >= 8 && i < 8 + n;
        ASSERT_EQ(v[i], inside ? 0.f : before[i]) << "n " << n << " index " << i;
      }
    }
    EXPECT_TRUE(opt->Zero(nullptr, 0).ok());
    EXPECT_EQ(opt->Zero(nullptr, 5).code(), StatusCode::kInvalidArgument);
  }
}

// Copy: exactly the range, bit for bit (NaN payloads and -0 included), for
// the same sizes and thread counts as Zero.
TEST(CopyTest, CopiesExactlyTheRange) {
  for (int threads : {1, 3}) {
    Options o;
    o.threads = threads;
    o.block_elems = 1024;
    o.accumulate_inline_elems = 2048;
    auto opt = Make(o);
    std::mt19937 rng(100 + threads);
    std::uniform_int_distribution<uint32_t> bits;
    for (size_t n : {size_t{1}, size_t{1023}, size_t{2047}, size_t{2049}, size_t{3 * 1024 + 5},
                     size_t{200001}}) {
      std::vector<uint32_t> src(n), dst(n + 16);
      for (uint32_t& x : src) x = bits(rng);
      for (uint32_t& x : dst) x = bits(rng);
      const std::vector<uint32_t> before = dst;
      ASSERT_TRUE(opt->Copy(reinterpret_cast<float*>(dst.data() + 8),
                            reinterpret_cast<const float*>(src.data()), n)
                      .ok());
      for (size_t i = 0; i < dst.size(); ++i) {
        const bool inside = i >= 8 && i < 8 + n;
        ASSERT_EQ(dst[i], inside ? src[i - 8] : before[i]) << "n " << n << " index " << i;
      }
    }
    float x = 1.f;
    EXPECT_TRUE(opt->Copy(nullptr, nullptr, 0).ok());
    EXPECT_EQ(opt->Copy(nullptr, &x, 1).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(opt->Copy(&x, nullptr, 1).code(), StatusCode::kInvalidArgument);
  }
}

TEST(PinningTest, WorkersArePinnedAndCallerAffinityIsRestored) {
  auto topo = DescribeTopology();
  ASSERT_TRUE(topo.ok()) << topo.status();
  cpu_set_t before, after;
  ASSERT_EQ(0, sched_getaffinity(0, sizeof(before), &before));
  Options o;
  o.numa_node = 0;
  o.threads = 2;
  o.block_elems = 1024;
  auto opt = Make(o);
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->numa_node(), 0);
  auto rng = testing::MakeRng();
  const size_t n = 64 * 1024;
  auto p = testing::RandomFloats(rng, n), g = testing::RandomFloats(rng, n), m = testing::RandomFloats(rng, n),
       v = testing::RandomFloats(rng, n, 0.1f, 1.f);
  ShardStep s;
  s.param = p.data();
  s.grad = g.data();
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  s.count = n;
  ASSERT_TRUE(opt->Step(s).ok());
  EXPECT_GE(opt->pinned_thread_entries(), 1u);
  ASSERT_EQ(0, sched_getaffinity(0, sizeof(after), &after));
  EXPECT_TRUE(CPU_EQUAL(&before, &after));
  // Unpinned optimizer: nobody is pinned.
  auto free_opt = Make();
  ASSERT_TRUE(free_opt->Step(s).ok());
  EXPECT_EQ(free_opt->pinned_thread_entries(), 0u);
  EXPECT_EQ(free_opt->numa_node(), -1);
}

TEST(InfoTest, IsaAndTopology) {
  const auto isas = AvailableIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), BestIsa());
  EXPECT_EQ(isas.back(), "scalar");
  auto opt = Make();
  EXPECT_EQ(opt->isa(), BestIsa());
  EXPECT_GE(opt->threads(), 1);
  auto topo = DescribeTopology();
  ASSERT_TRUE(topo.ok()) << topo.status();
  EXPECT_GE(topo->pus, 1);
  EXPECT_GE(topo->cores, 1);
  ASSERT_GE(topo->numa_nodes.size(), 1u);
  int pus = 0;
  for (const auto& node : topo->numa_nodes) pus += static_cast<int>(node.pus.size());
  EXPECT_EQ(pus, topo->pus);
  EXPECT_GT(topo->numa_nodes[0].memory_bytes, 0u);
  std::vector<float> buf(1 << 20, 1.f);  // touched: placed somewhere
  auto node = NumaNodeOf(buf.data(), buf.size() * 4);
  if (node.ok()) {
    EXPECT_GE(*node, -1);
    EXPECT_LT(*node, static_cast<int>(topo->numa_nodes.size()));
  } else {
    EXPECT_EQ(node.status().code(), StatusCode::kNotSupported);
  }
  EXPECT_FALSE(NumaNodeOf(nullptr, 10).ok());
}

TEST(InfoTest, BytesPerElement) {
  EXPECT_EQ(BytesPerElement(Algorithm::kAdamW, DType::kFp32, std::nullopt), 28u);
  EXPECT_EQ(BytesPerElement(Algorithm::kAdamW, DType::kBf16, DType::kBf16), 28u);
  EXPECT_EQ(BytesPerElement(Algorithm::kAdam, DType::kFp16, DType::kFp32), 30u);
  EXPECT_EQ(BytesPerElement(Algorithm::kLion, DType::kBf16, DType::kBf16), 20u);
  EXPECT_EQ(BytesPerElement(Algorithm::kAdagrad, DType::kFp32, std::nullopt), 20u);
  EXPECT_EQ(*ParseAlgorithm("adamw"), Algorithm::kAdamW);
  EXPECT_FALSE(ParseAlgorithm("sgd").has_value());
}

}  // namespace
}  // namespace strata::cpu_adam

namespace strata::cpu_adam {
namespace {

TEST(CastTest, MatchesReferenceConversionsAndRejectsBadInput) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  const size_t n = 70001;
  auto src = testing::RandomFloats(rng, n, -70000.f, 70000.f);
  for (const char* isa : {"auto", "scalar"}) {
    Options o;
    o.isa = isa;
    o.block_elems = 4096;
    auto opt = Make(o);
    std::vector<uint16_t> h(n + 1), b(n + 1);
    ASSERT_TRUE(opt->Cast(src.data(), h.data() + 1, DType::kFp16, n).ok());  // odd destination
    ASSERT_TRUE(opt->Cast(src.data(), b.data(), DType::kBf16, n).ok());
    std::vector<float> f(n);
    ASSERT_TRUE(opt->Cast(src.data(), f.data(), DType::kFp32, n).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(h[i + 1], FloatToHalfBits(src[i])) << isa << " " << i;
      ASSERT_EQ(b[i], FloatToBf16Bits(src[i])) << isa << " " << i;
    }
    EXPECT_EQ(f, src);
    EXPECT_EQ(opt->Cast(src.data(), nullptr, DType::kFp16, n).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(opt->Cast(src.data(), src.data() + 10, DType::kBf16, n).code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(opt->Cast(nullptr, nullptr, DType::kBf16, 0).ok());
  }
}

}  // namespace
}  // namespace strata::cpu_adam

namespace strata::cpu_adam {
namespace {

// Asynchronous steps must make progress whatever the thread count (one
// thread: the arena keeps no slot for the caller, so a worker runs it).
TEST(AsyncTest, ProgressWithOneAndWithMoreThreadsThanCores) {
  auto rng = testing::MakeRng();
  const size_t n = 40000;
  for (int threads : {1, 4}) {
    auto p = testing::RandomFloats(rng, n), g = testing::RandomFloats(rng, n),
         m = testing::RandomFloats(rng, n), v = testing::RandomFloats(rng, n, 0.1f, 1.f);
    auto p2 = p, m2 = m, v2 = v;
    Options o;
    o.threads = threads;
    o.block_elems = 1024;
    auto opt = Make(o);
    ASSERT_NE(opt, nullptr);
    EXPECT_EQ(opt->threads(), threads);
    ShardStep s;
    s.param = p.data();
    s.grad = g.data();
    s.exp_avg = m.data();
    s.exp_avg_sq = v.data();
    s.count = n;
    auto h = opt->StepAsync({&s, 1});
    ASSERT_TRUE(h.ok());
    auto r = h->Wait();
    ASSERT_TRUE(r.ok()) << r.status();
    ShardStep s2 = s;
    s2.param = p2.data();
    s2.exp_avg = m2.data();
    s2.exp_avg_sq = v2.data();
    ASSERT_TRUE(opt->Step(s2).ok());
    EXPECT_TRUE(p == p2 && m == m2 && v == v2) << threads;
  }
}

}  // namespace
}  // namespace strata::cpu_adam

namespace strata::cpu_adam {
namespace {

// Non-temporal stores change how results reach memory, never what they are:
// off, copy-out only and all must give the same bits, on aligned arrays
// (where the streaming path is taken) and at an odd offset (where it is not).
TEST(StreamingStoresTest, SameBitsWithAndWithoutStreaming) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  const size_t n = 3 * 32768 + 77;
  auto init_p = testing::RandomFloats(rng, n + 1), init_g = testing::RandomFloats(rng, n + 1),
       init_m = testing::RandomFloats(rng, n + 1, -0.1f, 0.1f), init_v = testing::RandomFloats(rng, n + 1, 1e-5f, 1e-2f);
  for (const auto& isa : AvailableIsas()) {
    for (size_t off : {0, 1}) {
      std::vector<std::vector<uint8_t>> results;
      for (StreamingStores mode : {StreamingStores::kOff, StreamingStores::kCopyOut, StreamingStores::kAll}) {
        auto p = AlignedBuffer::Allocate((n + 1) * 4, 64), m = AlignedBuffer::Allocate((n + 1) * 4, 64),
             v = AlignedBuffer::Allocate((n + 1) * 4, 64), c = AlignedBuffer::Allocate((n + 1) * 2, 64);
        ASSERT_TRUE(p.ok() && m.ok() && v.ok() && c.ok());
        std::memcpy(p->data(), init_p.data(), (n + 1) * 4);
        std::memcpy(m->data(), init_m.data(), (n + 1) * 4);
        std::memcpy(v->data(), init_v.data(), (n + 1) * 4);
        Options o;
        o.isa = std::string(isa);
        o.streaming_stores = mode;
        auto opt = Make(o);
        ASSERT_NE(opt, nullptr);
        ShardStep s;
        s.param = p->as<float>() + off;
        s.grad = init_g.data();
        s.exp_avg = m->as<float>() + off;
        s.exp_avg_sq = v->as<float>() + off;
        s.count = n;
        s.copy_out = c->as<uint16_t>() + off;
        s.copy_dtype = DType::kBf16;
        s.hp.step = 4;
        ASSERT_TRUE(opt->Step(s).ok());
        std::vector<uint8_t> all;
        for (const AlignedBuffer* b : {&*p, &*m, &*v}) {
          const auto* bytes = static_cast<const uint8_t*>(b->data());
          all.insert(all.end(), bytes + off * 4, bytes + (off + n) * 4);
        }
        const auto* cb = static_cast<const uint8_t*>(c->data());
        all.insert(all.end(), cb + off * 2, cb + (off + n) * 2);
        results.push_back(std::move(all));
      }
      EXPECT_TRUE(results[0] == results[1]) << isa << " off=" << off;
      EXPECT_TRUE(results[0] == results[2]) << isa << " off=" << off;
    }
  }
}

}  // namespace
}  // namespace strata::cpu_adam

namespace strata::cpu_adam {
namespace {

// ---- Local ranks' share of the CPU (data parallelism) ------------------------

CpuTopology TwoNodes() {
  CpuTopology t;
  t.packages = 2;
  t.cores = t.pus = 16;
  for (int n = 0; n < 2; ++n) {
    NumaNodeInfo node;
    node.logical_index = n;
    node.os_index = 10 + n;  // kernel numbers need not be the logical ones
    node.cores = 8;
    for (int p = 0; p < 8; ++p) node.pus.push_back(8 * n + p);
    t.numa_nodes.push_back(node);
  }
  return t;
}

TEST(RankCpuShareTest, TheGpusNodeWithItsShareOfThePus) {
  const CpuTopology t = TwoNodes();
  // 4 ranks, 2 per node: half a node's PUs each, on the GPU's node.
  RankCpuShare s = ShareOfLocalRank(t, 0, 4, /*gpu_os_node=*/11);
  EXPECT_EQ(s.numa_node, 1);
  EXPECT_EQ(s.numa_os_node, 11);
  EXPECT_EQ(s.threads, 4);
  EXPECT_NE(s.why.find("GPU"), std::string::npos) << s.why;
  // No GPU node known: round robin over the nodes.
  s = ShareOfLocalRank(t, 3, 4, -1);
  EXPECT_EQ(s.numa_node, 1);
  EXPECT_EQ(s.threads, 4);
  s = ShareOfLocalRank(t, 2, 4, /*a node this machine lacks*/ 7);
  EXPECT_EQ(s.numa_node, 0);
  // One rank per node: the whole node.
  EXPECT_EQ(ShareOfLocalRank(t, 1, 2, -1).threads, 8);
}

TEST(RankCpuShareTest, OneNodeIsNotPinnedAndSplitsTheMachine) {
  CpuTopology t = TwoNodes();
  t.numa_nodes.resize(1);
  t.pus = 6;
  RankCpuShare s = ShareOfLocalRank(t, 1, 4, 10);
  EXPECT_EQ(s.numa_node, -1);
  EXPECT_EQ(s.threads, 1);  // 6 PUs / 4 ranks
  EXPECT_EQ(ShareOfLocalRank(t, 0, 1, -1).threads, 6);
  EXPECT_EQ(ShareOfLocalRank(t, 0, 64, -1).threads, 1);  // at least one
}

}  // namespace
}  // namespace strata::cpu_adam
