// The compact optimizer-state formats' scalar codes, shared by the CPU
// optimizer (src/cpu_adam) and the device Adam (src/gpu's host reference
// and CUDA kernel): the 8-bit moment codes of the int8 format, the per-block
// scales, and the stochastic rounding of a bf16 master. One definition, so
// that every backend gives the same bits: src/cpu_adam's vector kernels
// compute the same integer and float operations lane by lane and are tested
// against these bit for bit.
//
// Every float operation here is a single IEEE operation (no library call),
// and the only multiply followed by an add (the subnormal codes' y * 2^k +
// 2^23) multiplies by a power of two, which is exact: a fused multiply-add
// gives the same result, so nvcc's contraction changes nothing.
// Plain header: no project includes, so nvcc sees nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

namespace strata::codes {

// int8: elements per quantization block (one fp32 scale per moment per
// block). Blocks are aligned to the global element index.
inline constexpr size_t kQuantBlock = 256;
// int8 exp_avg: a signed 8-bit float code, 1 sign, 4 exponent (bias 7), 3
// mantissa bits, subnormals, no inf/NaN (saturating): code units in
// [-480, 480]; the block's absmax maps to 480.
inline constexpr float kExpAvgCodeMax = 480.f;
// int8 exp_avg_sq: an unsigned code, 5 exponent (bias 15) and 3 mantissa
// bits, subnormals, no sign: code units in [0, 122880], smallest nonzero
// 2^-17. A positive value never encodes to 0 (it rounds up to code 1).
inline constexpr float kExpAvgSqCodeMax = 122880.f;
// The smallest normal float (std::numeric_limits<float>::min()).
inline constexpr float kFloatMin = 0x1p-126f;

STRATA_HD inline uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
STRATA_HD inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// ---- int8: exp_avg code (sign, 4 exponent bits with bias 7, 3 mantissa) ----

// x * inv (inv = 1 / block scale) to the nearest code, ties to even,
// saturating at ±480; NaN saturates too. The magnitude is the bit pattern
// of the value in the code's own float layout: for the normal range the
// fp32 exponent is re-biased (127 → 7) and the 20 dropped mantissa bits are
// rounded; below 2^-6 (the subnormal codes) the value is rounded to a
// multiple of 2^-9 by the add-2^23 trick. -0 keeps its sign (code 0x80).
STRATA_HD inline uint8_t EncodeExpAvg8(float x, float inv) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  float y = BitsFloat(u & 0x7fffffffu) * inv;
  y = y < kExpAvgCodeMax ? y : kExpAvgCodeMax;  // saturate (NaN too)
  uint32_t code;
  if (y < 0x1p-6f) {
    const float t = y * 512.f + 0x1p23f;  // round(y * 2^9) in the low mantissa bits
    code = FloatBits(t) - 0x4b000000u;
  } else {
    const uint32_t h = FloatBits(y) - (120u << 23);  // exponent bias 127 → 7
    code = (h + 0x7ffffu + ((h >> 20) & 1u)) >> 20;
  }
  return static_cast<uint8_t>(code | sign);
}

// A code to its value in code units (exact); multiply by the block scale.
STRATA_HD inline float DecodeExpAvg8(uint8_t c) {
  const uint32_t mag = c & 0x7fu;
  const float v = mag < 8 ? static_cast<float>(static_cast<int32_t>(mag)) * (1.f / 512.f)
                          : BitsFloat((mag << 20) + (120u << 23));
  return BitsFloat(FloatBits(v) | (static_cast<uint32_t>(c & 0x80u) << 24));
}

// ---- int8: exp_avg_sq code (no sign, 5 exponent bits with bias 15, 3 mantissa) ----

// |x| * inv to the nearest code, ties to even, saturating at 122880 (and
// NaN); a positive x never gives code 0 (it rounds up to code 1, 2^-17).
STRATA_HD inline uint8_t EncodeExpAvgSq8(float x, float inv) {
  float y = BitsFloat(FloatBits(x) & 0x7fffffffu) * inv;
  y = y < kExpAvgSqCodeMax ? y : kExpAvgSqCodeMax;
  uint32_t code;
  if (y < 0x1p-14f) {
    const float t = y * 131072.f + 0x1p23f;  // round(y * 2^17)
    code = FloatBits(t) - 0x4b000000u;
  } else {
    const uint32_t h = FloatBits(y) - (112u << 23);  // exponent bias 127 → 15
    code = (h + 0x7ffffu + ((h >> 20) & 1u)) >> 20;
  }
  if (x > 0.f && code == 0) code = 1;  // never a zero v under a nonzero m
  return static_cast<uint8_t>(code);
}

STRATA_HD inline float DecodeExpAvgSq8(uint8_t c) {
  const uint32_t mag = c;
  return mag < 8 ? static_cast<float>(static_cast<int32_t>(mag)) * (1.f / 131072.f)
                 : BitsFloat((mag << 20) + (112u << 23));
}

// ---- int8: the block scale ---------------------------------------------------

// From a block's absmax (of the new values) and the code's largest value:
// scale = absmax / code_max (what decoding multiplies by), at least the
// smallest normal float when absmax > 0 (so that a nonzero block never
// decodes to all zeros), 0 for an all-zero block; inv = 1 / scale (0 for a
// zero block), what encoding multiplies by.
struct BlockScale {
  float scale, inv;
};
STRATA_HD inline BlockScale MakeBlockScale(float absmax, float code_max) {
  if (!(absmax > 0.f)) return {0.f, 0.f};
  float s = absmax / code_max;
  if (s < kFloatMin) s = kFloatMin;
  return {s, 1.f / s};
}

// ---- bf16-master: stochastic rounding ----------------------------------------

// A 32-bit integer hash with good avalanche (xorshift-multiply, the
// "lowbias32" constants): a bijection on uint32_t.
STRATA_HD inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

STRATA_HD inline uint64_t SplitMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The key of one step's rounding stream: from the seed and the step.
struct SrKey {
  uint32_t k0, k1;
};
STRATA_HD inline SrKey MakeSrKey(uint64_t seed, int64_t step) {
  const uint64_t k = SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(step)));
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

// The key of the 2^32 indices sharing the high half `hi`: k0 ^ Mix32(hi ^ k1).
STRATA_HD inline uint32_t SrHighKey(uint32_t hi, SrKey key) { return key.k0 ^ Mix32(hi ^ key.k1); }

// 32 random bits for the element with global index `index` in the stream
// `key`: one round of Mix32 over the low half of the index xor the key of
// its high half (which the kernels compute once per vector: it changes
// every 2^32 elements). Depends on nothing else (not the thread, block or
// shard split).
STRATA_HD inline uint32_t SrBits(uint64_t index, SrKey key) {
  const uint32_t lo = static_cast<uint32_t>(index), hi = static_cast<uint32_t>(index >> 32);
  return Mix32(lo ^ SrHighKey(hi, key));
}

// fp32 → bf16 with stochastic rounding: add the top 16 random bits to the
// 16 bits that are dropped, then truncate. The magnitude rounds up with
// probability (dropped bits) / 2^16, so the expected result is x exactly.
// NaN stays (quiet) NaN; ±inf stays; a value near the largest finite bf16
// may round up to inf.
STRATA_HD inline uint16_t FloatToBf16Stochastic(float x, uint32_t random) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + (random >> 16)) >> 16);
}

}  // namespace strata::codes
