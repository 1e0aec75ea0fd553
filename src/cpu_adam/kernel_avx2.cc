// The kernels for AVX2 + FMA + F16C (8 fp32 lanes). Compiled with
// -mavx2 -mfma -mf16c; only called after the run-time check in cpu_adam.cc.
#include <immintrin.h>

#include "src/cpu_adam/kernel_table_impl.h"

namespace strata::cpu_adam::internal {

using Arch = xsimd::fma3<xsimd::avx2>;

template <>
struct ArchIO<Arch> {
  static BI<Arch> LoadU16(const uint16_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static __m128i Narrow(BI<Arch> x) {
    // packus works per 128-bit lane: [x0..3 x0..3 | x4..7 x4..7]; keep quads 0 and 2.
    const __m256i t = _mm256_permute4x64_epi64(_mm256_packus_epi32(x.data, x.data), 0x08);
    return _mm256_castsi256_si128(t);
  }
  static void StoreU16(uint16_t* p, BI<Arch> x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Narrow(x));
  }
  // Two vectors: one pack (per 128-bit lane: a0 b0 | a1 b1 in 4-element
  // groups) and one qword permute back to element order.
  static void StoreU16x2(uint16_t* p, BI<Arch> a, BI<Arch> b) {
    const __m256i t = _mm256_permute4x64_epi64(_mm256_packus_epi32(a.data, b.data), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), t);
  }
  static bool StreamU16(uint16_t* p, BI<Arch> x) {
    if (!IsAligned16(p)) return false;
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), Narrow(x));
    return true;
  }
  static bool StreamF32(float* p, BF<Arch> x) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) != 0) return false;
    _mm256_stream_ps(p, x.data);
    return true;
  }
  static BF<Arch> LoadF16(const uint16_t* p) {
    return FromRegister<float, Arch>(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void StoreF16(uint16_t* p, BF<Arch> x, bool nt) {
    const __m128i h = _mm256_cvtps_ph(x.data, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (nt && IsAligned16(p)) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    }
  }
  static void Fence() { _mm_sfence(); }
  static BI<Arch> LoadU8(const uint8_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void StoreU8(uint8_t* p, BI<Arch> x) {
    // x's lanes are in [0, 0xff]: pack to 16 bits, then to 8 bits.
    const __m128i w = Narrow(x);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  static BI<Arch> LoadS8(const uint8_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void StoreS8(uint8_t* p, BI<Arch> x) {
    // x's lanes are in [-128, 127]: pack to 16 bits, then to 8, signed.
    const __m256i t = _mm256_permute4x64_epi64(_mm256_packs_epi32(x.data, x.data), 0x08);
    const __m128i w = _mm256_castsi256_si128(t);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  // Four vectors in 4 shuffles instead of 12: the packs work per 128-bit
  // lane, leaving 4-byte groups in the order a0 b0 c0 d0 a1 b1 c1 d1 (a0:
  // lanes 0-3 of a); one dword permute puts them back in element order.
  static void StoreU8x4(uint8_t* p, BI<Arch> a, BI<Arch> b, BI<Arch> c, BI<Arch> d) {
    const __m256i ab = _mm256_packus_epi32(a.data, b.data);
    const __m256i cd = _mm256_packus_epi32(c.data, d.data);
    StoreGroups(p, _mm256_packus_epi16(ab, cd));
  }
  static void StoreS8x4(uint8_t* p, BI<Arch> a, BI<Arch> b, BI<Arch> c, BI<Arch> d) {
    const __m256i ab = _mm256_packs_epi32(a.data, b.data);
    const __m256i cd = _mm256_packs_epi32(c.data, d.data);
    StoreGroups(p, _mm256_packs_epi16(ab, cd));
  }
  static void StoreGroups(uint8_t* p, __m256i x) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(x, order));
  }
  static bool IsAligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
  // mag - 128 where x is negative: blendv selects by x's sign bit itself.
  static BI<Arch> SignCode8(BI<Arch> mag, BI<Arch> x) {
    const __m256 neg = _mm256_castsi256_ps(_mm256_sub_epi32(mag.data, _mm256_set1_epi32(128)));
    return FromRegister<int32_t, Arch>(_mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(mag.data), neg, _mm256_castsi256_ps(x.data))));
  }
  // Through F16C: a code's sign, exponent and mantissa bits placed in a half
  // (bit 15, bits 10-13, bits 7-9; bit 14 clear) are the code's value / 256,
  // the subnormal codes as subnormal halves, which vcvtph2ps converts
  // exactly whatever MXCSR's DAZ bit says.
  static BF<Arch> LoadExpAvg8Over256(const uint8_t* p) {
    const __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h =
        _mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
    return FromRegister<float, Arch>(_mm256_cvtph_ps(h));
  }
};

const KernelTable* Avx2Table() {
  static const KernelTable table = MakeTable<Arch>("avx2+fma");
  return &table;
}

}  // namespace strata::cpu_adam::internal
