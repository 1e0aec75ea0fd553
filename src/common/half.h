// fp16 (IEEE binary16) and bf16 (bfloat16) as uint16_t bit patterns, with
// scalar conversions to and from fp32. Float→half rounds to nearest, ties to
// even; NaN stays NaN (quiet, sign kept), overflow becomes ±inf, values below
// the smallest subnormal round to ±0. Half→float is exact. These are the
// reference conversions: vectorized and GPU versions are tested against them.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace strata {

inline uint32_t FloatBits(float f) { return std::bit_cast<uint32_t>(f); }
inline float BitsFloat(uint32_t u) { return std::bit_cast<float>(u); }

// fp32 → bf16: keep the top 16 bits, rounding the dropped 16 to nearest even.
inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN→quiet
  uint32_t lsb = (u >> 16) & 1u;                        // ties go to the even result
  u += 0x7fffu + lsb;  // may carry into the exponent: correct (rounds up to inf)
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16BitsToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// fp32 → fp16 with round-to-nearest-even, including subnormal results.
inline uint16_t FloatToHalfBits(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // ≥ 65520 rounds to inf (and inf stays inf)
  if (abs < 0x38800000u) {
    // Result is subnormal in fp16 (|f| < 2^-14) or zero. Value = mant * 2^(e-150);
    // fp16 subnormal unit is 2^-24, so shift right by (126 - e) after adding
    // the implicit bit: half_mant = round(m * 2^(e-126)).
    const uint32_t e = abs >> 23;
    if (e < 102) return sign;  // < 2^-25: rounds to zero (2^-25 exactly is a tie → even 0)
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t half_m = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u)))
      ++half_m;  // may become the min normal: fine
    return sign | static_cast<uint16_t>(half_m);
  }
  // Normal: rebias exponent (127 → 15) and round the 13 dropped mantissa bits.
  uint32_t h = abs - (112u << 23);
  const uint32_t lsb = (h >> 13) & 1u;
  h += 0xfffu + lsb;
  return sign | static_cast<uint16_t>(h >> 13);
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    // ±0 or subnormal: man * 2^-24, exact in fp32.
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (man << 13));  // inf / NaN
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace strata
