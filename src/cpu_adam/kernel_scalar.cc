// The plain scalar kernels: one element at a time, no SIMD (this file is
// compiled with -fno-tree-vectorize -ffp-contract=off). They are the fallback
// on an x86-64 without SSE4.2 and the "plain loop" baseline of `strata bench
// adam`. Same order of operations as kernel_impl.h, with each fma written as
// a multiply and an add — which is exactly what xsimd does on SSE4.2, so the
// SSE4.2 kernels and these give bitwise-equal results (tested). The
// accumulation loop here is the reference every ISA's accumulate[] must
// match bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "src/common/half.h"
#include "src/cpu_adam/kernel.h"
#include "src/cpu_adam/state_codes.h"

namespace strata::cpu_adam::internal {
namespace {

template <int GD>
inline float LoadG(const void* g, size_t i) {
  if constexpr (GD == 0)
    return static_cast<const float*>(g)[i];
  else if constexpr (GD == 1)
    return HalfBitsToFloat(static_cast<const uint16_t*>(g)[i]);
  else
    return Bf16BitsToFloat(static_cast<const uint16_t*>(g)[i]);
}

template <CopyOut CO>
inline void StoreC(void* out, size_t i, float x) {
  if constexpr (CO == CopyOut::kFp32)
    static_cast<float*>(out)[i] = x;
  else if constexpr (CO == CopyOut::kFp16)
    static_cast<uint16_t*>(out)[i] = FloatToHalfBits(x);
  else if constexpr (CO == CopyOut::kBf16)
    static_cast<uint16_t*>(out)[i] = FloatToBf16Bits(x);
}

// FOLD: the step_fold kernels — the gradient is fold[i] + grad[i] (fold
// null: 0.f + grad[i]), one add as the accumulation does, then scaled.
template <KernelOp OP, int GD, CopyOut CO, bool FOLD = false>
void ScalarRange(const KernelArgs& a, size_t off, size_t n) {
  const Coeffs& c = a.c;
  for (size_t i = off; i < off + n; ++i) {
    float p = a.param[i];
    float g = LoadG<GD>(a.grad, i);
    if constexpr (FOLD) g = (a.fold != nullptr ? a.fold[i] : 0.f) + g;
    g = g * c.grad_scale;
    if constexpr (OP == KernelOp::kAdam || OP == KernelOp::kAdamW) {
      float m = a.state0[i];
      float v = a.state1[i];
      if constexpr (OP == KernelOp::kAdam) g = c.l2 * p + g;
      m = c.w1 * (g - m) + m;
      v = c.w2 * (g * g) + c.beta2 * v;
      const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;
      if constexpr (OP == KernelOp::kAdamW) p = p * c.decay;
      p = c.neg_step * (m / denom) + p;
      a.state0[i] = m;
      a.state1[i] = v;
    } else if constexpr (OP == KernelOp::kAdagrad) {
      float s = a.state0[i];
      g = c.l2 * p + g;
      s = g * g + s;
      p = c.neg_step * (g / (std::sqrt(s) + c.eps)) + p;
      a.state0[i] = s;
    } else if constexpr (OP == KernelOp::kLion) {
      float m = a.state0[i];
      const float u = c.w1 * (g - m) + m;
      const float sgn = u > 0.f ? 1.f : (u < 0.f ? -1.f : u * 0.f);
      p = p * c.decay;
      p = c.neg_step * sgn + p;
      m = c.w2 * (g - m) + m;
      a.state0[i] = m;
    } else {
      const float z = g * 0.f;  // see kernel_impl.h: finite values stay unchanged
      a.state0[i] = a.state0[i] + z;
      a.state1[i] = a.state1[i] + z;
      p = p + z;
    }
    a.param[i] = p;
    StoreC<CO>(a.copy_out, i, p);
  }
}

template <int GD>
bool ScalarFinite(const void* g, size_t n, float scale) {
  float acc = 0.f;
  for (size_t i = 0; i < n; ++i) {
    const float x = LoadG<GD>(g, i) * scale;
    acc += x - x;
  }
  return acc == acc;
}

// The reference accumulation: acc[i] += float(grad[i]), one element at a time.
template <int GD>
void ScalarAccumulate(float* acc, const void* grad, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += LoadG<GD>(grad, i);
}

// Its roofline (see kernel.h): acc_bits |= grad_bits & an opaque zero.
template <int GD>
void ScalarAccumulateRoofline(float* acc, const void* grad, size_t n) {
  static volatile uint32_t opaque_zero = 0;
  const uint32_t zero = opaque_zero;
  for (size_t i = 0; i < n; ++i) {
    uint32_t g;
    if constexpr (GD == 0)
      std::memcpy(&g, static_cast<const float*>(grad) + i, 4);
    else
      g = static_cast<const uint16_t*>(grad)[i];
    uint32_t x;
    std::memcpy(&x, acc + i, 4);
    x |= g & zero;
    std::memcpy(acc + i, &x, 4);
  }
}

template <KernelOp OP, int GD, CopyOut CO, bool FOLD = false>
bool ScalarRun(const KernelArgs& a, bool check_finite) {
  if (FOLD || !check_finite) {  // check_finite is refused with a fold (cpu_adam.cc)
    ScalarRange<OP, GD, CO, FOLD>(a, 0, a.n);
    return true;
  }
  return StepFiniteChunks(
      a.n,
      [&](size_t off, size_t len) {
        return ScalarFinite<GD>(static_cast<const char*>(a.grad) + off * (GD == 0 ? 4 : 2), len,
                                a.c.grad_scale);
      },
      [&](size_t off, size_t len) { ScalarRange<OP, GD, CO>(a, off, len); });
}

// ---- Compact state formats: the reference loops ------------------------------
// One element at a time, the same operations as CompactKernel in
// kernel_compact.h (each fma a multiply and an add). int8 works block by
// block: the new moments of the block first, then its absmax, its scales
// and the codes.
template <StateFormat SF, KernelOp OP, int GD>
void ScalarCompactRange(const KernelArgs& a, size_t off, size_t n) {
  constexpr bool kInt8 = SF == StateFormat::kInt8;
  constexpr bool kMaster16 = SF == StateFormat::kBf16Master;
  constexpr bool kHasS1 = OP != KernelOp::kLion;
  const Coeffs& c = a.c;
  auto* const pc = static_cast<uint16_t*>(a.param_c);
  auto* const s0b = static_cast<uint16_t*>(a.state0_c);
  auto* const s1b = static_cast<uint16_t*>(a.state1_c);
  auto* const s0q = static_cast<uint8_t*>(a.state0_c);
  auto* const s1q = static_cast<uint8_t*>(a.state1_c);
  const SrKey key{a.sr_key0, a.sr_key1};
  float mb[kQuantBlock], vb[kQuantBlock];
  for (size_t s = off; s < off + n; s += kQuantBlock) {
    const size_t e = std::min(off + n, s + kQuantBlock);
    const size_t blk = s / kQuantBlock;
    if constexpr (OP == KernelOp::kRoofline) {  // values unchanged
      for (size_t i = s; i < e; ++i) (void)LoadG<GD>(a.grad, i);
      if constexpr (kInt8) {
        a.scale0[blk] = a.scale0[blk];
        a.scale1[blk] = a.scale1[blk];
      }
    } else {
      const float sc0 = kInt8 ? a.scale0[blk] : 0.f;
      const float sc1 = kInt8 && kHasS1 ? a.scale1[blk] : 0.f;
      float amax0 = 0.f, amax1 = 0.f;
      for (size_t i = s; i < e; ++i) {
        float p = kMaster16 ? Bf16BitsToFloat(pc[i]) : a.param[i];
        float g = LoadG<GD>(a.grad, i);
        if (a.folded) g = (a.fold != nullptr ? a.fold[i] : 0.f) + g;
        g = g * c.grad_scale;
        float m = kInt8 ? DecodeExpAvg8(s0q[i]) * sc0 : Bf16BitsToFloat(s0b[i]);
        float v = 0.f;
        if constexpr (OP == KernelOp::kLion) {
          const float u = c.w1 * (g - m) + m;
          const float sgn = u > 0.f ? 1.f : (u < 0.f ? -1.f : u * 0.f);
          p = p * c.decay;
          p = c.neg_step * sgn + p;
          m = c.w2 * (g - m) + m;
        } else {
          v = kInt8 ? DecodeExpAvgSq8(s1q[i]) * sc1 : Bf16BitsToFloat(s1b[i]);
          if constexpr (OP == KernelOp::kAdam) g = c.l2 * p + g;
          m = c.w1 * (g - m) + m;
          v = c.w2 * (g * g) + c.beta2 * v;
          const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;
          if constexpr (OP == KernelOp::kAdamW) p = p * c.decay;
          p = c.neg_step * (m / denom) + p;
        }
        if constexpr (kMaster16) {
          pc[i] = FloatToBf16Stochastic(p, SrBits(a.index0 + i, key));
        } else {
          a.param[i] = p;
        }
        if constexpr (kInt8) {
          mb[i - s] = m;
          vb[i - s] = v;
          const float am = std::fabs(m), av = std::fabs(v);
          amax0 = am > amax0 ? am : amax0;
          amax1 = av > amax1 ? av : amax1;
        } else {
          s0b[i] = FloatToBf16Bits(m);
          if constexpr (kHasS1) s1b[i] = FloatToBf16Bits(v);
        }
      }
      if constexpr (kInt8) {
        const BlockScale q0 = MakeBlockScale(amax0, kExpAvgCodeMax);
        a.scale0[blk] = q0.scale;
        for (size_t i = s; i < e; ++i) s0q[i] = EncodeExpAvg8(mb[i - s], q0.inv);
        if constexpr (kHasS1) {
          const BlockScale q1 = MakeBlockScale(amax1, kExpAvgSqCodeMax);
          a.scale1[blk] = q1.scale;
          for (size_t i = s; i < e; ++i) s1q[i] = EncodeExpAvgSq8(vb[i - s], q1.inv);
        }
      }
    }
    for (size_t i = s; i < e; ++i) {  // the copy of the stored master
      const float p = kMaster16 ? Bf16BitsToFloat(pc[i]) : a.param[i];
      switch (a.copy) {
        case CopyOut::kNone:
          break;
        case CopyOut::kFp32:
          StoreC<CopyOut::kFp32>(a.copy_out, i, p);
          break;
        case CopyOut::kFp16:
          StoreC<CopyOut::kFp16>(a.copy_out, i, p);
          break;
        case CopyOut::kBf16:
          StoreC<CopyOut::kBf16>(a.copy_out, i, p);
          break;
      }
    }
  }
}

template <StateFormat SF, KernelOp OP, int GD>
bool ScalarCompactRun(const KernelArgs& a, bool check_finite) {
  if (a.folded || !check_finite) {
    ScalarCompactRange<SF, OP, GD>(a, 0, a.n);
    return true;
  }
  return StepFiniteChunks(
      a.n,
      [&](size_t off, size_t len) {
        return ScalarFinite<GD>(static_cast<const char*>(a.grad) + off * (GD == 0 ? 4 : 2), len,
                                a.c.grad_scale);
      },
      [&](size_t off, size_t len) { ScalarCompactRange<SF, OP, GD>(a, off, len); });
}

template <StateFormat SF, KernelOp OP>
void FillCompact(KernelTable& t) {
  constexpr int f = static_cast<int>(SF) - 1;
  t.compact[f][int(OP)][0] = &ScalarCompactRun<SF, OP, 0>;
  t.compact[f][int(OP)][1] = &ScalarCompactRun<SF, OP, 1>;
  t.compact[f][int(OP)][2] = &ScalarCompactRun<SF, OP, 2>;
}

template <bool SQ>
void ScalarQuantizeQ8(const float* in, size_t n, uint8_t* codes, float* scales) {
  for (size_t s = 0, b = 0; s < n; s += kQuantBlock, ++b) {
    const size_t e = std::min(n, s + kQuantBlock);
    float amax = 0.f;
    for (size_t i = s; i < e; ++i) {
      const float a = std::fabs(in[i]);
      amax = a > amax ? a : amax;
    }
    const BlockScale q = MakeBlockScale(amax, SQ ? kExpAvgSqCodeMax : kExpAvgCodeMax);
    scales[b] = q.scale;
    for (size_t i = s; i < e; ++i)
      codes[i] = SQ ? EncodeExpAvgSq8(in[i], q.inv) : EncodeExpAvg8(in[i], q.inv);
  }
}

template <bool SQ>
void ScalarDequantizeQ8(const uint8_t* codes, const float* scales, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i)
    out[i] = (SQ ? DecodeExpAvgSq8(codes[i]) : DecodeExpAvg8(codes[i])) * scales[i / kQuantBlock];
}

void ScalarStochasticBf16(const float* in, uint16_t* out, size_t n, uint64_t index0, uint32_t k0,
                          uint32_t k1) {
  for (size_t i = 0; i < n; ++i)
    out[i] = FloatToBf16Stochastic(in[i], SrBits(index0 + i, {k0, k1}));
}

template <KernelOp OP, int GD>
void Fill(KernelTable& t) {
  t.step[int(OP)][GD][0] = &ScalarRun<OP, GD, CopyOut::kNone>;
  t.step[int(OP)][GD][1] = &ScalarRun<OP, GD, CopyOut::kFp32>;
  t.step[int(OP)][GD][2] = &ScalarRun<OP, GD, CopyOut::kFp16>;
  t.step[int(OP)][GD][3] = &ScalarRun<OP, GD, CopyOut::kBf16>;
  t.step_fold[int(OP)][GD][0] = &ScalarRun<OP, GD, CopyOut::kNone, true>;
  t.step_fold[int(OP)][GD][1] = &ScalarRun<OP, GD, CopyOut::kFp32, true>;
  t.step_fold[int(OP)][GD][2] = &ScalarRun<OP, GD, CopyOut::kFp16, true>;
  t.step_fold[int(OP)][GD][3] = &ScalarRun<OP, GD, CopyOut::kBf16, true>;
}
template <KernelOp OP>
void FillAll(KernelTable& t) {
  Fill<OP, 0>(t);
  Fill<OP, 1>(t);
  Fill<OP, 2>(t);
}

KernelTable Make() {
  KernelTable t{};
  t.isa = "scalar";
  t.lanes = 1;
  FillAll<KernelOp::kAdam>(t);
  FillAll<KernelOp::kAdamW>(t);
  FillAll<KernelOp::kAdagrad>(t);
  FillAll<KernelOp::kLion>(t);
  FillAll<KernelOp::kRoofline>(t);
  FillCompact<StateFormat::kBf16, KernelOp::kAdam>(t);
  FillCompact<StateFormat::kBf16, KernelOp::kAdamW>(t);
  FillCompact<StateFormat::kBf16, KernelOp::kLion>(t);
  FillCompact<StateFormat::kBf16, KernelOp::kRoofline>(t);
  FillCompact<StateFormat::kBf16Master, KernelOp::kAdam>(t);
  FillCompact<StateFormat::kBf16Master, KernelOp::kAdamW>(t);
  FillCompact<StateFormat::kBf16Master, KernelOp::kRoofline>(t);
  FillCompact<StateFormat::kInt8, KernelOp::kAdam>(t);
  FillCompact<StateFormat::kInt8, KernelOp::kAdamW>(t);
  FillCompact<StateFormat::kInt8, KernelOp::kLion>(t);
  FillCompact<StateFormat::kInt8, KernelOp::kRoofline>(t);
  t.check[0] = &ScalarFinite<0>;
  t.check[1] = &ScalarFinite<1>;
  t.check[2] = &ScalarFinite<2>;
  t.accumulate[0] = &ScalarAccumulate<0>;
  t.accumulate[1] = &ScalarAccumulate<1>;
  t.accumulate[2] = &ScalarAccumulate<2>;
  t.accumulate_roofline[0] = &ScalarAccumulateRoofline<0>;
  t.accumulate_roofline[1] = &ScalarAccumulateRoofline<1>;
  t.accumulate_roofline[2] = &ScalarAccumulateRoofline<2>;
  t.f32_to_f16 = [](const float* in, uint16_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = FloatToHalfBits(in[i]);
  };
  t.f32_to_bf16 = [](const float* in, uint16_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = FloatToBf16Bits(in[i]);
  };
  t.f16_to_f32 = [](const uint16_t* in, float* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = HalfBitsToFloat(in[i]);
  };
  t.bf16_to_f32 = [](const uint16_t* in, float* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = Bf16BitsToFloat(in[i]);
  };
  t.quantize_q8[0] = &ScalarQuantizeQ8<false>;
  t.quantize_q8[1] = &ScalarQuantizeQ8<true>;
  t.dequantize_q8[0] = &ScalarDequantizeQ8<false>;
  t.dequantize_q8[1] = &ScalarDequantizeQ8<true>;
  t.to_bf16_stochastic = &ScalarStochasticBf16;
  return t;
}

}  // namespace

const KernelTable& ScalarTable() {
  static const KernelTable table = Make();
  return table;
}

}  // namespace strata::cpu_adam::internal
