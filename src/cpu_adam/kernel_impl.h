// Internal to src/cpu_adam: the fused optimizer kernels with fp32 states and
// the helpers every kernel shares, written once with xsimd and instantiated
// per instruction set (kernel_table_impl.h) by kernel_avx512.cc,
// kernel_avx2.cc and kernel_sse42.cc (each compiled with its own -m flags).
// Only those translation units include this header (and so xsimd); the
// compact state formats are in kernel_compact.h.
//
// One pass per element, bytes moved per element (fp32 master, fp32 states):
//   Adam/AdamW: read p,g,m,v  write p,m,v  [+ copy]  = 12 + G + 12 (+ C)
//   Adagrad:    read p,g,s    write p,s    [+ copy]  =  8 + G +  8 (+ C)
//   Lion:       read p,g,m    write p,m    [+ copy]  =  8 + G +  8 (+ C)
// with G = grad bytes (4 or 2) and C = copy-out bytes (4, 2 or 0).
//   Accumulate: read acc,g  write acc              =  8 + G
//
// Every element is computed by the same vector instructions wherever it sits:
// the last partial vector is copied into a padded stack buffer, run through
// the same vector code and copied back. So results do not depend on
// alignment, shard offset or thread partitioning (bitwise).
//
// Each ISA's translation unit specializes ArchIO<A> (16-bit loads/stores,
// fp16 conversions, streaming stores) before instantiating MakeTable<A>().
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <xsimd/xsimd.hpp>

#include "src/cpu_adam/kernel.h"
#include "src/cpu_adam/state_codes.h"
#include "src/cpu_adam/xsimd_compat.h"

namespace strata::cpu_adam::internal {

template <class A>
using BF = xsimd::batch<float, A>;
template <class A>
using BI = xsimd::batch<int32_t, A>;

// Specialized per ISA:
//   static BI<A>  LoadU16(const uint16_t* p);           zero-extends lanes
//   static void   StoreU16(uint16_t* p, BI<A> x);       low 16 bits of lanes (x in [0, 0xffff])
//   static bool   StreamU16(uint16_t* p, BI<A> x);      non-temporal if aligned; false if not done
//   static bool   StreamF32(float* p, BF<A> x);         non-temporal if aligned; false if not done
//   static BF<A>  LoadF16(const uint16_t* p);           fp16 → fp32 (exact)
//   static void   StoreF16(uint16_t* p, BF<A> x, bool nt); fp32 → fp16, round to nearest even
//   static void   Fence();                               orders streaming stores
//   static BI<A>  LoadU8(const uint8_t* p);             zero-extends lanes
//   static void   StoreU8(uint8_t* p, BI<A> x);         low 8 bits of lanes (x in [0, 0xff])
//   static BI<A>  LoadS8(const uint8_t* p);             sign-extends lanes
//   static void   StoreS8(uint8_t* p, BI<A> x);         low 8 bits of lanes (x in [-128, 127])
//   static void   StoreU8x4(uint8_t* p, BI<A> a, b, c, d);  4 vectors' StoreU8, in order
//   static void   StoreS8x4(uint8_t* p, BI<A> a, b, c, d);  4 vectors' StoreS8, in order
//   static void   StoreU16x2(uint16_t* p, BI<A> a, b);  2 vectors' StoreU16, in order
//   static BI<A>  SignCode8(BI<A> mag, BI<A> x);        mag (lanes in [0, 127]) with x's sign
//                                                        bit as bit 7, in a lane StoreS8 takes
//   static BF<A>  LoadExpAvg8Over256(const uint8_t* p); int8 exp_avg codes → code values / 256
//   (exact)
template <class A>
struct ArchIO;

// ---- Bit-arithmetic conversions (any ISA) ------------------------------------

// fp16 bits (lanes in [0, 0xffff]) → fp32. Exact, NaN payload kept.
template <class A>
inline BF<A> HalfBitsToFloatGeneric(BI<A> h) {
  const BI<A> sign = (h & BI<A>(0x8000)) << 16;
  const BI<A> em = h & BI<A>(0x7fff);
  // Normal and subnormal halves: place the bits in a float and rescale by
  // 2^112 (exact: subnormal halves become fp32 denormals first).
  const BF<A> scaled = BitCast<BF<A>>(em << 13) * BF<A>(0x1p112f);
  const BI<A> infnan = (em << 13) | BI<A>(0x7f800000);
  const BI<A> bits = xsimd::select(em >= BI<A>(0x7c00), infnan, BitCast<BI<A>>(scaled));
  return BitCast<BF<A>>(bits | sign);
}

// fp32 → fp16 bits, round to nearest even; same results as FloatToHalfBits.
template <class A>
inline BI<A> FloatToHalfBitsGeneric(BF<A> f) {
  const BI<A> u = BitCast<BI<A>>(f);
  const BI<A> sign = (u >> 16) & BI<A>(0x8000);
  const BI<A> a = u & BI<A>(0x7fffffff);
  // Subnormal results: adding 0.5f aligns the value so that fp32's own
  // round-to-nearest-even rounds it to a multiple of 2^-24 (the fp16 unit).
  const BF<A> magic = BitCast<BF<A>>(BI<A>(0x3f000000));
  const BI<A> sub = BitCast<BI<A>>(BitCast<BF<A>>(a) + magic) - BI<A>(0x3f000000);
  // Normal results: rebias the exponent and round the 13 dropped bits (ties to even).
  const BI<A> odd = (a >> 13) & BI<A>(1);
  const BI<A> norm = (a - BI<A>(112 << 23) + BI<A>(0xfff) + odd) >> 13;
  BI<A> r = xsimd::select(a < BI<A>(0x38800000), sub, norm);
  r = xsimd::select(a >= BI<A>(0x477ff000), BI<A>(0x7c00), r);  // overflow (and inf) → inf
  r = xsimd::select(a > BI<A>(0x7f800000), BI<A>(0x7e00) | ((a >> 13) & BI<A>(0x3ff)),
                    r);  // NaN → quiet NaN
  return r | sign;
}

// bf16 bits → fp32 (exact).
template <class A>
inline BF<A> Bf16BitsToFloat(BI<A> h) {
  return BitCast<BF<A>>(h << 16);
}

// fp32 → bf16 bits, round to nearest even, NaN stays (quiet) NaN. Unsigned
// lanes so that the shifts are logical (no masking needed); lanes end up in
// [0, 0xffff]. 8 vector ops (NaN found with an unordered compare).
template <class A>
inline BI<A> FloatToBf16Bits(BF<A> f) {
  using BU = xsimd::batch<uint32_t, A>;
  const BU u = BitCast<BU>(f);
  const BU hi = u >> 16;
  const BU rounded = (u + BU(0x7fffu) + (hi & BU(1u))) >> 16;  // ties to even; may round up to inf
  const BU quiet = hi | BU(0x40u);  // NaN: keep sign and payload, set quiet bit
  const BF<A> r = xsimd::select(xsimd::isnan(f), BitCast<BF<A>>(quiet), BitCast<BF<A>>(rounded));
  return BitCast<BI<A>>(r);
}

// ---- Loads and stores by dtype ---------------------------------------------

template <class A, int GD>  // GD: 0 fp32, 1 fp16, 2 bf16 (DType order)
inline BF<A> LoadGrad(const void* g, size_t i) {
  if constexpr (GD == 0) {
    return BF<A>::load_unaligned(static_cast<const float*>(g) + i);
  } else if constexpr (GD == 1) {
    return ArchIO<A>::LoadF16(static_cast<const uint16_t*>(g) + i);
  } else {
    return Bf16BitsToFloat<A>(ArchIO<A>::LoadU16(static_cast<const uint16_t*>(g) + i));
  }
}

template <class A>
inline void StoreF32(float* p, BF<A> x, bool nt) {
  if (nt && ArchIO<A>::StreamF32(p, x)) return;
  x.store_unaligned(p);
}

template <class A, CopyOut CO>
inline void StoreCopy(void* out, size_t i, BF<A> x, bool nt) {
  if constexpr (CO == CopyOut::kFp32) {
    StoreF32<A>(static_cast<float*>(out) + i, x, nt);
  } else if constexpr (CO == CopyOut::kFp16) {
    ArchIO<A>::StoreF16(static_cast<uint16_t*>(out) + i, x, nt);
  } else if constexpr (CO == CopyOut::kBf16) {
    uint16_t* p = static_cast<uint16_t*>(out) + i;
    const BI<A> b = FloatToBf16Bits<A>(x);
    if (nt && ArchIO<A>::StreamU16(p, b)) return;
    ArchIO<A>::StoreU16(p, b);
  }
}

constexpr size_t GradBytes(int gd) { return gd == 0 ? 4 : 2; }
constexpr size_t CopyBytes(CopyOut co) {
  return co == CopyOut::kNone ? 0 : (co == CopyOut::kFp32 ? 4 : 2);
}

// ---- The kernels -----------------------------------------------------------

// The gradient a fused kernel steps with: kNoFold reads grad alone; the fold
// kinds add it to the window's fp32 accumulator first (kFoldAcc: acc[i] +
// float(grad[i])) or to a zeroed one (kFoldZero: 0.f + float(grad[i]), which
// is not an identity: -0 becomes +0, as `acc += g` on a zeroed acc gives).
enum FoldKind : int { kNoFold = 0, kFoldAcc = 1, kFoldZero = 2 };

template <class A, int GD, int F>
inline BF<A> LoadFoldedGrad(const void* g, const float* f, size_t i) {
  const BF<A> x = LoadGrad<A, GD>(g, i);
  if constexpr (F == kFoldAcc) return BF<A>::load_unaligned(f + i) + x;  // acc + g, as acc += g
  if constexpr (F == kFoldZero) return BF<A>(0.f) + x;                   // a zeroed acc += g
  return x;
}

// a * b + c with two roundings: a multiply, then an add, never one fused
// multiply-add. Every kernel's multiply-adds go through this, and the ISA
// translation units are compiled with -ffp-contract=off, so the vector
// kernels give the scalar loop's bits on every ISA and with every xsimd
// (whose fma fuses on some archs and not on others). The step is bound by
// memory, so the second rounding costs no time (docs/perf.md).
template <class A>
inline BF<A> MulAdd(BF<A> a, BF<A> b, BF<A> c) {
  return a * b + c;
}

// One vector of Adam/AdamW (and Lion) in registers, the order of float
// operations of docs/design.md: every state format's kernel computes its
// update with these, whatever it loads and stores.
template <class A, KernelOp OP>
inline void AdamUpdate(BF<A> g, BF<A>& p, BF<A>& m, BF<A>& v, const Coeffs& c) {
  using B = BF<A>;
  if constexpr (OP == KernelOp::kAdam) g = MulAdd<A>(B(c.l2), p, g);  // g += wd * p (L2)
  m = MulAdd<A>(B(c.w1), g - m, m);                                   // m = lerp(m, g, 1 - beta1)
  v = MulAdd<A>(B(c.w2), g * g, B(c.beta2) * v);  // v = beta2 v + (1 - beta2) g^2
  const B denom = MulAdd<A>(xsimd::sqrt(v), B(c.inv_bc2_sqrt), B(c.eps));  // sqrt(v / bc2) + eps
  if constexpr (OP == KernelOp::kAdamW) p = p * B(c.decay);  // p *= 1 - lr wd (decoupled)
  p = MulAdd<A>(B(c.neg_step), m / denom, p);                // p -= lr/bc1 * m / denom
}

template <class A>
inline void LionUpdate(BF<A> g, BF<A>& p, BF<A>& m, const Coeffs& c) {
  using B = BF<A>;
  const B u = MulAdd<A>(B(c.w1), g - m, m);  // u = lerp(m, g, 1 - beta1)
  // sign(u): +1, -1, or u * 0 (keeps ±0 → 0 and NaN → NaN).
  const B sgn = xsimd::select(u > B(0.f), B(1.f), xsimd::select(u < B(0.f), B(-1.f), u * B(0.f)));
  p = p * B(c.decay);                    // p *= 1 - lr wd
  p = MulAdd<A>(B(c.neg_step), sgn, p);  // p -= lr sign(u)
  m = MulAdd<A>(B(c.w2), g - m, m);      // m = lerp(m, g, 1 - beta2)
}

// FOLD: the step_fold table entries (KernelArgs::fold), else step[].
template <class A, KernelOp OP, int GD, CopyOut CO, bool FOLD = false>
struct FusedKernel {
  using B = BF<A>;
  static constexpr size_t W = B::size;

  // Updates the W elements at index i. Pointers may be the real arrays or a
  // padded stack copy (the tail); the arithmetic is the same either way.
  template <int F, bool kWithCopy = true>
  static inline void Vec(float* p_, const void* g_, const float* f_, float* s0_, float* s1_,
                         void* cp_, size_t i, const Coeffs& c, bool nt, bool nt_copy) {
    B p = B::load_unaligned(p_ + i);
    B g =
        LoadFoldedGrad<A, GD, F>(g_, f_, i) * B(c.grad_scale);  // unscale and clip in one multiply
    if constexpr (OP == KernelOp::kAdam || OP == KernelOp::kAdamW) {
      B m = B::load_unaligned(s0_ + i);
      B v = B::load_unaligned(s1_ + i);
      AdamUpdate<A, OP>(g, p, m, v, c);
      StoreF32<A>(s0_ + i, m, nt);
      StoreF32<A>(s1_ + i, v, nt);
    } else if constexpr (OP == KernelOp::kAdagrad) {
      B s = B::load_unaligned(s0_ + i);
      g = MulAdd<A>(B(c.l2), p, g);  // g += wd * p
      s = MulAdd<A>(g, g, s);        // sum += g^2
      p = MulAdd<A>(B(c.neg_step), g / (xsimd::sqrt(s) + B(c.eps)),
                    p);  // p -= clr g / (sqrt(sum) + eps)
      StoreF32<A>(s0_ + i, s, nt);
    } else if constexpr (OP == KernelOp::kLion) {
      B m = B::load_unaligned(s0_ + i);
      LionUpdate<A>(g, p, m, c);
      StoreF32<A>(s0_ + i, m, nt);
    } else {  // kRoofline: the same loads and stores, trivial arithmetic that
              // leaves finite values unchanged (so the arrays can be shared
              // with the real kernels in a benchmark)
      const B z = g * B(0.f);
      p = p + z;
      StoreF32<A>(s0_ + i, B::load_unaligned(s0_ + i) + z, nt);
      StoreF32<A>(s1_ + i, B::load_unaligned(s1_ + i) + z, nt);
    }
    StoreF32<A>(p_ + i, p, nt);
    if constexpr (kWithCopy) StoreCopy<A, CO>(cp_, i, p, nt_copy);
  }

  static constexpr bool kHasS1 =
      OP == KernelOp::kAdam || OP == KernelOp::kAdamW || OP == KernelOp::kRoofline;

  // Elements [off, off + n), the gradient folded as F says.
  template <int F>
  static inline void RangeF(const KernelArgs& a, size_t off, size_t n) {
    const size_t body = n / W * W;
    float* const p = a.param + off;
    const void* const g = static_cast<const char*>(a.grad) + off * GradBytes(GD);
    const float* const f = F == kFoldAcc ? a.fold + off : nullptr;
    float* const s0 = a.state0 + off;
    float* const s1 = kHasS1 ? a.state1 + off : nullptr;
    void* const cp =
        CO == CopyOut::kNone ? nullptr : static_cast<char*>(a.copy_out) + off * CopyBytes(CO);
    // Local copies: the compiler can then keep the coefficients in registers
    // (stores through float* could otherwise alias a.c).
    const Coeffs c = a.c;
    const bool nt_state = a.stream_state, nt_copy = a.stream_copy;
    if constexpr (CO == CopyOut::kNone) {
      for (size_t i = 0; i < body; i += W) Vec<F>(p, g, f, s0, s1, cp, i, c, nt_state, nt_copy);
    } else {
      // The copy is converted from the just-written master while it is still
      // in L1, one sub-chunk later: a short independent loop instead of more
      // latency at the end of the long sqrt/div chain (which limited the
      // out-of-order window: +50% time with the conversion inline, measured).
      // DRAM traffic is unchanged: each element is still read and written once.
      constexpr size_t kSub = 256;  // 1 KiB of param: stays in L1
      for (size_t s = 0; s < body; s += kSub) {
        const size_t e = std::min(body, s + kSub);
        for (size_t i = s; i < e; i += W)
          Vec<F, false>(p, g, f, s0, s1, cp, i, c, nt_state, nt_copy);
        for (size_t i = s; i < e; i += W)
          StoreCopy<A, CO>(cp, i, B::load_unaligned(p + i), nt_copy);
      }
    }
    const size_t rem = n - body;
    if (rem == 0) return;
    // Tail: the same vector code on a zero-padded copy (zeros keep the
    // padding lanes finite; their results are discarded).
    alignas(64) float tp[W] = {}, ts0[W] = {}, ts1[W] = {}, tcp[W] = {};
    alignas(64) float tg[W] = {}, tf[W] = {};
    std::memcpy(tp, p + body, rem * 4);
    if constexpr (F == kFoldAcc) std::memcpy(tf, f + body, rem * 4);
    std::memcpy(tg, static_cast<const char*>(g) + body * GradBytes(GD), rem * GradBytes(GD));
    std::memcpy(ts0, s0 + body, rem * 4);
    if constexpr (kHasS1) std::memcpy(ts1, s1 + body, rem * 4);
    Vec<F>(tp, tg, tf, ts0, ts1, tcp, 0, c, false, false);
    std::memcpy(p + body, tp, rem * 4);
    std::memcpy(s0 + body, ts0, rem * 4);
    if constexpr (kHasS1) std::memcpy(s1 + body, ts1, rem * 4);
    if constexpr (CO != CopyOut::kNone)
      std::memcpy(static_cast<char*>(cp) + body * CopyBytes(CO), tcp, rem * CopyBytes(CO));
  }

  static inline void Range(const KernelArgs& a, size_t off, size_t n) {
    if constexpr (!FOLD) {
      RangeF<kNoFold>(a, off, n);
    } else if (a.fold != nullptr) {
      RangeF<kFoldAcc>(a, off, n);
    } else {
      RangeF<kFoldZero>(a, off, n);
    }
  }

  static bool Run(const KernelArgs& a, bool check_finite);
};

// True if grad[0, n) * scale has no inf/NaN. Uses g - g (0 for finite, NaN
// otherwise) summed over the range: one subtract and one add per vector.
template <class A, int GD>
inline bool RangeFinite(const void* g, size_t n, float scale) {
  using B = BF<A>;
  constexpr size_t W = B::size;
  const size_t body = n / W * W;
  B acc(0.f);
  for (size_t i = 0; i < body; i += W) {
    const B x = LoadGrad<A, GD>(g, i) * B(scale);
    acc += x - x;
  }
  if (body < n) {
    alignas(64) float tg[W] = {};
    std::memcpy(tg, static_cast<const char*>(g) + body * GradBytes(GD), (n - body) * GradBytes(GD));
    const B x = LoadGrad<A, GD>(tg, 0) * B(scale);
    acc += x - x;
  }
  return xsimd::all(acc == acc);  // == is ordered: false for NaN (xsimd's != is NEQ_OQ, also false)
}

template <class A, KernelOp OP, int GD, CopyOut CO, bool FOLD>
bool FusedKernel<A, OP, GD, CO, FOLD>::Run(const KernelArgs& a, bool check_finite) {
  bool finite = true;
  if (FOLD || !check_finite) {  // check_finite is refused with a fold (cpu_adam.cc)
    Range(a, 0, a.n);
  } else {
    finite = StepFiniteChunks(
        a.n,
        [&](size_t off, size_t len) {
          return RangeFinite<A, GD>(static_cast<const char*>(a.grad) + off * GradBytes(GD), len,
                                    a.c.grad_scale);
        },
        [&](size_t off, size_t len) { Range(a, off, len); });
  }
  if (a.stream_state || a.stream_copy) ArchIO<A>::Fence();
  return finite;
}

template <class A, int GD>
bool CheckKernel(const void* g, size_t n, float scale) {
  return RangeFinite<A, GD>(g, n, scale);
}

// ---- Gradient accumulation -------------------------------------------------

// acc[i] += float(grad[i]) over [0, n): per element 4 bytes of acc read and
// written, G bytes of grad read. The widening is exact and the fp32 add
// rounds once, so the result is the scalar loop's, bit for bit, on every ISA
// (NaN + NaN may keep either payload; the result is NaN either way).
template <class A, int GD>
void AccumulateKernel(float* acc, const void* grad, size_t n) {
  using B = BF<A>;
  constexpr size_t W = B::size;
  const size_t body = n / W * W;
  // Two vectors per iteration: two independent load/add/store chains.
  size_t i = 0;
  for (; i + 2 * W <= body; i += 2 * W) {
    const B a0 = B::load_unaligned(acc + i) + LoadGrad<A, GD>(grad, i);          // acc += g
    const B a1 = B::load_unaligned(acc + i + W) + LoadGrad<A, GD>(grad, i + W);  // next vector
    a0.store_unaligned(acc + i);
    a1.store_unaligned(acc + i + W);
  }
  for (; i < body; i += W)
    (B::load_unaligned(acc + i) + LoadGrad<A, GD>(grad, i)).store_unaligned(acc + i);
  const size_t rem = n - body;
  if (rem == 0) return;
  // Tail: the same vector add on a zero-padded copy.
  alignas(64) float ta[W] = {};
  alignas(64) float tg[W] = {};
  std::memcpy(ta, acc + body, rem * 4);
  std::memcpy(tg, static_cast<const char*>(grad) + body * GradBytes(GD), rem * GradBytes(GD));
  (B::load_aligned(ta) + LoadGrad<A, GD>(tg, 0)).store_aligned(ta);
  std::memcpy(acc + body, ta, rem * 4);
}

// The gradient's raw bits, one element per 32-bit lane (16-bit ones
// zero-extended): the same bytes LoadGrad reads, without converting them.
template <class A, int GD>
inline BI<A> LoadGradBits(const void* g, size_t i) {
  if constexpr (GD == 0) {
    return BI<A>::load_unaligned(static_cast<const int32_t*>(g) + i);
  } else {
    return ArchIO<A>::LoadU16(static_cast<const uint16_t*>(g) + i);
  }
}

// The roofline of accumulation (benchmark only): the same loads and stores,
// acc_bits |= grad_bits & zero with a zero the compiler cannot see through,
// so that the loads are kept. acc keeps its bits.
template <class A, int GD>
void AccumulateRooflineKernel(float* acc, const void* grad, size_t n) {
  using I = BI<A>;
  constexpr size_t W = I::size;
  static volatile int32_t opaque_zero = 0;
  const I zero(opaque_zero);
  int32_t* const a = reinterpret_cast<int32_t*>(acc);
  const size_t body = n / W * W;
  size_t i = 0;
  for (; i + 2 * W <= body; i += 2 * W) {
    const I a0 = I::load_unaligned(a + i) | (LoadGradBits<A, GD>(grad, i) & zero);
    const I a1 = I::load_unaligned(a + i + W) | (LoadGradBits<A, GD>(grad, i + W) & zero);
    a0.store_unaligned(a + i);
    a1.store_unaligned(a + i + W);
  }
  for (; i < body; i += W)
    (I::load_unaligned(a + i) | (LoadGradBits<A, GD>(grad, i) & zero)).store_unaligned(a + i);
  const size_t rem = n - body;
  if (rem == 0) return;
  alignas(64) int32_t ta[W] = {};
  alignas(64) int32_t tg[W] = {};
  std::memcpy(ta, a + body, rem * 4);
  std::memcpy(tg, static_cast<const char*>(grad) + body * GradBytes(GD), rem * GradBytes(GD));
  (I::load_aligned(ta) | (LoadGradBits<A, GD>(tg, 0) & zero)).store_aligned(ta);
  std::memcpy(a + body, ta, rem * 4);
}

// Conversions over arrays (for tests).
template <class A>
void ToHalfArray(const float* in, uint16_t* out, size_t n) {
  constexpr size_t W = BF<A>::size;
  size_t i = 0;
  for (; i + W <= n; i += W) ArchIO<A>::StoreF16(out + i, BF<A>::load_unaligned(in + i), false);
  for (; i < n; ++i) {
    alignas(64) float t[W] = {};
    alignas(64) uint16_t o[W] = {};
    t[0] = in[i];
    ArchIO<A>::StoreF16(o, BF<A>::load_aligned(t), false);
    out[i] = o[0];
  }
}
template <class A>
void ToBf16Array(const float* in, uint16_t* out, size_t n) {
  constexpr size_t W = BF<A>::size;
  size_t i = 0;
  for (; i + W <= n; i += W)
    ArchIO<A>::StoreU16(out + i, FloatToBf16Bits<A>(BF<A>::load_unaligned(in + i)));
  for (; i < n; ++i) {
    alignas(64) float t[W] = {};
    alignas(64) uint16_t o[W] = {};
    t[0] = in[i];
    ArchIO<A>::StoreU16(o, FloatToBf16Bits<A>(BF<A>::load_aligned(t)));
    out[i] = o[0];
  }
}
template <class A, int GD>
void FromHalfArray(const uint16_t* in, float* out, size_t n) {
  constexpr size_t W = BF<A>::size;
  size_t i = 0;
  for (; i + W <= n; i += W) LoadGrad<A, GD>(in, i).store_unaligned(out + i);
  for (; i < n; ++i) {
    alignas(64) uint16_t t[W] = {};
    alignas(64) float o[W] = {};
    t[0] = in[i];
    LoadGrad<A, GD>(t, 0).store_aligned(o);
    out[i] = o[0];
  }
}

}  // namespace strata::cpu_adam::internal
