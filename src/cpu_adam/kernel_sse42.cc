// The kernels for SSE4.2 (4 fp32 lanes, no FMA, no F16C): fp16 conversions by
// bit arithmetic, xsimd's fma as multiply + add. Compiled with -msse4.2.
#include <immintrin.h>

#include "src/cpu_adam/kernel_table_impl.h"

namespace strata::cpu_adam::internal {

using Arch = xsimd::sse4_2;

template <>
struct ArchIO<Arch> {
  static BI<Arch> LoadU16(const uint16_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void StoreU16(uint16_t* p, BI<Arch> x) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(x.data, x.data));
  }
  static void StoreU16x2(uint16_t* p, BI<Arch> a, BI<Arch> b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(a.data, b.data));
  }
  static bool StreamU16(uint16_t* p, BI<Arch> x) {
    if ((reinterpret_cast<uintptr_t>(p) & 7) != 0) return false;
    _mm_stream_si64(reinterpret_cast<long long*>(p),
                    _mm_cvtsi128_si64(_mm_packus_epi32(x.data, x.data)));
    return true;
  }
  static bool StreamF32(float* p, BF<Arch> x) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
    _mm_stream_ps(p, x.data);
    return true;
  }
  static BF<Arch> LoadF16(const uint16_t* p) { return HalfBitsToFloatGeneric<Arch>(LoadU16(p)); }
  static void StoreF16(uint16_t* p, BF<Arch> x, bool nt) {
    const BI<Arch> h = FloatToHalfBitsGeneric<Arch>(x);
    if (nt && StreamU16(p, h)) return;
    StoreU16(p, h);
  }
  static void Fence() { _mm_sfence(); }
  // 4 bytes (one vector of 8-bit codes) to and from the low lane of a register.
  static __m128i Load4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm_cvtsi32_si128(v);
  }
  static void Store4(uint8_t* p, __m128i x) {
    const int32_t v = _mm_cvtsi128_si32(x);
    std::memcpy(p, &v, 4);
  }
  static BI<Arch> LoadU8(const uint8_t* p) {
    return FromRegister<int32_t, Arch>(_mm_cvtepu8_epi32(Load4(p)));
  }
  static void StoreU8(uint8_t* p, BI<Arch> x) {
    const __m128i w = _mm_packus_epi32(x.data, x.data);
    Store4(p, _mm_packus_epi16(w, w));
  }
  static BI<Arch> LoadS8(const uint8_t* p) {
    return FromRegister<int32_t, Arch>(_mm_cvtepi8_epi32(Load4(p)));
  }
  static void StoreS8(uint8_t* p, BI<Arch> x) {
    const __m128i w = _mm_packs_epi32(x.data, x.data);
    Store4(p, _mm_packs_epi16(w, w));
  }
  static void StoreU8x4(uint8_t* p, BI<Arch> a, BI<Arch> b, BI<Arch> c, BI<Arch> d) {
    const __m128i ab = _mm_packus_epi32(a.data, b.data), cd = _mm_packus_epi32(c.data, d.data);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(ab, cd));
  }
  static void StoreS8x4(uint8_t* p, BI<Arch> a, BI<Arch> b, BI<Arch> c, BI<Arch> d) {
    const __m128i ab = _mm_packs_epi32(a.data, b.data), cd = _mm_packs_epi32(c.data, d.data);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(ab, cd));
  }
  // mag - 128 where x is negative: blendv selects by x's sign bit itself.
  static BI<Arch> SignCode8(BI<Arch> mag, BI<Arch> x) {
    const __m128 neg = _mm_castsi128_ps(_mm_sub_epi32(mag.data, _mm_set1_epi32(128)));
    return FromRegister<int32_t, Arch>(
        _mm_castps_si128(_mm_blendv_ps(_mm_castsi128_ps(mag.data), neg, _mm_castsi128_ps(x.data))));
  }
  // No F16C here: the codes' bit arithmetic.
  static BF<Arch> LoadExpAvg8Over256(const uint8_t* p) {
    return DecodeExpAvg8Vec<Arch>(LoadS8(p)) * BF<Arch>(1.f / 256.f);
  }
};

const KernelTable* Sse42Table() {
  static const KernelTable table = MakeTable<Arch>("sse4.2");
  return &table;
}

}  // namespace strata::cpu_adam::internal
