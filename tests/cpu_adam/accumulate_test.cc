// Gradient accumulation (acc[i] += float(grad[i])): the kernels of every ISA
// usable here against the scalar loop, bit for bit, on fresh random data
// with fp16/bf16/fp32 specials (subnormals, ±inf, NaNs, -0), tails and odd
// sizes, unaligned starts; the roofline kernel; then the CpuOptimizer API:
// bitwise equality across thread counts (1, 2, 7) and with the plain loop,
// AccumulateMany over slices of one chunk, the inline path, validation, and
// Accumulate running concurrently with StepMany on the same optimizer.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "src/common/half.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/cpu_adam/kernel.h"
#include "tests/test_util.h"

namespace strata::cpu_adam {
namespace {

using internal::KernelTable;

constexpr DType kDTypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};

float Widen(const uint8_t* g, DType gd, size_t i) {
  if (gd == DType::kFp32) {
    float f;
    std::memcpy(&f, g + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, g + i * 2, 2);
  return gd == DType::kFp16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
}

// `n` gradients in dtype `gd`: mostly random values (fresh each call), with
// about one in eight a special: a random bit pattern (any exponent,
// subnormal, inf, NaN), a subnormal, ±inf, a quiet or signaling NaN, -0.
std::vector<uint8_t> RandomGrads(std::mt19937_64& rng, size_t n, DType gd) {
  const std::vector<float> vals = testing::RandomFloats(rng, n, -8.f, 8.f);
  std::vector<uint8_t> out(n * DTypeSize(gd));
  std::uniform_int_distribution<int> kind(0, 15);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t r = static_cast<uint32_t>(rng());
    uint32_t bits32 = FloatBits(vals[i]);
    uint16_t bits16 = gd == DType::kFp16 ? FloatToHalfBits(vals[i]) : FloatToBf16Bits(vals[i]);
    const bool half = gd == DType::kFp16;
    switch (kind(rng)) {
      case 0:  // random pattern
        bits32 = r;
        bits16 = static_cast<uint16_t>(r);
        break;
      case 1:  // subnormal
        bits32 = (r & 0x807fffffu) | 1u;
        bits16 = static_cast<uint16_t>((r & (half ? 0x83ffu : 0x807fu)) | 1u);
        break;
      case 2:  // ±inf
        bits32 = (r & 0x80000000u) | 0x7f800000u;
        bits16 = static_cast<uint16_t>((r & 0x8000u) | (half ? 0x7c00u : 0x7f80u));
        break;
      case 3:  // quiet NaN with a payload
        bits32 = (r & 0x803fffffu) | 0x7fc00000u;
        bits16 =
            static_cast<uint16_t>((r & (half ? 0x81ffu : 0x803fu)) | (half ? 0x7e00u : 0x7fc0u));
        break;
      case 4:  // signaling NaN (payload non-zero, quiet bit clear)
        bits32 = (r & 0x803fffffu) | 0x7f800001u;
        bits16 =
            static_cast<uint16_t>((r & (half ? 0x81ffu : 0x803fu)) | (half ? 0x7c01u : 0x7f81u));
        break;
      case 5:  // -0
        bits32 = 0x80000000u;
        bits16 = 0x8000u;
        break;
      default:
        break;
    }
    if (gd == DType::kFp32)
      std::memcpy(out.data() + i * 4, &bits32, 4);
    else
      std::memcpy(out.data() + i * 2, &bits16, 2);
  }
  return out;
}

// `n` accumulators: random values with a few specials (subnormal, inf, NaN,
// large values that overflow to inf when added to).
std::vector<float> RandomAccs(std::mt19937_64& rng, size_t n) {
  std::vector<float> a = testing::RandomFloats(rng, n, -100.f, 100.f);
  std::uniform_int_distribution<int> kind(0, 31);
  for (float& x : a) {
    switch (kind(rng)) {
      case 0:
        x = BitsFloat((static_cast<uint32_t>(rng()) & 0x807fffffu) | 1u);
        break;  // subnormal
      case 1:
        x = -std::numeric_limits<float>::infinity();
        break;
      case 2:
        x = std::numeric_limits<float>::quiet_NaN();
        break;
      case 3:
        x = std::numeric_limits<float>::max();
        break;
      case 4:
        x = -0.f;
        break;
      default:
        break;
    }
  }
  return a;
}

std::string Hex(float f) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", FloatBits(f));
  return buf;
}

// `got` is what the plain loop gives for acc_before + g: the same bits, or,
// when both inputs are NaN, a NaN: x86 keeps the first operand's payload
// and the compiler may order a commutative add either way (seen: the SSE4.2
// kernel keeps the grad's payload where the scalar loop keeps acc's).
::testing::AssertionResult SameAsLoop(float got, float want, float acc_before, float g) {
  if (FloatBits(got) == FloatBits(want)) return ::testing::AssertionSuccess();
  if (std::isnan(acc_before) && std::isnan(g) && std::isnan(got))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << Hex(got) << " want " << Hex(want) << " (acc "
                                       << Hex(acc_before) << " + grad " << Hex(g) << ")";
}

// ---- Kernel tables ---------------------------------------------------------

std::vector<const KernelTable*> Tables() { return internal::UsableTables(); }

std::string TableName(const ::testing::TestParamInfo<const KernelTable*>& info) {
  std::string n(info.param->isa);
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

class AccumulateKernelTest : public ::testing::TestWithParam<const KernelTable*> {};

// The scalar loop itself against `acc + widen(grad)` written here.
TEST(AccumulateScalarTest, IsThePlainLoop) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const size_t n = 4099;
  for (DType gd : kDTypes) {
    SCOPED_TRACE(std::string(DTypeName(gd)));
    const std::vector<uint8_t> g = RandomGrads(rng, n, gd);
    const std::vector<float> before = RandomAccs(rng, n);
    std::vector<float> acc = before;
    internal::ScalarTable().accumulate[static_cast<int>(gd)](acc.data(), g.data(), n);
    for (size_t i = 0; i < n; ++i) {
      const float w = Widen(g.data(), gd, i);
      const float want = before[i] + w;
      ASSERT_TRUE(SameAsLoop(acc[i], want, before[i], w)) << "i=" << i;
    }
  }
}

// Every size 0..100 and some odd large ones, acc and grad starting at
// independent unaligned offsets; nothing outside [0, n) is touched.
TEST_P(AccumulateKernelTest, BitwiseEqualToScalarLoop) {
  const KernelTable& t = *GetParam();
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 100; ++n) sizes.push_back(n);
  for (size_t n : {255, 256, 257, 1023, 1024, 1025, 4097, 65537 + 13}) sizes.push_back(n);
  std::uniform_int_distribution<size_t> off_dist(0, 17);
  for (DType gd : kDTypes) {
    const int gi = static_cast<int>(gd);
    const size_t gb = DTypeSize(gd);
    for (size_t n : sizes) {
      const size_t ao = off_dist(rng), go = off_dist(rng);
      SCOPED_TRACE(std::string(t.isa) + " " + std::string(DTypeName(gd)) +
                   " n=" + std::to_string(n) + " acc_off=" + std::to_string(ao) +
                   " grad_off=" + std::to_string(go));
      const size_t guard = 8;
      const std::vector<uint8_t> g = RandomGrads(rng, n + go + guard, gd);
      const std::vector<float> before = RandomAccs(rng, n + ao + guard);
      std::vector<float> simd = before, plain = before;
      t.accumulate[gi](simd.data() + ao, g.data() + go * gb, n);
      internal::ScalarTable().accumulate[gi](plain.data() + ao, g.data() + go * gb, n);
      for (size_t i = 0; i < simd.size(); ++i) {
        if (i < ao || i >= ao + n) {
          ASSERT_EQ(FloatBits(simd[i]), FloatBits(before[i])) << "touched outside at " << i;
          continue;
        }
        ASSERT_TRUE(SameAsLoop(simd[i], plain[i], before[i], Widen(g.data() + go * gb, gd, i - ao)))
            << "element " << i - ao;
      }
    }
  }
}

// The roofline kernel reads the same arrays and leaves acc's bits alone.
TEST_P(AccumulateKernelTest, RooflineLeavesAccUnchanged) {
  const KernelTable& t = *GetParam();
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  for (DType gd : kDTypes) {
    for (size_t n : {0, 1, 7, 31, 1000, 4099}) {
      const std::vector<uint8_t> g = RandomGrads(rng, n + 1, gd);
      const std::vector<float> before = RandomAccs(rng, n + 1);
      std::vector<float> acc = before;
      t.accumulate_roofline[static_cast<int>(gd)](acc.data() + 1, g.data() + DTypeSize(gd), n);
      ASSERT_EQ(0, std::memcmp(acc.data(), before.data(), acc.size() * 4))
          << DTypeName(gd) << " n=" << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(UsableIsas, AccumulateKernelTest, ::testing::ValuesIn(Tables()),
                         TableName);

// ---- CpuOptimizer::Accumulate / AccumulateMany ------------------------------

std::unique_ptr<CpuOptimizer> MakeOpt(const std::string& isa, int threads, size_t inline_elems = 0,
                                      size_t block = 1024) {
  Options o;
  o.isa = isa;
  o.threads = threads;
  o.block_elems = block;
  o.accumulate_inline_elems = inline_elems;
  auto opt = CpuOptimizer::Create(o);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

std::vector<std::string> IsaNames() {
  std::vector<std::string> out;
  for (std::string_view s : AvailableIsas()) out.emplace_back(s);
  return out;
}

std::string IsaName(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

class AccumulateApiTest : public ::testing::TestWithParam<std::string> {};

// Many blocks at an odd offset, accumulated twice (two micro-batches): the
// same bits for 1, 2 and 7 threads, and the same as the plain loop.
TEST_P(AccumulateApiTest, BitwiseAcrossThreadCountsAndEqualToLoop) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const size_t n = 100003, off = 3;
  for (DType gd : kDTypes) {
    SCOPED_TRACE(GetParam() + " " + std::string(DTypeName(gd)));
    const size_t gb = DTypeSize(gd);
    const std::vector<uint8_t> g1 = RandomGrads(rng, n + off, gd),
                               g2 = RandomGrads(rng, n + off, gd);
    const std::vector<float> before = RandomAccs(rng, n + off);
    // The plain loop.
    std::vector<float> want = before;
    for (size_t i = 0; i < n; ++i) want[off + i] += Widen(g1.data() + off * gb, gd, i);
    for (size_t i = 0; i < n; ++i) want[off + i] += Widen(g2.data() + off * gb, gd, i);
    std::vector<std::vector<float>> results;
    for (int threads : {1, 2, 7}) {
      auto opt = MakeOpt(GetParam(), threads);
      ASSERT_NE(opt, nullptr);
      std::vector<float> acc = before;
      ASSERT_TRUE(opt->Accumulate(acc.data() + off, g1.data() + off * gb, gd, n).ok());
      ASSERT_TRUE(opt->Accumulate(acc.data() + off, g2.data() + off * gb, gd, n).ok());
      results.push_back(std::move(acc));
    }
    for (size_t r = 1; r < results.size(); ++r)
      EXPECT_EQ(0, std::memcmp(results[0].data(), results[r].data(), (n + off) * 4)) << "run " << r;
    for (size_t i = 0; i < off; ++i) EXPECT_EQ(FloatBits(results[0][i]), FloatBits(before[i]));
    size_t bad = 0;
    for (size_t i = off; i < n + off && bad < 5; ++i) {
      // With two NaN inputs the payload may differ from the loop's; NaN it is.
      const bool ok = FloatBits(results[0][i]) == FloatBits(want[i]) ||
                      (std::isnan(want[i]) && std::isnan(results[0][i]));
      if (!ok) {
        ++bad;
        ADD_FAILURE() << "element " << i - off << ": " << Hex(results[0][i]) << " want "
                      << Hex(want[i]);
      }
    }
  }
}

// Slices of one chunk (mixed dtypes, sizes, an empty one, packed back to back
// in one staging buffer at odd byte offsets) in one call: each slice as the
// plain loop; the accumulator between slices untouched. Inline (default
// threshold) and in the arena.
TEST_P(AccumulateApiTest, ManySlicesOfOneChunk) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Slice {
    DType gd;
    size_t count, acc_gap;
  };
  const Slice slices[] = {{DType::kBf16, 5000, 1}, {DType::kFp32, 3, 0},
                          {DType::kFp16, 0, 2},    {DType::kFp16, 20011, 5},
                          {DType::kBf16, 17, 3},   {DType::kFp32, 40960, 7},
                          {DType::kBf16, 1, 0},    {DType::kBf16, 131073, 1}};
  size_t acc_len = 0, staging_bytes = 4;  // grads start 4 bytes in (not vector-aligned)
  for (const Slice& s : slices) {
    acc_len += s.acc_gap + s.count;
    staging_bytes += s.count * DTypeSize(s.gd);
  }
  std::vector<uint8_t> staging(staging_bytes);
  {  // Fill the staging buffer slice by slice with each slice's dtype.
    size_t b = 4;
    for (const Slice& s : slices) {
      const std::vector<uint8_t> g = RandomGrads(rng, s.count, s.gd);
      if (!g.empty()) std::memcpy(staging.data() + b, g.data(), g.size());
      b += g.size();
    }
  }
  const std::vector<float> before = RandomAccs(rng, acc_len + 4);
  for (size_t inline_elems : {size_t{0}, size_t{1} << 30}) {
    for (int threads : {1, 2, 7}) {
      SCOPED_TRACE(GetParam() + " threads " + std::to_string(threads) + " inline " +
                   std::to_string(inline_elems));
      auto opt = MakeOpt(GetParam(), threads, inline_elems);
      ASSERT_NE(opt, nullptr);
      std::vector<float> acc = before, want = before;
      std::vector<AccumulateShard> shards;
      size_t a = 0, b = 4;
      for (const Slice& s : slices) {
        a += s.acc_gap;
        shards.push_back({acc.data() + a, staging.data() + b, s.gd, s.count});
        for (size_t i = 0; i < s.count; ++i) want[a + i] += Widen(staging.data() + b, s.gd, i);
        a += s.count;
        b += s.count * DTypeSize(s.gd);
      }
      ASSERT_TRUE(opt->AccumulateMany(shards).ok());
      for (size_t i = 0; i < acc.size(); ++i) {
        const bool ok =
            FloatBits(acc[i]) == FloatBits(want[i]) || (std::isnan(want[i]) && std::isnan(acc[i]));
        ASSERT_TRUE(ok) << "acc[" << i << "] " << Hex(acc[i]) << " want " << Hex(want[i]);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(UsableIsas, AccumulateApiTest, ::testing::ValuesIn(IsaNames()), IsaName);

// Small calls take the inline path (no arena entry: no thread gets pinned),
// large ones the arena; both give the loop's bits.
TEST(AccumulateInlineTest, SmallCallsStayOnTheCallersThread) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  Options o;
  o.threads = 2;
  o.numa_node = 0;  // pinned: arena entries are counted
  auto opt = CpuOptimizer::Create(o);
  if (!opt.ok()) GTEST_SKIP() << "cannot pin here: " << opt.status();
  const size_t small = 4000, large = 3 * o.block_elems + 5;
  auto g = testing::RandomFloats(rng, large);
  auto acc = testing::RandomFloats(rng, large);
  auto want = acc;
  for (size_t i = 0; i < small; ++i) want[i] += g[i];
  const uint64_t entries0 = (*opt)->pinned_thread_entries();
  ASSERT_TRUE((*opt)->Accumulate(acc.data(), g.data(), DType::kFp32, small).ok());
  EXPECT_EQ((*opt)->pinned_thread_entries(), entries0);  // the arena was not entered
  EXPECT_EQ(0, std::memcmp(acc.data(), want.data(), large * 4));
  for (size_t i = 0; i < large; ++i) want[i] += g[i];
  ASSERT_TRUE((*opt)->Accumulate(acc.data(), g.data(), DType::kFp32, large).ok());
  EXPECT_GT((*opt)->pinned_thread_entries(), entries0);
  EXPECT_EQ(0, std::memcmp(acc.data(), want.data(), large * 4));
}

TEST(AccumulateRooflineTest, OptionLeavesAccUnchanged) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  Options o;
  o.threads = 2;
  o.block_elems = 1024;
  o.accumulate_inline_elems = 0;
  o.roofline_kernel = true;
  auto opt = CpuOptimizer::Create(o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  const size_t n = 10007;
  for (DType gd : kDTypes) {
    const auto g = RandomGrads(rng, n, gd);
    const auto before = RandomAccs(rng, n);
    auto acc = before;
    ASSERT_TRUE((*opt)->Accumulate(acc.data(), g.data(), gd, n).ok());
    EXPECT_EQ(0, std::memcmp(acc.data(), before.data(), n * 4)) << DTypeName(gd);
  }
}

TEST(AccumulateValidationTest, BadArgumentsAreRejectedBeforeAnyWrite) {
  auto opt = MakeOpt("auto", 2);
  ASSERT_NE(opt, nullptr);
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  std::vector<float> acc = testing::RandomFloats(rng, 4096), g = testing::RandomFloats(rng, 4096);
  const std::vector<float> before = acc;
  auto invalid = [&](const Status& s, const std::string& needle) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(needle), std::string::npos) << s;
    EXPECT_EQ(acc, before);
  };
  invalid(opt->Accumulate(nullptr, g.data(), DType::kFp32, 10), "acc is null");
  invalid(opt->Accumulate(acc.data(), nullptr, DType::kBf16, 10), "grad is null");
  invalid(opt->Accumulate(acc.data(), g.data(), static_cast<DType>(7), 10), "grad_dtype");
  invalid(opt->Accumulate(acc.data(), acc.data() + 5, DType::kFp32, 10), "acc and grad overlap");
  invalid(opt->Accumulate(acc.data() + 5, acc.data(), DType::kBf16, 20), "acc and grad overlap");
  // Zero elements: nothing to do, null pointers allowed.
  EXPECT_TRUE(opt->Accumulate(nullptr, nullptr, DType::kFp16, 0).ok());
  EXPECT_TRUE(opt->AccumulateMany({}).ok());
  // A good shard first, then a bad one: the good one is not written either.
  {
    const AccumulateShard s[] = {{acc.data(), g.data(), DType::kFp32, 100},
                                 {acc.data() + 200, nullptr, DType::kFp32, 5}};
    invalid(opt->AccumulateMany(s), "shard 1");
  }
  {  // Two shards writing overlapping accumulators.
    const AccumulateShard s[] = {{acc.data() + 100, g.data(), DType::kFp32, 100},
                                 {acc.data() + 1000, g.data(), DType::kFp32, 100},
                                 {acc.data() + 150, g.data() + 200, DType::kFp32, 10}};
    invalid(opt->AccumulateMany(s), "shards 0 and 2");
  }
  {  // One shard's grad is another's acc.
    const AccumulateShard s[] = {{acc.data(), g.data(), DType::kFp32, 100},
                                 {acc.data() + 1000, acc.data() + 50, DType::kBf16, 10}};
    invalid(opt->AccumulateMany(s), "shard 1: grad overlaps the acc of shard 0");
  }
  {  // Adjacent (not overlapping) and shared read-only grads are fine.
    const AccumulateShard s[] = {{acc.data(), g.data(), DType::kFp32, 100},
                                 {acc.data() + 100, g.data(), DType::kFp32, 100}};
    EXPECT_TRUE(opt->AccumulateMany(s).ok());
    for (size_t i = 0; i < 200; ++i)
      ASSERT_EQ(FloatBits(acc[i]), FloatBits(before[i] + g[i % 100]));
  }
}

// The scheduler's pattern: the gradient thread accumulates while the
// optimizer thread steps shards on the same CpuOptimizer. Both finish, and
// both give exactly what they give alone.
TEST(AccumulateConcurrencyTest, ConcurrentWithStepManyOnTheSameOptimizer) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const size_t n_step = 200000, n_acc = 150001;
  const int rounds = 6;
  const auto p0 = testing::RandomFloats(rng, n_step),
             m0 = testing::RandomFloats(rng, n_step, -0.1f, 0.1f),
             v0 = testing::RandomFloats(rng, n_step, 1e-6f, 1e-2f),
             sg = testing::RandomFloats(rng, n_step);
  const auto acc0 = testing::RandomFloats(rng, n_acc);
  std::vector<std::vector<uint8_t>> grads;
  for (int r = 0; r < rounds; ++r) grads.push_back(RandomGrads(rng, n_acc, DType::kBf16));
  struct Out {
    std::vector<float> p, m, v, acc;
  };
  auto run = [&](CpuOptimizer& opt, bool concurrent) {
    Out o{p0, m0, v0, acc0};
    auto step = [&] {
      for (int r = 0; r < rounds; ++r) {
        ShardStep s[2];
        for (int k = 0; k < 2; ++k) {
          const size_t half = n_step / 2, off = k * half;
          s[k].param = o.p.data() + off;
          s[k].grad = sg.data() + off;
          s[k].exp_avg = o.m.data() + off;
          s[k].exp_avg_sq = o.v.data() + off;
          s[k].count = half;
          s[k].hp.step = r + 1;
        }
        auto rs = opt.StepMany(s);
        ASSERT_TRUE(rs.ok()) << rs.status();
      }
    };
    auto accumulate = [&] {
      for (int r = 0; r < rounds; ++r) {
        // Alternate one call and a two-slice call.
        if (r % 2 == 0) {
          ASSERT_TRUE(opt.Accumulate(o.acc.data(), grads[r].data(), DType::kBf16, n_acc).ok());
        } else {
          const size_t cut = 4097;
          const AccumulateShard s[] = {
              {o.acc.data(), grads[r].data(), DType::kBf16, cut},
              {o.acc.data() + cut, grads[r].data() + cut * 2, DType::kBf16, n_acc - cut}};
          ASSERT_TRUE(opt.AccumulateMany(s).ok());
        }
      }
    };
    if (concurrent) {
      std::thread t(step);
      accumulate();
      t.join();
    } else {
      step();
      accumulate();
    }
    return o;
  };
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    auto opt = MakeOpt("auto", threads, 65536, 4096);
    ASSERT_NE(opt, nullptr);
    const Out alone = run(*opt, false);
    for (int trial = 0; trial < 3; ++trial) {
      const Out both = run(*opt, true);
      EXPECT_EQ(0, std::memcmp(both.p.data(), alone.p.data(), n_step * 4));
      EXPECT_EQ(0, std::memcmp(both.m.data(), alone.m.data(), n_step * 4));
      EXPECT_EQ(0, std::memcmp(both.v.data(), alone.v.data(), n_step * 4));
      EXPECT_EQ(0, std::memcmp(both.acc.data(), alone.acc.data(), n_acc * 4));
    }
  }
}

}  // namespace
}  // namespace strata::cpu_adam
