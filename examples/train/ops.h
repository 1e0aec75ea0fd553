// Element-wise host loops of the example model (the parts that are not
// GEMMs). Row-major fp32; N rows (tokens), H/F/V columns. Shared by the host
// backend; tests/train/model_test.cc checks the whole model against an
// independent double-precision reference.
#pragma once

#include <bit>
#include <cstdint>

namespace strata::example::ops {

constexpr float kRmsEps = 1e-5f;

// h0[b, t] = tok[x_t] + prev1[x_{t-1}] + prev2[x_{t-2}] (terms before the
// start of a sequence are left out).
void EmbedForward(const int32_t* x, int64_t batch, int64_t seq, int64_t H, const float* tok,
                  const float* prev1, const float* prev2, float* h0);
// Gradients of the three tables (overwritten, then scatter-added).
void EmbedBackward(const int32_t* x, int64_t batch, int64_t seq, int64_t H, int64_t V,
                   const float* dh, float* gtok, float* gprev1, float* gprev2);
// u = h / r, r[n] = sqrt(mean(h[n]²) + eps).
void RmsNormForward(const float* h, int64_t N, int64_t H, float* u, float* r);
// dh (=, or += when accumulate) (du − u · mean(du ⊙ u)) / r.
void RmsNormBackward(const float* h, const float* u, const float* r, const float* du, int64_t N,
                     int64_t H, bool accumulate, float* dh);
// a += b (per column); g = gelu(a) (tanh form).
void AddBiasGelu(float* a, const float* b, int64_t N, int64_t F, float* g);
// dg (in place) *= gelu'(a).
void GeluBackward(const float* a, float* dg, int64_t n);
// out[j] = Σ_n x[n, j].
void ColumnSum(const float* x, int64_t N, int64_t C, float* out);
// Mean cross-entropy of softmax(z) against targets (double); z becomes
// (softmax(z) − onehot) · grad_scale.
double SoftmaxCrossEntropy(float* z, const int32_t* targets, int64_t N, int64_t V,
                           float grad_scale);

float Gelu(float a);
float GeluGrad(float a);

// bf16 and fp16 (IEEE binary16) values as the Engine hands them over: 16-bit
// patterns (uint16_t), converted to and from fp32 here. fp32 → 16 bits rounds
// to nearest, ties to even (subnormal fp16 results included); NaN stays NaN
// (quiet, sign kept); overflow becomes ±inf. 16 bits → fp32 is exact. These
// round as the engine's own conversions do (tests/train/model_test.cc
// compares them bit for bit), so the losses do not depend on which converts.
inline float Bf16ToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // ties to even; a carry into the exponent rounds up to inf
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // ±0 or subnormal: man · 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));  // inf, NaN
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // ≥ 65520 rounds to inf (inf stays inf)
  if (abs < 0x38800000u) {
    // Subnormal in fp16 (|f| < 2^-14) or zero: round(mantissa · 2^(e - 126)),
    // the fp16 subnormal unit being 2^-24.
    const uint32_t e = abs >> 23;
    if (e < 102) return sign;  // below 2^-25 (2^-25 itself is a tie: even 0)
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t half_m = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++half_m;  // may become the min normal
    return sign | static_cast<uint16_t>(half_m);
  }
  // Normal: rebias the exponent (127 → 15), round the 13 dropped mantissa bits.
  uint32_t h = abs - (112u << 23);
  h += 0xfffu + ((h >> 13) & 1u);
  return sign | static_cast<uint16_t>(h >> 13);
}

}  // namespace strata::example::ops
