// fp16/bf16 conversions against independent references over all 65,536 bit
// patterns: exact decode (checked against ldexp arithmetic), round trips,
// ties to even at every midpoint between neighbours, NaN/inf/subnormals, and
// (where the CPU has F16C) the hardware converter on random floats.
#include "src/common/half.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <random>

namespace strata {
namespace {

// Decode an fp16 pattern with plain arithmetic.
double RefHalfToDouble(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  if (exp == 31) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(man, -24);
  return sign * std::ldexp(1024 + man, exp - 25);
}

double RefBf16ToDouble(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 7) & 0xff;
  const int man = h & 0x7f;
  if (exp == 255) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(man, -133);
  return sign * std::ldexp(128 + man, exp - 134);
}

float NextUp(float f) { return std::nextafter(f, INFINITY); }
float NextDown(float f) { return std::nextafter(f, -INFINITY); }

TEST(HalfTest, DecodeAllPatternsMatchesArithmetic) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const double ref = RefHalfToDouble(h);
    const float got = HalfBitsToFloat(h);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << i;
      EXPECT_EQ(std::signbit(got), bool(h & 0x8000)) << i;
    } else {
      EXPECT_EQ(static_cast<double>(got), ref) << i;
      EXPECT_EQ(std::signbit(got), bool(h & 0x8000)) << i;  // -0 stays -0
    }
  }
}

TEST(HalfTest, EncodeRoundTripsEveryPattern) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t back = FloatToHalfBits(HalfBitsToFloat(h));
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
      EXPECT_EQ(back & 0x7c00, 0x7c00) << i;  // NaN stays NaN (quieted)
      EXPECT_NE(back & 0x3ff, 0) << i;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << i;
    } else {
      EXPECT_EQ(back, h) << i;
    }
  }
}

TEST(HalfTest, MidpointsRoundToEvenAndNeighboursRoundToNearest) {
  // For each pair of adjacent finite non-negative halves, the float midpoint
  // is exact; it must go to the even pattern, one float ulp either side to
  // the nearer one. Negative values mirror through the sign bit.
  for (uint32_t i = 0; i < 0x7bff; ++i) {
    for (uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
      const uint16_t lo = static_cast<uint16_t>(i) | sign;
      const uint16_t hi = static_cast<uint16_t>(i + 1) | sign;
      const float mid = static_cast<float>((RefHalfToDouble(lo) + RefHalfToDouble(hi)) / 2);
      ASSERT_EQ(static_cast<double>(mid), (RefHalfToDouble(lo) + RefHalfToDouble(hi)) / 2);
      const uint16_t even = (lo & 1) ? hi : lo;
      EXPECT_EQ(FloatToHalfBits(mid), even) << "i=" << i;
      const float toward_lo = sign ? NextUp(mid) : NextDown(mid);
      const float toward_hi = sign ? NextDown(mid) : NextUp(mid);
      EXPECT_EQ(FloatToHalfBits(toward_lo), lo) << "i=" << i;
      EXPECT_EQ(FloatToHalfBits(toward_hi), hi) << "i=" << i;
    }
  }
}

TEST(HalfTest, OverflowUnderflowAndSpecials) {
  EXPECT_EQ(FloatToHalfBits(65504.f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65519.99f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.f), 0x7c00);  // tie between 65504 and 2^16 → even = inf
  EXPECT_EQ(FloatToHalfBits(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(INFINITY), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-INFINITY), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.f, -25)), 0x0000);  // tie with 0 → 0
  EXPECT_EQ(FloatToHalfBits(NextUp(std::ldexp(1.f, -25))), 0x0001);
  EXPECT_EQ(FloatToHalfBits(-std::ldexp(1.f, -26)), 0x8000);  // -0
  EXPECT_EQ(FloatToHalfBits(1e-40f), 0x0000);                 // fp32 subnormal
  EXPECT_EQ(FloatToHalfBits(0.f), 0x0000);
  EXPECT_EQ(FloatToHalfBits(-0.f), 0x8000);
  const uint16_t n = FloatToHalfBits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(HalfBitsToFloat(n)));
  const uint16_t sn = FloatToHalfBits(-std::numeric_limits<float>::signaling_NaN());
  EXPECT_TRUE(std::isnan(HalfBitsToFloat(sn)));
  EXPECT_EQ(sn & 0x8000, 0x8000);
}

__attribute__((target("f16c"))) uint16_t HardwareHalf(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(HalfTest, MatchesF16cOnRandomFloats) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C to compare against";
  std::mt19937 rng(std::random_device{}());
  for (int i = 0; i < 2'000'000; ++i) {
    // Random bit patterns concentrated in fp16's range (exponents 100..150).
    uint32_t bits = rng();
    bits = (bits & 0x807fffffu) | ((100u + bits % 51u) << 23);
    const float f = BitsFloat(bits);
    ASSERT_EQ(FloatToHalfBits(f), HardwareHalf(f)) << "bits=0x" << std::hex << bits;
  }
}

TEST(Bf16Test, DecodeAllPatternsMatchesArithmetic) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const double ref = RefBf16ToDouble(h);
    const float got = Bf16BitsToFloat(h);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << i;
    } else {
      EXPECT_EQ(static_cast<double>(got), ref) << i;
    }
    EXPECT_EQ(std::signbit(got), bool(h & 0x8000)) << i;
  }
}

TEST(Bf16Test, RoundTripsMidpointsAndSpecials) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t back = FloatToBf16Bits(Bf16BitsToFloat(h));
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) {
      EXPECT_TRUE(std::isnan(Bf16BitsToFloat(back))) << i;
      continue;
    }
    EXPECT_EQ(back, h) << i;
    // Midpoint to the next pattern of larger magnitude (finite ones only).
    if ((h & 0x7fff) >= 0x7f7f) continue;
    const uint16_t hi = static_cast<uint16_t>(h + 1);
    const double mid_d = (RefBf16ToDouble(h) + RefBf16ToDouble(hi)) / 2;
    const float mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d);
    EXPECT_EQ(FloatToBf16Bits(mid), (h & 1) ? hi : h) << i;
    const bool neg = h & 0x8000;
    EXPECT_EQ(FloatToBf16Bits(neg ? NextUp(mid) : NextDown(mid)), h) << i;
    EXPECT_EQ(FloatToBf16Bits(neg ? NextDown(mid) : NextUp(mid)), hi) << i;
  }
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(FloatToBf16Bits(-INFINITY), 0xff80);
  EXPECT_TRUE(
      std::isnan(Bf16BitsToFloat(FloatToBf16Bits(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload is only in the low 16 bits must not become inf.
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(FloatToBf16Bits(BitsFloat(0x7f800001u)))));
}

}  // namespace
}  // namespace strata
