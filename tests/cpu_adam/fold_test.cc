// The folded step (ShardStep::fold, KernelTable::step_fold): the window's
// last micro-batch read beside the fp32 accumulator inside the optimizer's
// pass. For every usable ISA, every algorithm, grad dtype (fp32, fp16, bf16)
// and copy-out, sizes around the vector width and odd ones, unaligned
// starts, random data with ±0 and subnormals in both the gradient and the
// accumulator: the folded kernel gives bitwise what the plain reference
// accumulation (the scalar loop) followed by the same ISA's ordinary step on
// the fp32 sum gives — with an accumulator, and with none (a zeroed one).
// Every ISA's folded kernels equal the scalar ones bit for bit. Then the API:
// StepMany with folded shards across thread counts, and validation.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "src/common/half.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/cpu_adam/kernel.h"
#include "tests/test_util.h"

namespace strata::cpu_adam {
namespace {

using internal::CopyOut;
using internal::KernelArgs;
using internal::KernelOp;
using internal::KernelTable;

constexpr DType kDTypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};

// Finite random values in [-range, range], about one in eight replaced by
// +0, -0 or a subnormal (of the dtype), as raw bits of dtype `gd`.
std::vector<uint8_t> FiniteGrads(std::mt19937_64& rng, size_t n, DType gd, float range) {
  const std::vector<float> vals = testing::RandomFloats(rng, n, -range, range);
  std::vector<uint8_t> out(n * DTypeSize(gd));
  std::uniform_int_distribution<int> kind(0, 23);
  for (size_t i = 0; i < n; ++i) {
    float f = vals[i];
    const int k = kind(rng);
    if (k == 0) f = 0.f;
    if (k == 1) f = -0.f;
    if (k == 2) f = gd == DType::kFp16 ? 3e-6f : 1e-39f;  // a subnormal of the dtype
    if (gd == DType::kFp32) {
      std::memcpy(out.data() + i * 4, &f, 4);
    } else {
      const uint16_t h = gd == DType::kFp16 ? FloatToHalfBits(f) : FloatToBf16Bits(f);
      std::memcpy(out.data() + i * 2, &h, 2);
    }
  }
  return out;
}

std::vector<float> FiniteAccs(std::mt19937_64& rng, size_t n) {
  std::vector<float> a = testing::RandomFloats(rng, n, -4.f, 4.f);
  std::uniform_int_distribution<int> kind(0, 15);
  for (float& x : a) {
    const int k = kind(rng);
    if (k == 0) x = 0.f;
    if (k == 1) x = -0.f;
    if (k == 2) x = 1e-39f;
  }
  return a;
}

// One shard's arrays for a kernel call (with slack in front: unaligned).
struct Arrays {
  std::vector<float> p, s0, s1;
  std::vector<uint8_t> copy;
};

Arrays RandomArrays(std::mt19937_64& rng, size_t n) {
  Arrays a;
  a.p = testing::RandomFloats(rng, n, -1.f, 1.f);
  a.s0 = testing::RandomFloats(rng, n, -0.1f, 0.1f);
  a.s1 = testing::RandomFloats(rng, n, 1e-6f, 1e-2f);
  a.copy.assign(n * 4, 0xA5);
  return a;
}

KernelArgs ArgsFor(Arrays& a, size_t off, size_t n, KernelOp op, CopyOut co) {
  KernelArgs k;
  k.param = a.p.data() + off;
  k.state0 = a.s0.data() + off;
  k.state1 = (op == KernelOp::kAdam || op == KernelOp::kAdamW) ? a.s1.data() + off : nullptr;
  const size_t cb = co == CopyOut::kNone ? 0 : (co == CopyOut::kFp32 ? 4 : 2);
  k.copy_out = co == CopyOut::kNone ? nullptr : a.copy.data() + off * cb;
  k.n = n;
  k.c.grad_scale = 0.75f / 1024.f;
  k.c.l2 = 0.01f;
  k.c.decay = 0.9999f;
  k.c.neg_step = -1e-3f;
  k.c.inv_bc2_sqrt = 1.3f;
  return k;
}

bool SameBits(const Arrays& x, const Arrays& y) {
  return std::memcmp(x.p.data(), y.p.data(), x.p.size() * 4) == 0 &&
         std::memcmp(x.s0.data(), y.s0.data(), x.s0.size() * 4) == 0 &&
         std::memcmp(x.s1.data(), y.s1.data(), x.s1.size() * 4) == 0 && x.copy == y.copy;
}

std::vector<const KernelTable*> Tables() { return internal::UsableTables(); }
std::string TableName(const ::testing::TestParamInfo<const KernelTable*>& info) {
  std::string n(info.param->isa);
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

class FoldKernelTest : public ::testing::TestWithParam<const KernelTable*> {};

TEST_P(FoldKernelTest, BitwiseEqualToAccumulateThenStep) {
  const KernelTable& t = *GetParam();
  const KernelTable& ref = internal::ScalarTable();
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<size_t> sizes = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 65, 255, 1000, 4097};
  std::uniform_int_distribution<size_t> off_dist(0, 5);
  int combo = 0;
  for (KernelOp op : {KernelOp::kAdam, KernelOp::kAdamW, KernelOp::kAdagrad, KernelOp::kLion}) {
    for (DType gd : kDTypes) {
      for (CopyOut co : {CopyOut::kNone, CopyOut::kFp32, CopyOut::kFp16, CopyOut::kBf16}) {
        for (bool with_acc : {true, false}) {
          const size_t n = sizes[static_cast<size_t>(combo++) % sizes.size()];
          const size_t off = off_dist(rng), goff = off_dist(rng), aoff = off_dist(rng);
          SCOPED_TRACE(std::string(t.isa) + " op " + std::to_string(int(op)) + " " +
                       std::string(DTypeName(gd)) + " copy " + std::to_string(int(co)) +
                       (with_acc ? " acc" : " zero") + " n=" + std::to_string(n));
          const int gi = static_cast<int>(gd);
          const size_t gb = DTypeSize(gd);
          const std::vector<uint8_t> g = FiniteGrads(rng, n + goff, gd, 4.f);
          const std::vector<float> acc = FiniteAccs(rng, n + aoff);
          const Arrays init = RandomArrays(rng, n + off);

          // Folded: acc (or nothing) and the raw gradient in one pass.
          Arrays folded = init;
          KernelArgs fa = ArgsFor(folded, off, n, op, co);
          fa.grad = g.data() + goff * gb;
          fa.fold = with_acc ? acc.data() + aoff : nullptr;
          t.step_fold[int(op)][gi][int(co)](fa, false);

          // Reference: the plain accumulation into a copy of acc (a zeroed
          // one without), then this ISA's ordinary step on the fp32 sum.
          std::vector<float> sum(n, 0.f);
          if (with_acc) std::memcpy(sum.data(), acc.data() + aoff, n * 4);
          ref.accumulate[gi](sum.data(), g.data() + goff * gb, n);
          Arrays plain = init;
          KernelArgs pa = ArgsFor(plain, off, n, op, co);
          pa.grad = sum.data();
          t.step[int(op)][0][int(co)](pa, false);
          ASSERT_TRUE(SameBits(folded, plain));

          // The scalar folded kernel is the plain reference; every ISA
          // multiplies then adds as it does, so equals it bit for bit.
          Arrays scalar = init;
          KernelArgs sa = ArgsFor(scalar, off, n, op, co);
          sa.grad = fa.grad;
          sa.fold = fa.fold;
          ref.step_fold[int(op)][gi][int(co)](sa, false);
          ASSERT_TRUE(SameBits(folded, scalar));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(UsableIsas, FoldKernelTest, ::testing::ValuesIn(Tables()), TableName);

// ---- CpuOptimizer::StepMany with folded shards ------------------------------

std::unique_ptr<CpuOptimizer> MakeOpt(int threads) {
  Options o;
  o.threads = threads;
  o.block_elems = 1024;
  auto opt = CpuOptimizer::Create(o);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

// Two shards (one folded with an accumulator, one with none) over many
// blocks at odd offsets: the same bits as AccumulateMany then StepMany on
// the sums, for 1 and 2 threads, every grad dtype.
TEST(FoldApiTest, StepManyEqualsAccumulateThenStep) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const size_t n0 = 5003, n1 = 2049;
  for (DType gd : kDTypes) {
    SCOPED_TRACE(std::string(DTypeName(gd)));
    const std::vector<uint8_t> g = FiniteGrads(rng, n0 + n1, gd, 2.f);
    const std::vector<float> acc0 = FiniteAccs(rng, n0 + n1);
    const Arrays init = RandomArrays(rng, n0 + n1 + 1);
    HyperParams hp;
    hp.weight_decay = 0.01;
    hp.step = 3;
    hp.grad_scale = 0.5;
    auto shards = [&](Arrays& a, const void* grad, DType d, const float* fold_acc, bool fold) {
      std::vector<ShardStep> out(2);
      for (size_t k = 0; k < 2; ++k) {
        const size_t b = k == 0 ? 0 : n0, c = k == 0 ? n0 : n1;
        ShardStep& s = out[k];
        s.param = a.p.data() + 1 + b;
        s.exp_avg = a.s0.data() + 1 + b;
        s.exp_avg_sq = a.s1.data() + 1 + b;
        s.grad = static_cast<const uint8_t*>(grad) + b * DTypeSize(d);
        s.grad_dtype = d;
        s.count = c;
        s.copy_out = reinterpret_cast<uint16_t*>(a.copy.data()) + 1 + b;
        s.copy_dtype = DType::kBf16;
        s.hp = hp;
        s.fold = fold;
        s.fold_acc = (fold && k == 0) ? fold_acc : nullptr;  // shard 1: a zeroed accumulator
      }
      return out;
    };
    // Reference: accumulate (shard 1's accumulator zeroed), step on the sums.
    std::vector<float> sum(acc0.begin(), acc0.end());
    std::fill(sum.begin() + static_cast<std::ptrdiff_t>(n0), sum.end(), 0.f);
    auto ref_opt = MakeOpt(1);
    ASSERT_NE(ref_opt, nullptr);
    ASSERT_TRUE(ref_opt->Accumulate(sum.data(), g.data(), gd, n0 + n1).ok());
    Arrays want = init;
    ASSERT_TRUE(ref_opt->StepMany(shards(want, sum.data(), DType::kFp32, nullptr, false)).ok());
    for (int threads : {1, 2}) {
      auto opt = MakeOpt(threads);
      ASSERT_NE(opt, nullptr);
      Arrays got = init;
      ASSERT_TRUE(opt->StepMany(shards(got, g.data(), gd, acc0.data(), true)).ok());
      ASSERT_TRUE(SameBits(got, want)) << threads << " threads";
    }
  }
}

TEST(FoldApiTest, BadFoldDescriptorsAreRejected) {
  auto opt = MakeOpt(1);
  ASSERT_NE(opt, nullptr);
  std::vector<float> p(64, 0.5f), m(64), v(64), acc(64, 1.f);
  std::vector<uint16_t> g(64, 0);
  ShardStep s;
  s.param = p.data();
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  s.grad = g.data();
  s.grad_dtype = DType::kBf16;
  s.count = 64;
  s.fold = true;
  s.fold_acc = acc.data();
  s.check_finite = true;
  StatusOr<StepResult> r = opt->Step(s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().ToString().find("check_finite"), std::string::npos) << r.status();
  s.check_finite = false;
  s.fold_acc = p.data() + 8;  // overlaps param
  r = opt->Step(s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("fold_acc"), std::string::npos) << r.status();
  EXPECT_EQ(p[0], 0.5f);  // nothing written
}

}  // namespace
}  // namespace strata::cpu_adam
