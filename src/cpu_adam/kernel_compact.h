// Internal to src/cpu_adam: the compact state formats' fused kernels
// (bf16 moments, a bf16 master, int8 moments with per-block scales) and the
// int8 codes over whole arrays, written once with xsimd on the helpers of
// kernel_impl.h; instantiated per instruction set through
// kernel_table_impl.h's MakeTable.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "src/cpu_adam/kernel_impl.h"

namespace strata::cpu_adam::internal {

// ---- Compact state formats ---------------------------------------------------
//
// The same math as FusedKernel (Adam/AdamW/Lion, the same order of float
// operations), with the state stored compactly (StateFormat, cpu_adam.h):
//   bf16         m, v as bf16 (round to nearest even), fp32 master
//   bf16-master  m, v as bf16 (nearest even), the master as bf16 written with
//                stochastic rounding keyed by (global index, step, seed)
//   int8         m, v as 8-bit codes with one fp32 scale per moment per
//                kQuantBlock elements, fp32 master
// Bytes moved per element (G grad bytes, C copy-out bytes):
//   bf16: p 4r+4w, m 2r+2w, v 2r+2w = 16 + G (+ C);  Lion 12 + G
//   bf16-master: p 2r+2w, m, v as bf16 = 12 + G (+ C)
//   int8: p 4r+4w, m 1r+1w, v 1r+1w, scales 16/256 = 12.0625 + G (+ C)
// The element range is walked in groups of kQuantBlock elements (a block
// for int8): the update of the group, then its copy-out while the params
// are still in L1. For int8 the group's new moments (2 KiB) are kept in a
// stack buffer until the block's absmax (and so its new scale) is known,
// and encoded four vectors at a time between the next block's updates
// (Pending), so that the encoding's arithmetic overlaps that block's loads
// from DRAM — still one pass over DRAM.
//
// The codes are state_codes.h's, lane by lane (tested bit for bit against
// it at every code boundary), computed with fewer vector operations: one
// rounding for both ranges of a code (RoundToCode) and, where the ISA has
// F16C, exp_avg codes decoded as halves (ArchIO<A>::LoadExpAvg8Over256,
// then times the block scale * 256: the same product as code * scale, both
// factors exact, for every scale up to FLT_MAX / 256, and MakeBlockScale's
// are at most FLT_MAX / 480).

template <class A>
using BU = xsimd::batch<uint32_t, A>;

// Lanes 0, 1, ..., W-1.
template <class A>
inline BU<A> Iota() {
  alignas(64) static constexpr uint32_t kIota[16] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                     8, 9, 10, 11, 12, 13, 14, 15};
  return BU<A>::load_aligned(kIota);
}

template <class A>
inline BU<A> Mix32(BU<A> x) {  // state_codes.h Mix32, per lane
  x ^= x >> 16;
  x *= BU<A>(0x7feb352du);
  x ^= x >> 15;
  x *= BU<A>(0x846ca68bu);
  x ^= x >> 16;
  return x;
}

// SrBits of the W consecutive global indices starting at `index`.
template <class A>
inline BU<A> SrBitsVec(uint64_t index, uint32_t k0, uint32_t k1) {
  constexpr size_t W = BU<A>::size;
  const uint32_t lo0 = static_cast<uint32_t>(index), hi0 = static_cast<uint32_t>(index >> 32);
  const BU<A> lo = BU<A>(lo0) + Iota<A>();
  const SrKey key{k0, k1};
  if (lo0 <= UINT32_MAX - (W - 1)) {  // one high half for the whole vector (all but 1 in 2^32/W)
    return Mix32<A>(lo ^ BU<A>(SrHighKey(hi0, key)));
  }
  // The vector crosses a multiple of 2^32: lanes past it have the next high half.
  alignas(64) uint32_t k[W];
  for (size_t l = 0; l < W; ++l) k[l] = SrHighKey(static_cast<uint32_t>((index + l) >> 32), key);
  return Mix32<A>(lo ^ BU<A>::load_aligned(k));
}

// FloatToBf16Stochastic per lane; lanes end up in [0, 0xffff].
template <class A>
inline BI<A> FloatToBf16StochasticVec(BF<A> f, BU<A> random) {
  const BU<A> u = BitCast<BU<A>>(f);
  const BU<A> rounded = (u + (random >> 16)) >> 16;
  const BU<A> quiet = (u >> 16) | BU<A>(0x40u);
  const BF<A> r = xsimd::select(xsimd::isnan(f), BitCast<BF<A>>(quiet), BitCast<BF<A>>(rounded));
  return BitCast<BI<A>>(r);
}

// The rounding of both 8-bit codes, with no branch between their normal and
// subnormal ranges: y (code units, >= 0, not NaN, at most the code maximum)
// to its code magnitude, ties to even; kEmin is the smallest normal code
// exponent (1 - the code's bias). With E = max(exponent of y, kEmin), the
// codes around y are 2^(E - 3) apart (the subnormal codes included), and
// adding M = 2^(E + 20), whose ulp is that spacing, rounds y to them (the
// float add's own round-to-nearest-even): bits(y + M) - bits(M) is the
// number of steps, and each binade above kEmin's adds 8 codes:
//   code = bits(y + M) - bits(M) + 8 (E - kEmin).
// The same codes as state_codes.h's two-branch form for every float (checked
// over all 2^32 inputs when this was written; tested at every boundary).
template <class A, int kEmin>
inline BI<A> RoundToCode(BF<A> y) {
  using I = BI<A>;
  constexpr int32_t kE0 = (kEmin + 127) << 23;
  const I d = xsimd::max((BitCast<I>(y) & I(0x7f800000)) - I(kE0), I(0));  // (E - kEmin) << 23
  const I mb = d + I(kE0 + (20 << 23));                                    // bits(M)
  const I t = BitCast<I>(y + BitCast<BF<A>>(mb));
  return t - mb + (d >> 20);
}

// min(y, code_max) for y = |x| * inv, NaN included (it saturates, as in the
// scalar code): an unsigned integer min of the bits, as every such y is +0,
// positive or a NaN of either sign (0 * inf gives a negative one), whose
// bits are above code_max's. (An integer min runs on any vector port; a
// float min shares the multiply ports with the rest of the step.)
template <class A>
inline BF<A> ClampCode(BF<A> y, float code_max) {
  using U = BU<A>;
  return BitCast<BF<A>>(xsimd::min(BitCast<U>(y), U(std::bit_cast<uint32_t>(code_max))));
}

// EncodeExpAvg8 per lane: the code's magnitude with the sign of x as bit 7,
// in the lane form ArchIO<A>::StoreS8 stores (SignCode8).
template <class A>
inline BI<A> EncodeExpAvg8Vec(BF<A> x, BF<A> inv) {
  using I = BI<A>;
  using B = BF<A>;
  const I u = BitCast<I>(x);
  const B y = ClampCode<A>(BitCast<B>(u & I(0x7fffffff)) * inv, kExpAvgCodeMax);
  // u's sign bit: x's (-0 and a negative NaN included).
  return ArchIO<A>::SignCode8(RoundToCode<A, 1 - 7>(y), u);
}

// DecodeExpAvg8 per lane (code units) by bit arithmetic, for ISAs without
// F16C (LoadExpAvg8Over256), from a sign-extended code (LoadS8):
// lanes in [-128, 127], bit 31 set exactly where the code's sign bit is.
template <class A>
inline BF<A> DecodeExpAvg8Vec(BI<A> c) {
  using I = BI<A>;
  using B = BF<A>;
  const I mag = c & I(0x7f);
  const I sub = BitCast<I>(xsimd::to_float(mag) * B(1.f / 512.f));
  const I norm = (mag << 20) + I(120 << 23);
  return BitCast<B>(xsimd::select(mag > I(7), norm, sub) | (c & I(INT32_MIN)));
}

// EncodeExpAvgSq8 per lane.
template <class A>
inline BI<A> EncodeExpAvgSq8Vec(BF<A> x, BF<A> inv) {
  using I = BI<A>;
  const I xb = BitCast<I>(x);
  const BF<A> y = ClampCode<A>(BitCast<BF<A>>(xb & I(0x7fffffff)) * inv, kExpAvgSqCodeMax);
  // A positive x never gets code 0: max(code, min(x's bits, 1)) as signed
  // integers, 1 where x > 0 and 0 or negative elsewhere (a NaN, positive as
  // an integer, has saturated to the largest code already).
  return xsimd::max(RoundToCode<A, 1 - 15>(y), xsimd::min(xb, I(1)));
}

template <class A>
inline BF<A> DecodeExpAvgSq8Vec(BI<A> c) {
  using I = BI<A>;
  using B = BF<A>;
  const I sub = BitCast<I>(xsimd::to_float(c) * B(1.f / 131072.f));
  const I norm = (c << 20) + I(112 << 23);
  return BitCast<B>(xsimd::select(c > I(7), norm, sub));
}

template <class A, StateFormat SF, KernelOp OP, int GD>
struct CompactKernel {
  using B = BF<A>;
  using I = BI<A>;
  static constexpr size_t W = B::size;
  static constexpr bool kInt8 = SF == StateFormat::kInt8;
  static constexpr bool kMaster16 = SF == StateFormat::kBf16Master;
  static constexpr bool kRoof = OP == KernelOp::kRoofline;
  static constexpr bool kHasS1 = OP != KernelOp::kLion;
  static constexpr size_t kSB = kInt8 ? 1 : 2;  // bytes per stored moment
  static_assert(kQuantBlock % W == 0);

  // The arrays of one range, element 0 at the range's start. A tail points
  // them at padded stack copies.
  struct View {
    float* p;        // fp32 master (bf16, int8)
    uint16_t* pc;    // bf16 master (bf16-master)
    const void* g;   // grad
    const float* f;  // fold accumulator or null
    uint8_t* s0;     // moments: bf16 bits or codes
    uint8_t* s1;
  };

  // Element i of a moment array (bf16 bits or an 8-bit code), zero-extended.
  static inline I LoadState(const uint8_t* s, size_t i) {
    if constexpr (kInt8) {
      return ArchIO<A>::LoadU8(s + i);
    } else {
      return ArchIO<A>::LoadU16(reinterpret_cast<const uint16_t*>(s) + i);
    }
  }
  static inline void StoreState(uint8_t* s, size_t i, I x) {
    if constexpr (kInt8) {
      ArchIO<A>::StoreU8(s + i, x);
    } else {
      ArchIO<A>::StoreU16(reinterpret_cast<uint16_t*>(s) + i, x);
    }
  }

  // Updates the W elements at index i of `v` (global index gidx). bf16
  // formats store the moments unless kDefer; int8 (and kDefer) return them
  // in *m_out, *v_out (int8: the caller encodes them once the block's scale
  // is known; bf16: the caller stores two vectors' moments at once). sc0,
  // sc1: the block's current scales (int8), sc0 times 256 (the exp_avg
  // codes load as their values / 256).
  template <int F, bool kDefer = false>
  static inline void Vec(const View& v, size_t i, uint64_t gidx, const KernelArgs& a,
                         const Coeffs& c, float sc0, float sc1, B* m_out, B* v_out) {
    const B g = LoadFoldedGrad<A, GD, F>(v.g, v.f, i) * B(c.grad_scale);
    if constexpr (kRoof) {
      // The same loads and stores, values unchanged: bits | (g's bits & 0).
      static volatile int32_t opaque_zero = 0;
      const I z = BitCast<I>(g) & I(opaque_zero);
      if constexpr (kMaster16) {
        ArchIO<A>::StoreU16(v.pc + i, ArchIO<A>::LoadU16(v.pc + i) | z);
      } else {
        BitCast<B>(BitCast<I>(B::load_unaligned(v.p + i)) | z).store_unaligned(v.p + i);
      }
      StoreState(v.s0, i, LoadState(v.s0, i) | z);
      StoreState(v.s1, i, LoadState(v.s1, i) | z);
      return;
    } else {
      B p =
          kMaster16 ? Bf16BitsToFloat<A>(ArchIO<A>::LoadU16(v.pc + i)) : B::load_unaligned(v.p + i);
      B m(0.f), vv(0.f);  // (Lion has no vv: it stays 0)
      if constexpr (kInt8) {
        m = ArchIO<A>::LoadExpAvg8Over256(v.s0 + i) * B(sc0);  // (sc0: the scale * 256)
      } else {
        m = Bf16BitsToFloat<A>(LoadState(v.s0, i));
      }
      if constexpr (OP == KernelOp::kLion) {
        LionUpdate<A>(g, p, m, c);
      } else {
        const I v_raw = LoadState(v.s1, i);
        if constexpr (kInt8) {
          vv = DecodeExpAvgSq8Vec<A>(v_raw) * B(sc1);
        } else {
          vv = Bf16BitsToFloat<A>(v_raw);
        }
        AdamUpdate<A, OP>(g, p, m, vv, c);
      }
      if constexpr (kMaster16) {
        ArchIO<A>::StoreU16(
            v.pc + i, FloatToBf16StochasticVec<A>(p, SrBitsVec<A>(gidx, a.sr_key0, a.sr_key1)));
      } else {
        p.store_unaligned(v.p + i);
      }
      if constexpr (kInt8 || kDefer) {
        *m_out = m;
        *v_out = vv;
      } else {
        StoreState(v.s0, i, FloatToBf16Bits<A>(m));
        if constexpr (kHasS1) StoreState(v.s1, i, FloatToBf16Bits<A>(vv));
      }
    }
  }

  // int8: a block whose new moments wait in a stack buffer for their codes
  // (its scales known), encoded while the next block is updated, so that
  // the loads of the update keep memory busy through the encoding.
  struct Pending {
    uint8_t* c0 = nullptr;  // the block's codes; null: nothing pending
    uint8_t* c1 = nullptr;
    const float* mb = nullptr;  // its new moments
    const float* vb = nullptr;
    float inv0 = 0.f, inv1 = 0.f;  // 1 / its new scales
    size_t len = 0;
  };

  // The codes of the pending block's elements [j, j + 4W) (in the block).
  static inline void Encode4(const Pending& p, size_t j) {
    const B inv0(p.inv0), inv1(p.inv1);
    const float* mb = p.mb + j;
    ArchIO<A>::StoreS8x4(p.c0 + j, EncodeExpAvg8Vec<A>(B::load_aligned(mb), inv0),
                         EncodeExpAvg8Vec<A>(B::load_aligned(mb + W), inv0),
                         EncodeExpAvg8Vec<A>(B::load_aligned(mb + 2 * W), inv0),
                         EncodeExpAvg8Vec<A>(B::load_aligned(mb + 3 * W), inv0));
    if constexpr (kHasS1) {
      const float* vb = p.vb + j;
      ArchIO<A>::StoreU8x4(p.c1 + j, EncodeExpAvgSq8Vec<A>(B::load_aligned(vb), inv1),
                           EncodeExpAvgSq8Vec<A>(B::load_aligned(vb + W), inv1),
                           EncodeExpAvgSq8Vec<A>(B::load_aligned(vb + 2 * W), inv1),
                           EncodeExpAvgSq8Vec<A>(B::load_aligned(vb + 3 * W), inv1));
    }
  }

  // The codes of the pending block's elements from j (a multiple of W) to
  // its end.
  static inline void EncodeFrom(const Pending& p, size_t j) {
    const size_t full = p.len / W * W;
    for (; j + 4 * W <= full; j += 4 * W) Encode4(p, j);
    const B inv0(p.inv0), inv1(p.inv1);
    for (; j < full; j += W) {
      ArchIO<A>::StoreS8(p.c0 + j, EncodeExpAvg8Vec<A>(B::load_aligned(p.mb + j), inv0));
      if constexpr (kHasS1)
        ArchIO<A>::StoreU8(p.c1 + j, EncodeExpAvgSq8Vec<A>(B::load_aligned(p.vb + j), inv1));
    }
    const size_t rem = p.len - full;
    if (rem != 0) {  // (the buffers hold a whole vector past full: zero padding)
      alignas(64) uint8_t t[W];
      ArchIO<A>::StoreS8(t, EncodeExpAvg8Vec<A>(B::load_aligned(p.mb + full), inv0));
      std::memcpy(p.c0 + full, t, rem);
      if constexpr (kHasS1) {
        ArchIO<A>::StoreU8(t, EncodeExpAvgSq8Vec<A>(B::load_aligned(p.vb + full), inv1));
        std::memcpy(p.c1 + full, t, rem);
      }
    }
  }

  // The group [s, s + len) of the range `v` (len <= kQuantBlock; for int8
  // s is a block start and blk its block in the scale arrays).
  // (v by value: the compiler then knows the stores below cannot change
  // its pointers, and keeps them in registers.)
  // int8: the block's new moments go to mb, vb (kQuantBlock floats each),
  // the pending block's codes are written during the update, and the block
  // becomes the pending one.
  template <int F>
  static inline void Group(const View v, size_t s, size_t len, uint64_t gidx, size_t blk,
                           const KernelArgs& a, const Coeffs& c, float* mb, float* vb,
                           Pending& pend) {
    float sc0 = 0.f, sc1 = 0.f;
    if constexpr (kInt8) {
      sc0 = a.scale0[blk] * 256.f;  // (exact: LoadExpAvg8Over256's codes are / 256)
      if constexpr (kHasS1) sc1 = a.scale1[blk];
    }
    B amax0(0.f), amax1(0.f);
    const size_t full = len / W * W;
    size_t j = 0;
    if constexpr (!kInt8 && !kRoof) {
      // bf16 moments two vectors at a time: one pack per pair of stores.
      for (; j + 2 * W <= full; j += 2 * W) {
        B m0(0.f), v0(0.f), m1(0.f), v1(0.f);
        Vec<F, true>(v, s + j, gidx + j, a, c, sc0, sc1, &m0, &v0);
        Vec<F, true>(v, s + j + W, gidx + j + W, a, c, sc0, sc1, &m1, &v1);
        auto* const s0 = reinterpret_cast<uint16_t*>(v.s0) + s + j;
        ArchIO<A>::StoreU16x2(s0, FloatToBf16Bits<A>(m0), FloatToBf16Bits<A>(m1));
        if constexpr (kHasS1) {
          auto* const s1 = reinterpret_cast<uint16_t*>(v.s1) + s + j;
          ArchIO<A>::StoreU16x2(s1, FloatToBf16Bits<A>(v0), FloatToBf16Bits<A>(v1));
        }
      }
    }
    size_t encoded = 0;  // of the pending block
    if constexpr (kInt8 && !kRoof) {
      // Four vectors' update, then four of the pending block's codes.
      for (; j + 4 * W <= full; j += 4 * W) {
        for (size_t k = 0; k < 4 * W; k += W) {
          B m(0.f), vv(0.f);
          Vec<F>(v, s + j + k, gidx + j + k, a, c, sc0, sc1, &m, &vv);
          m.store_aligned(mb + j + k);
          amax0 = xsimd::max(amax0, xsimd::abs(m));
          if constexpr (kHasS1) {
            vv.store_aligned(vb + j + k);
            amax1 = xsimd::max(amax1, xsimd::abs(vv));
          }
        }
        if (pend.c0 != nullptr && j + 4 * W <= pend.len / W * W) {
          Encode4(pend, j);
          encoded = j + 4 * W;
        }
      }
    }
    for (; j < full; j += W) {
      B m(0.f), vv(0.f);  // (Vec sets them for int8 only)
      Vec<F>(v, s + j, gidx + j, a, c, sc0, sc1, &m, &vv);
      if constexpr (kInt8 && !kRoof) {
        m.store_aligned(mb + j);
        amax0 = xsimd::max(amax0, xsimd::abs(m));
        if constexpr (kHasS1) {
          vv.store_aligned(vb + j);
          amax1 = xsimd::max(amax1, xsimd::abs(vv));
        }
      }
    }
    const size_t rem = len - full;
    if (rem != 0) {
      // The same vector code on zero-padded copies (zeros stay zeros through
      // the update, so the padding lanes do not change the block's absmax).
      alignas(64) float tp[W] = {}, tf[W] = {};
      alignas(64) uint16_t tpc[W] = {};
      alignas(64) uint8_t tg[W * 4] = {}, ts0[W * 2] = {}, ts1[W * 2] = {};
      const size_t e = s + full;
      if constexpr (kMaster16) {
        std::memcpy(tpc, v.pc + e, rem * 2);
      } else {
        std::memcpy(tp, v.p + e, rem * 4);
      }
      std::memcpy(tg, static_cast<const char*>(v.g) + e * GradBytes(GD), rem * GradBytes(GD));
      if (v.f != nullptr) std::memcpy(tf, v.f + e, rem * 4);
      std::memcpy(ts0, v.s0 + e * kSB, rem * kSB);
      if constexpr (kHasS1) std::memcpy(ts1, v.s1 + e * kSB, rem * kSB);
      const View t{tp, tpc, tg, v.f != nullptr ? tf : nullptr, ts0, ts1};
      B m(0.f), vv(0.f);  // (Vec sets them for int8 only)
      Vec<F>(t, 0, gidx + full, a, c, sc0, sc1, &m, &vv);
      if constexpr (kMaster16) {
        std::memcpy(v.pc + e, tpc, rem * 2);
      } else {
        std::memcpy(v.p + e, tp, rem * 4);
      }
      if constexpr (kInt8 && !kRoof) {
        m.store_aligned(mb + full);  // full + W <= kQuantBlock
        amax0 = xsimd::max(amax0, xsimd::abs(m));
        if constexpr (kHasS1) {
          vv.store_aligned(vb + full);
          amax1 = xsimd::max(amax1, xsimd::abs(vv));
        }
      } else {
        std::memcpy(v.s0 + e * kSB, ts0, rem * kSB);
        if constexpr (kHasS1) std::memcpy(v.s1 + e * kSB, ts1, rem * kSB);
      }
    }
    if constexpr (kInt8 && kRoof) {
      static volatile uint32_t opaque_zero = 0;
      const uint32_t z = opaque_zero;
      a.scale0[blk] = std::bit_cast<float>(std::bit_cast<uint32_t>(a.scale0[blk]) | z);
      a.scale1[blk] = std::bit_cast<float>(std::bit_cast<uint32_t>(a.scale1[blk]) | z);
    } else if constexpr (kInt8) {
      if (pend.c0 != nullptr) EncodeFrom(pend, encoded);
      // The block's new scales (the max is exact, so any lane order gives
      // the same absmax); its codes are written with the next block.
      const BlockScale q0 = MakeBlockScale(HMax(amax0), kExpAvgCodeMax);
      a.scale0[blk] = q0.scale;
      BlockScale q1{};
      if constexpr (kHasS1) {
        q1 = MakeBlockScale(HMax(amax1), kExpAvgSqCodeMax);
        a.scale1[blk] = q1.scale;
      }
      pend = Pending{v.s0 + s, kHasS1 ? v.s1 + s : nullptr, mb, vb, q0.inv, q1.inv, len};
    }
  }

  static inline float HMax(B x) {
    alignas(64) float l[W];
    x.store_aligned(l);
    float r = l[0];
    for (size_t k = 1; k < W; ++k) r = l[k] > r ? l[k] : r;
    return r;
  }

  // The copy-out of [s, s + len): converted from the stored master.
  template <CopyOut CO>
  static inline void CopyGroup(const View& v, void* cp, size_t s, size_t len) {
    auto master = [&](const float* p, const uint16_t* pc, size_t i) {
      if constexpr (kMaster16) {
        return Bf16BitsToFloat<A>(ArchIO<A>::LoadU16(pc + i));
      } else {
        return B::load_unaligned(p + i);
      }
    };
    const size_t full = len / W * W;
    for (size_t j = s; j < s + full; j += W) StoreCopy<A, CO>(cp, j, master(v.p, v.pc, j), false);
    const size_t rem = len - full;
    if (rem == 0) return;
    alignas(64) float tp[W] = {}, tc[W] = {};
    alignas(64) uint16_t tpc[W] = {};
    const size_t e = s + full;
    if constexpr (kMaster16) {
      std::memcpy(tpc, v.pc + e, rem * 2);
    } else {
      std::memcpy(tp, v.p + e, rem * 4);
    }
    StoreCopy<A, CO>(tc, 0, master(tp, tpc, 0), false);
    std::memcpy(static_cast<char*>(cp) + e * CopyBytes(CO), tc, rem * CopyBytes(CO));
  }

  // Elements [off, off + n) of the call (off a multiple of kQuantBlock).
  static inline void Range(const KernelArgs& a, size_t off, size_t n) {
    const View v{
        kMaster16 ? nullptr : a.param + off,
        kMaster16 ? static_cast<uint16_t*>(a.param_c) + off : nullptr,
        static_cast<const char*>(a.grad) + off * GradBytes(GD),
        a.folded && a.fold != nullptr ? a.fold + off : nullptr,
        static_cast<uint8_t*>(a.state0_c) + off * kSB,
        kHasS1 ? static_cast<uint8_t*>(a.state1_c) + off * kSB : nullptr,
    };
    const Coeffs c = a.c;
    // int8: two blocks' new moments, the block being updated and the pending one.
    constexpr size_t kBuf = kInt8 && !kRoof ? kQuantBlock : 1;
    alignas(64) float buf[2][kHasS1 ? 2 : 1][kBuf];
    Pending pend;
    for (size_t s = 0; s < n; s += kQuantBlock) {
      const size_t len = std::min(kQuantBlock, n - s);
      const uint64_t gidx = a.index0 + off + s;
      const size_t blk = (off + s) / kQuantBlock;
      float* const mb = buf[(s / kQuantBlock) & 1][0];
      float* const vb = buf[(s / kQuantBlock) & 1][kHasS1 ? 1 : 0];
      if (!a.folded) {
        Group<kNoFold>(v, s, len, gidx, blk, a, c, mb, vb, pend);
      } else if (v.f != nullptr) {
        Group<kFoldAcc>(v, s, len, gidx, blk, a, c, mb, vb, pend);
      } else {
        Group<kFoldZero>(v, s, len, gidx, blk, a, c, mb, vb, pend);
      }
      switch (a.copy) {
        case CopyOut::kNone:
          break;
        case CopyOut::kFp32:
          CopyGroup<CopyOut::kFp32>(v, static_cast<char*>(a.copy_out) + off * 4, s, len);
          break;
        case CopyOut::kFp16:
          CopyGroup<CopyOut::kFp16>(v, static_cast<char*>(a.copy_out) + off * 2, s, len);
          break;
        case CopyOut::kBf16:
          CopyGroup<CopyOut::kBf16>(v, static_cast<char*>(a.copy_out) + off * 2, s, len);
          break;
      }
    }
    if constexpr (kInt8 && !kRoof) {
      if (pend.c0 != nullptr) EncodeFrom(pend, 0);
    }
  }

  static bool Run(const KernelArgs& a, bool check_finite) {
    if (a.folded || !check_finite) {  // check_finite is refused with a fold (cpu_adam.cc)
      Range(a, 0, a.n);
      return true;
    }
    // (kCheckChunk % kQuantBlock == 0: the chunks hold whole blocks.)
    return StepFiniteChunks(
        a.n,
        [&](size_t off, size_t len) {
          return RangeFinite<A, GD>(static_cast<const char*>(a.grad) + off * GradBytes(GD), len,
                                    a.c.grad_scale);
        },
        [&](size_t off, size_t len) { Range(a, off, len); });
  }
};
static_assert(kCheckChunk % kQuantBlock == 0);

template <class A, StateFormat SF, KernelOp OP>
constexpr void FillCompact(KernelTable& t) {
  constexpr int f = static_cast<int>(SF) - 1;
  t.compact[f][int(OP)][0] = &CompactKernel<A, SF, OP, 0>::Run;
  t.compact[f][int(OP)][1] = &CompactKernel<A, SF, OP, 1>::Run;
  t.compact[f][int(OP)][2] = &CompactKernel<A, SF, OP, 2>::Run;
}

// Whole arrays in the int8 codes (KernelTable::quantize_q8, dequantize_q8):
// per block the absmax, the scale, then the codes, as the kernels do.
template <class A, bool SQ>
void QuantizeQ8Array(const float* in, size_t n, uint8_t* codes, float* scales) {
  using B = BF<A>;
  constexpr size_t W = B::size;
  auto encode = [](B x, B inv) {
    if constexpr (SQ) {
      return EncodeExpAvgSq8Vec<A>(x, inv);
    } else {
      return EncodeExpAvg8Vec<A>(x, inv);
    }
  };
  auto store = [](uint8_t* p, BI<A> c) {
    if constexpr (SQ) {
      ArchIO<A>::StoreU8(p, c);
    } else {
      ArchIO<A>::StoreS8(p, c);
    }
  };
  for (size_t s = 0, b = 0; s < n; s += kQuantBlock, ++b) {
    const size_t len = std::min(kQuantBlock, n - s), full = len / W * W;
    alignas(64) float t[W] = {};
    if (len != full) std::memcpy(t, in + s + full, (len - full) * 4);
    B amax(0.f);
    for (size_t j = 0; j < full; j += W)
      amax = xsimd::max(amax, xsimd::abs(B::load_unaligned(in + s + j)));
    if (len != full) amax = xsimd::max(amax, xsimd::abs(B::load_aligned(t)));
    alignas(64) float l[W];
    amax.store_aligned(l);
    float m = l[0];
    for (size_t k = 1; k < W; ++k) m = l[k] > m ? l[k] : m;
    const BlockScale q = MakeBlockScale(m, SQ ? kExpAvgSqCodeMax : kExpAvgCodeMax);
    scales[b] = q.scale;
    for (size_t j = 0; j < full; j += W)
      store(codes + s + j, encode(B::load_unaligned(in + s + j), B(q.inv)));
    if (len != full) {
      alignas(64) uint8_t o[W];
      store(o, encode(B::load_aligned(t), B(q.inv)));
      std::memcpy(codes + s + full, o, len - full);
    }
  }
}

template <class A, bool SQ>
void DequantizeQ8Array(const uint8_t* codes, const float* scales, size_t n, float* out) {
  using B = BF<A>;
  constexpr size_t W = B::size;
  auto decode = [](const uint8_t* p) {  // the codes at p as the kernels load them
    if constexpr (SQ) {
      return DecodeExpAvgSq8Vec<A>(ArchIO<A>::LoadU8(p));
    } else {
      return ArchIO<A>::LoadExpAvg8Over256(p);
    }
  };
  for (size_t s = 0, b = 0; s < n; s += kQuantBlock, ++b) {
    const size_t len = std::min(kQuantBlock, n - s), full = len / W * W;
    const B sc(SQ ? scales[b] : scales[b] * 256.f);  // (exp_avg: LoadExpAvg8Over256)
    for (size_t j = 0; j < full; j += W) (decode(codes + s + j) * sc).store_unaligned(out + s + j);
    if (len != full) {
      alignas(64) uint8_t c[W] = {};
      alignas(64) float o[W];
      std::memcpy(c, codes + s + full, len - full);
      (decode(c) * sc).store_aligned(o);
      std::memcpy(out + s + full, o, (len - full) * 4);
    }
  }
}

template <class A>
void StochasticBf16Array(const float* in, uint16_t* out, size_t n, uint64_t index0, uint32_t k0,
                         uint32_t k1) {
  using B = BF<A>;
  constexpr size_t W = B::size;
  const size_t full = n / W * W;
  for (size_t i = 0; i < full; i += W)
    ArchIO<A>::StoreU16(out + i, FloatToBf16StochasticVec<A>(B::load_unaligned(in + i),
                                                             SrBitsVec<A>(index0 + i, k0, k1)));
  if (full == n) return;
  alignas(64) float t[W] = {};
  alignas(64) uint16_t o[W];
  std::memcpy(t, in + full, (n - full) * 4);
  ArchIO<A>::StoreU16(
      o, FloatToBf16StochasticVec<A>(B::load_aligned(t), SrBitsVec<A>(index0 + full, k0, k1)));
  std::memcpy(out + full, o, (n - full) * 2);
}

}  // namespace strata::cpu_adam::internal
