// Every vector conversion of every ISA usable here against the scalar
// reference in src/common/half.h: all 65,536 fp16/bf16 patterns, random bit
// patterns, exact ties, and the special values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "src/common/half.h"
#include "src/common/log.h"
#include "src/cpu_adam/kernel.h"
#include "tests/test_util.h"

namespace strata::cpu_adam::internal {
namespace {

bool IsNanF(float f) { return std::isnan(f); }
bool IsNanHalf(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool IsNanBf16(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; }

std::vector<float> TestFloats() {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  std::vector<float> v;
  // Random bit patterns: every exponent, NaNs, infinities, subnormals.
  for (int i = 0; i < 200000; ++i) v.push_back(BitsFloat(static_cast<uint32_t>(rng())));
  // Random values in the fp16 range, including subnormal halves.
  for (float x : testing::RandomFloats(rng, 50000, -70000.f, 70000.f)) v.push_back(x);
  for (float x : testing::RandomFloats(rng, 50000, -1e-4f, 1e-4f)) v.push_back(x);
  // Exact ties between neighbouring fp16 values and between bf16 values,
  // and one float either side of each tie.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double a = HalfBitsToFloat(static_cast<uint16_t>(h));
    const double b = HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact in fp32
    v.push_back(mid);
    v.push_back(-mid);
    v.push_back(std::nextafter(mid, 0.f));
    v.push_back(std::nextafter(mid, 1e30f));
  }
  for (uint32_t h = 0; h < 0x7f80; h += 7) {
    v.push_back(BitsFloat((h << 16) | 0x8000u));  // bf16 tie
    v.push_back(BitsFloat((h << 16) | 0x8001u));
    v.push_back(BitsFloat((h << 16) | 0x7fffu));
  }
  const float specials[] = {0.f, -0.f, 65504.f, 65519.99f, 65520.f, -65520.f, 1e-8f, 5.96e-8f, 2.98e-8f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()};
  for (float s : specials) v.push_back(s);
  return v;
}

class ConversionTest : public ::testing::TestWithParam<const KernelTable*> {};

TEST_P(ConversionTest, HalfToFloatAllPatterns) {
  const KernelTable& t = *GetParam();
  std::vector<uint16_t> in(65536);
  for (uint32_t i = 0; i < 65536; ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(in.size() + 1, 1.f);
  t.f16_to_f32(in.data(), out.data() + 1, in.size());  // unaligned destination
  for (uint32_t i = 0; i < 65536; ++i) {
    const float want = HalfBitsToFloat(in[i]);
    if (IsNanF(want)) {
      ASSERT_TRUE(IsNanF(out[i + 1])) << std::hex << i;
    } else {
      ASSERT_EQ(FloatBits(out[i + 1]), FloatBits(want)) << std::hex << i;
    }
  }
}

TEST_P(ConversionTest, Bf16ToFloatAllPatterns) {
  const KernelTable& t = *GetParam();
  std::vector<uint16_t> in(65536);
  for (uint32_t i = 0; i < 65536; ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(in.size());
  t.bf16_to_f32(in.data(), out.data(), in.size());
  for (uint32_t i = 0; i < 65536; ++i) ASSERT_EQ(FloatBits(out[i]), FloatBits(Bf16BitsToFloat(in[i]))) << std::hex << i;
}

TEST_P(ConversionTest, FloatToHalfMatchesReference) {
  const KernelTable& t = *GetParam();
  const std::vector<float> in = TestFloats();
  std::vector<uint16_t> out(in.size());
  t.f32_to_f16(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = FloatToHalfBits(in[i]);
    if (IsNanHalf(want)) {
      ASSERT_TRUE(IsNanHalf(out[i])) << std::hex << FloatBits(in[i]);
      ASSERT_EQ(out[i] & 0x8000, want & 0x8000);
    } else {
      ASSERT_EQ(out[i], want) << "input bits 0x" << std::hex << FloatBits(in[i]) << " value " << in[i];
    }
  }
}

TEST_P(ConversionTest, FloatToBf16MatchesReference) {
  const KernelTable& t = *GetParam();
  const std::vector<float> in = TestFloats();
  std::vector<uint16_t> out(in.size());
  t.f32_to_bf16(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = FloatToBf16Bits(in[i]);
    if (IsNanBf16(want)) {
      ASSERT_TRUE(IsNanBf16(out[i])) << std::hex << FloatBits(in[i]);
    } else {
      ASSERT_EQ(out[i], want) << "input bits 0x" << std::hex << FloatBits(in[i]);
    }
  }
}

std::string IsaName(const ::testing::TestParamInfo<const KernelTable*>& info) {
  std::string n(info.param->isa);
  for (char& c : n) if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(UsableIsas, ConversionTest, ::testing::ValuesIn(UsableTables()), IsaName);

TEST(DispatchTest, ScalarAlwaysUsableAndLast) {
  const auto tables = UsableTables();
  ASSERT_FALSE(tables.empty());
  EXPECT_EQ(tables.back()->isa, "scalar");
  EXPECT_EQ(tables.back()->lanes, 1u);
}

TEST(DispatchTest, UnknownIsaIsInvalidArgument) {
  auto t = SelectTable("avx9000");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("avx9000"), std::string_view::npos);
}

TEST(DispatchTest, MissingIsaIsNotSupportedAndNamesTheUsableOnes) {
  // Whichever named ISA is not usable here must be refused, not silently replaced.
  const auto tables = UsableTables();
  for (const char* name : {"avx512", "avx2", "sse4.2"}) {
    bool usable = false;
    for (const KernelTable* t : tables) {
      if (t->isa == name || (std::string_view(name) == "avx2" && t->isa == "avx2+fma")) usable = true;
    }
    auto got = SelectTable(name);
    if (usable) {
      EXPECT_TRUE(got.ok()) << name;
    } else {
      ASSERT_FALSE(got.ok()) << name;
      EXPECT_EQ(got.status().code(), StatusCode::kNotSupported);
      EXPECT_NE(got.status().message().find("scalar"), std::string_view::npos);
    }
  }
  auto best = SelectTable("auto");
  ASSERT_TRUE(best.ok());
  EXPECT_EQ(*best, tables.front());
}

}  // namespace
}  // namespace strata::cpu_adam::internal

namespace strata::cpu_adam::internal {
namespace {

// STRATA_CPU_ISA names the ISA "auto" resolves to for the whole process;
// the fallback to the plain loop is explicit and announced once; an unknown
// or unsupported name is refused naming the variable and the choices.
TEST(DispatchTest, StrataCpuIsaPicksTheTableAndScalarIsLoggedOnce) {
  ASSERT_EQ(0, setenv("STRATA_CPU_ISA", "scalar", 1));
  auto t = SelectTable("auto");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->isa, "scalar");
  EXPECT_FALSE(FirstTimeFor("cpu_adam.scalar_fallback")) << "the fallback was not logged";
  for (const KernelTable* u : UsableTables()) {
    const std::string name = u->isa == "avx2+fma" ? "avx2" : std::string(u->isa);
    ASSERT_EQ(0, setenv("STRATA_CPU_ISA", name.c_str(), 1));
    auto s = SelectTable("auto");
    ASSERT_TRUE(s.ok()) << name << ": " << s.status();
    EXPECT_EQ(*s, u) << name;
    // A named request is not overridden.
    auto sc = SelectTable("scalar");
    ASSERT_TRUE(sc.ok());
    EXPECT_EQ((*sc)->isa, "scalar");
  }
  ASSERT_EQ(0, setenv("STRATA_CPU_ISA", "neon", 1));
  auto bad = SelectTable("auto");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("STRATA_CPU_ISA"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("avx512, avx2, sse4.2, scalar"), std::string::npos);
  bool have512 = false;
  for (const KernelTable* u : UsableTables()) have512 |= u->isa == "avx512";
  if (!have512) {
    ASSERT_EQ(0, setenv("STRATA_CPU_ISA", "avx512", 1));
    auto no = SelectTable("auto");
    ASSERT_FALSE(no.ok());
    EXPECT_EQ(no.status().code(), StatusCode::kNotSupported);
    EXPECT_NE(no.status().message().find("usable here"), std::string::npos) << no.status();
  }
  ASSERT_EQ(0, setenv("STRATA_CPU_ISA", "auto", 1));
  auto a = SelectTable("auto");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, UsableTables().front());
  ASSERT_EQ(0, unsetenv("STRATA_CPU_ISA"));
  auto best = SelectTable("auto");
  ASSERT_TRUE(best.ok());
  EXPECT_EQ(*best, UsableTables().front());
}

}  // namespace
}  // namespace strata::cpu_adam::internal
