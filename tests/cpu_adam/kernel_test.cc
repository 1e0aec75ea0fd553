// The fused kernels of every usable ISA against the double-precision
// reference (reference.h): every algorithm × grad dtype × copy-out dtype,
// sizes around the vector width, unaligned starts, zero length, bias
// correction on/off, weight decay, the gradient multiplier. Then bitwise
// determinism across thread counts, partitions and ISAs (each against scalar).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "src/common/half.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/cpu_adam/kernel.h"
#include "tests/cpu_adam/reference.h"
#include "tests/test_util.h"

namespace strata::cpu_adam {
namespace {

// A shard's arrays, filled with fresh random data (never zero).
struct ShardData {
  std::vector<float> p, m, v;
  std::vector<float> g32;     // the gradient as fp32 (exactly what the kernel sees)
  std::vector<uint8_t> graw;  // the gradient in its dtype
  std::vector<uint8_t> copy;
  size_t off = 0;             // elements of slack at the front (unaligned starts)

  ShardData(std::mt19937_64& rng, size_t n, size_t offset, DType gd, float grad_range) : off(offset) {
    p = testing::RandomFloats(rng, n + off, -1.f, 1.f);
    m = testing::RandomFloats(rng, n + off, -0.1f, 0.1f);
    v = testing::RandomFloats(rng, n + off, 1e-6f, 1e-2f);
    std::vector<float> g = testing::RandomFloats(rng, n + off, -grad_range, grad_range);
    graw.resize((n + off) * DTypeSize(gd));
    g32.resize(n + off);
    for (size_t i = 0; i < n + off; ++i) {
      if (gd == DType::kFp32) {
        g32[i] = g[i];
        std::memcpy(graw.data() + i * 4, &g[i], 4);
      } else {
        const uint16_t h = gd == DType::kFp16 ? FloatToHalfBits(g[i]) : FloatToBf16Bits(g[i]);
        g32[i] = gd == DType::kFp16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
        std::memcpy(graw.data() + i * 2, &h, 2);
      }
    }
    copy.assign((n + off) * 4, 0xA5);
  }

  ShardStep Step(size_t n, DType gd, std::optional<DType> cd, const HyperParams& hp) {
    ShardStep s;
    s.param = p.data() + off;
    s.grad = graw.data() + off * DTypeSize(gd);
    s.grad_dtype = gd;
    const bool adam = hp.algorithm == Algorithm::kAdam || hp.algorithm == Algorithm::kAdamW;
    s.exp_avg = (adam || hp.algorithm == Algorithm::kLion) ? m.data() + off : nullptr;
    s.exp_avg_sq = (adam || hp.algorithm == Algorithm::kAdagrad) ? v.data() + off : nullptr;
    s.count = n;
    if (cd) {
      s.copy_out = copy.data() + off * DTypeSize(*cd);
      s.copy_dtype = *cd;
    }
    s.hp = hp;
    return s;
  }
};

std::string Describe(const HyperParams& hp, DType gd, std::optional<DType> cd, size_t n, size_t off,
                     std::string_view isa) {
  return std::string(isa) + " " + std::string(AlgorithmName(hp.algorithm)) + " grad=" +
         std::string(DTypeName(gd)) + " copy=" + (cd ? std::string(DTypeName(*cd)) : "none") + " n=" +
         std::to_string(n) + " off=" + std::to_string(off) + " step=" + std::to_string(hp.step) +
         " bc=" + std::to_string(hp.bias_correction) + " wd=" + std::to_string(hp.weight_decay) +
         " scale=" + std::to_string(hp.grad_scale);
}

void CheckAgainstReference(CpuOptimizer& opt, std::mt19937_64& rng, const HyperParams& hp, DType gd,
                           std::optional<DType> cd, size_t n, size_t off) {
  SCOPED_TRACE(Describe(hp, gd, cd, n, off, opt.isa()));
  ShardData d(rng, n, off, gd, 1.f / hp.grad_scale);
  const ShardData before = d;
  ShardStep s = d.Step(n, gd, cd, hp);
  auto r = opt.Step(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->nonfinite());
  const bool adam = hp.algorithm == Algorithm::kAdam || hp.algorithm == Algorithm::kAdamW;
  size_t bad = 0;
  for (size_t j = 0; j < n && bad < 5; ++j) {
    const size_t i = j + off;
    const testref::Elem e = testref::Reference(hp, before.p[i], before.g32[i], before.m[i], before.v[i]);
    if (e.p_checkable && !(std::fabs(d.p[i] - e.p) <= e.bp)) {
      ++bad;
      ADD_FAILURE() << "param[" << j << "] = " << d.p[i] << " want " << e.p << " ± " << e.bp;
    }
    if (!e.p_checkable) {  // Lion with sign(u) within rounding of 0: one of the two outcomes
      const double alt1 = before.p[i] * (1 - double(hp.lr) * hp.weight_decay) - hp.lr;
      const double alt2 = before.p[i] * (1 - double(hp.lr) * hp.weight_decay) + hp.lr;
      EXPECT_TRUE(std::fabs(d.p[i] - alt1) <= e.bp || std::fabs(d.p[i] - alt2) <= e.bp ||
                  std::fabs(d.p[i] - e.p) <= e.bp);
    }
    if ((adam || hp.algorithm == Algorithm::kLion) && !(std::fabs(d.m[i] - e.m) <= e.bm)) {
      ++bad;
      ADD_FAILURE() << "exp_avg[" << j << "] = " << d.m[i] << " want " << e.m << " ± " << e.bm;
    }
    if ((adam || hp.algorithm == Algorithm::kAdagrad) && !(std::fabs(d.v[i] - e.v) <= e.bv)) {
      ++bad;
      ADD_FAILURE() << "exp_avg_sq[" << j << "] = " << d.v[i] << " want " << e.v << " ± " << e.bv;
    }
    if (cd) {  // the copy is exactly the reference conversion of the updated master
      if (*cd == DType::kFp32) {
        float c;
        std::memcpy(&c, d.copy.data() + i * 4, 4);
        EXPECT_EQ(FloatBits(c), FloatBits(d.p[i])) << j;
      } else {
        uint16_t c;
        std::memcpy(&c, d.copy.data() + i * 2, 2);
        EXPECT_EQ(c, *cd == DType::kFp16 ? FloatToHalfBits(d.p[i]) : FloatToBf16Bits(d.p[i])) << j;
      }
    }
  }
  // Nothing outside [off, off + n) was touched.
  for (size_t i = 0; i < off; ++i) {
    EXPECT_EQ(FloatBits(d.p[i]), FloatBits(before.p[i]));
    EXPECT_EQ(FloatBits(d.m[i]), FloatBits(before.m[i]));
    EXPECT_EQ(FloatBits(d.v[i]), FloatBits(before.v[i]));
  }
  if (cd) {
    const size_t cs = DTypeSize(*cd);
    for (size_t b = 0; b < off * cs; ++b) EXPECT_EQ(d.copy[b], 0xA5);
    for (size_t b = (off + n) * cs; b < d.copy.size(); ++b) ASSERT_EQ(d.copy[b], 0xA5);
  }
  if (!adam) {
    if (hp.algorithm == Algorithm::kAdagrad) {
      EXPECT_EQ(d.m, before.m);  // unused state untouched
    }
    if (hp.algorithm == Algorithm::kLion) {
      EXPECT_EQ(d.v, before.v);
    }
  }
}

class KernelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    Options o;
    o.isa = GetParam();
    o.threads = 2;
    o.block_elems = 1024;  // several blocks even for small shards
    auto opt = CpuOptimizer::Create(o);
    ASSERT_TRUE(opt.ok()) << opt.status();
    opt_ = std::move(*opt);
  }
  std::unique_ptr<CpuOptimizer> opt_;
};

TEST_P(KernelTest, EveryAlgorithmDtypeAndCopyAgainstReference) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const size_t lanes = 16;
  const std::vector<size_t> sizes = {1, 3, lanes - 1, lanes + 1, 2 * lanes + 3, 1000, 2048 + 77};
  std::uniform_int_distribution<int64_t> step_dist(1, 2000);
  int combo = 0;
  for (Algorithm alg : {Algorithm::kAdamW, Algorithm::kAdam, Algorithm::kAdagrad, Algorithm::kLion}) {
    for (DType gd : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (std::optional<DType> cd : {std::optional<DType>{}, std::optional<DType>{DType::kFp16},
                                      std::optional<DType>{DType::kBf16}, std::optional<DType>{DType::kFp32}}) {
        HyperParams hp;
        hp.algorithm = alg;
        hp.lr = alg == Algorithm::kLion ? 1e-4f : 1e-3f;
        hp.beta2 = alg == Algorithm::kLion ? 0.99f : 0.999f;
        hp.weight_decay = (combo % 3 == 0) ? 0.f : 0.01f * static_cast<float>(combo % 5 + 1);
        hp.bias_correction = combo % 2 == 0;
        hp.step = step_dist(rng);
        hp.grad_scale = (combo % 4 == 0) ? 1.f : 1.f / 1024.f * 0.75f;  // 1/loss_scale × clip coefficient
        if (gd == DType::kFp16 && hp.grad_scale != 1.f) hp.grad_scale = 1.f / 64.f;  // keep grads in fp16 range
        const size_t n = sizes[combo % sizes.size()];
        CheckAgainstReference(*opt_, rng, hp, gd, cd, n, combo % 2);  // odd starts half of the time
        ++combo;
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_P(KernelTest, AllSizesAroundTheVectorWidth) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  HyperParams hp;  // AdamW defaults
  hp.weight_decay = 0.1f;
  hp.step = 7;
  for (size_t n = 0; n <= 70; ++n) {
    for (size_t off : {0, 1, 3}) {
      CheckAgainstReference(*opt_, rng, hp, DType::kBf16, DType::kBf16, n, off);
      CheckAgainstReference(*opt_, rng, hp, DType::kFp32, std::nullopt, n, off);
    }
  }
}

TEST_P(KernelTest, FirstStepWithAndWithoutBiasCorrection) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  for (bool bc : {true, false}) {
    for (Algorithm alg : {Algorithm::kAdam, Algorithm::kAdamW}) {
      HyperParams hp;
      hp.algorithm = alg;
      hp.bias_correction = bc;
      hp.step = 1;
      hp.weight_decay = 0.05f;
      CheckAgainstReference(*opt_, rng, hp, DType::kFp16, DType::kFp16, 3000, 1);
    }
  }
}

// Results must not depend on the thread count, the block size or where a
// shard is cut: every element goes through the same vector code.
TEST_P(KernelTest, BitwiseIndependentOfThreadsAndPartition) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  const size_t n = 100003;
  for (DType gd : {DType::kFp32, DType::kBf16}) {
    ShardData base(rng, n, 0, gd, 1.f);
    HyperParams hp;
    hp.weight_decay = 0.01f;
    hp.step = 3;
    std::vector<ShardData> runs;
    for (int variant = 0; variant < 4; ++variant) {
      ShardData d = base;
      Options o;
      o.isa = GetParam();
      o.threads = variant == 0 ? 1 : 3;
      o.block_elems = variant == 2 ? 4096 : 1024;
      auto opt = CpuOptimizer::Create(o);
      ASSERT_TRUE(opt.ok()) << opt.status();
      if (variant == 3) {
        // Cut into two shards at an odd offset and step them together.
        const size_t cut = 777;
        ShardStep a = d.Step(cut, gd, DType::kBf16, hp);
        ShardStep b = a;
        b.param += cut;
        b.grad = static_cast<const uint8_t*>(b.grad) + cut * DTypeSize(gd);
        b.exp_avg += cut;
        b.exp_avg_sq += cut;
        b.copy_out = static_cast<uint8_t*>(b.copy_out) + cut * 2;
        b.count = n - cut;
        const ShardStep both[] = {b, a};
        ASSERT_TRUE((*opt)->StepMany(both).ok());
      } else {
        ASSERT_TRUE((*opt)->Step(d.Step(n, gd, DType::kBf16, hp)).ok());
      }
      runs.push_back(std::move(d));
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      SCOPED_TRACE("variant " + std::to_string(r));
      EXPECT_EQ(0, std::memcmp(runs[0].p.data(), runs[r].p.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(runs[0].m.data(), runs[r].m.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(runs[0].v.data(), runs[r].v.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(runs[0].copy.data(), runs[r].copy.data(), n * 2));
    }
  }
}

std::vector<std::string> UsableIsaNames() {
  std::vector<std::string> out;
  for (std::string_view s : AvailableIsas()) out.emplace_back(s);
  return out;
}

std::string Name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& c : n) if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(UsableIsas, KernelTest, ::testing::ValuesIn(UsableIsaNames()), Name);

// Every kernel multiplies then adds (MulAdd in kernel_impl.h, built with
// -ffp-contract=off), as the scalar loop does: every usable ISA gives the
// scalar loop's bits for every algorithm, grad dtype and copy-out, at odd
// sizes (vector tails) and unaligned starts, so results do not depend on
// the CPU a run lands on.
TEST(KernelCrossIsaTest, EveryIsaEqualsScalarBitwise) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  Options o;
  o.isa = "scalar";
  auto sca = CpuOptimizer::Create(o);
  ASSERT_TRUE(sca.ok());
  const std::optional<DType> copies[] = {std::nullopt, DType::kFp32, DType::kFp16, DType::kBf16};
  const size_t sizes[] = {1, 15, 17, 5001};
  for (std::string_view isa : AvailableIsas()) {
    if (isa == "scalar") continue;
    auto table = internal::SelectTable(isa);
    ASSERT_TRUE(table.ok());
    EXPECT_FALSE((*table)->fused_fma) << isa << ": a multiply-add rounds once";
    o.isa = std::string(isa);
    auto vec = CpuOptimizer::Create(o);
    ASSERT_TRUE(vec.ok());
    int combo = 0;
    for (Algorithm alg :
         {Algorithm::kAdam, Algorithm::kAdamW, Algorithm::kAdagrad, Algorithm::kLion}) {
      for (DType gd : {DType::kFp32, DType::kFp16, DType::kBf16}) {
        for (const auto& cd : copies) {
          const size_t n = sizes[combo % 4];
          const size_t off = combo % 3;
          ++combo;
          ShardData a(rng, n, off, gd, 1.f);
          ShardData b = a;
          const std::vector<float> before = a.p;
          HyperParams hp;
          hp.algorithm = alg;
          hp.weight_decay = 0.02f;
          hp.step = 1 + combo;
          hp.grad_scale = 0.5f;
          ASSERT_TRUE((*vec)->Step(a.Step(n, gd, cd, hp)).ok());
          ASSERT_TRUE((*sca)->Step(b.Step(n, gd, cd, hp)).ok());
          SCOPED_TRACE(Describe(hp, gd, cd, n, off, isa));
          ASSERT_EQ(0, std::memcmp(a.p.data(), b.p.data(), a.p.size() * 4));
          ASSERT_EQ(0, std::memcmp(a.m.data(), b.m.data(), a.m.size() * 4));
          ASSERT_EQ(0, std::memcmp(a.v.data(), b.v.data(), a.v.size() * 4));
          ASSERT_EQ(a.copy, b.copy);
          ASSERT_NE(a.p, before) << "the step changed nothing";
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::cpu_adam
