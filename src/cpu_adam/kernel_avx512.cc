// The kernels for AVX-512 (F, BW, DQ, VL; 16 fp32 lanes). Compiled with
// -mavx512f -mavx512cd -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c (xsimd 13
// requires CD beside DQ; every CPU with BW/DQ/VL has it); only called after
// the run-time check in cpu_adam.cc.
#include <immintrin.h>

#include "src/cpu_adam/kernel_table_impl.h"

namespace strata::cpu_adam::internal {

using Arch = xsimd::avx512bw;

template <>
struct ArchIO<Arch> {
  static BI<Arch> LoadU16(const uint16_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void StoreU16(uint16_t* p, BI<Arch> x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x.data));  // vpmovdw
  }
  // One vpmovdw per vector already: no packing to share.
  static void StoreU16x2(uint16_t* p, BI<Arch> a, BI<Arch> b) {
    StoreU16(p, a);
    StoreU16(p + 16, b);
  }
  static bool StreamU16(uint16_t* p, BI<Arch> x) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) != 0) return false;
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x.data));
    return true;
  }
  static bool StreamF32(float* p, BF<Arch> x) {
    if ((reinterpret_cast<uintptr_t>(p) & 63) != 0) return false;
    _mm512_stream_ps(p, x.data);
    return true;
  }
  static BF<Arch> LoadF16(const uint16_t* p) {
    return FromRegister<float, Arch>(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void StoreF16(uint16_t* p, BF<Arch> x, bool nt) {
    const __m256i h = _mm512_cvtps_ph(x.data, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (nt && (reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    }
  }
  static void Fence() { _mm_sfence(); }
  static BI<Arch> LoadU8(const uint8_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void StoreU8(uint8_t* p, BI<Arch> x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x.data));  // vpmovdb
  }
  static BI<Arch> LoadS8(const uint8_t* p) {
    return FromRegister<int32_t, Arch>(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // vpmovdb keeps the low 8 bits: [-128, 127] in two's complement as is.
  static void StoreS8(uint8_t* p, BI<Arch> x) { StoreU8(p, x); }
  // One vpmovdb per vector already: no packing to share.
  static void StoreU8x4(uint8_t* p, BI<Arch> a, BI<Arch> b, BI<Arch> c, BI<Arch> d) {
    StoreU8(p, a);
    StoreU8(p + 16, b);
    StoreU8(p + 32, c);
    StoreU8(p + 48, d);
  }
  static void StoreS8x4(uint8_t* p, BI<Arch> a, BI<Arch> b, BI<Arch> c, BI<Arch> d) {
    StoreU8x4(p, a, b, c, d);
  }
  // vpmovdb keeps the low 8 bits: x's sign bit moved to bit 7 and or-ed in
  // (one ternary-logic op: mag | (t & 0x80)).
  static BI<Arch> SignCode8(BI<Arch> mag, BI<Arch> x) {
    return FromRegister<int32_t, Arch>(_mm512_ternarylogic_epi32(
        mag.data, _mm512_srli_epi32(x.data, 24), _mm512_set1_epi32(0x80), 0xf8));
  }
  // Through F16C, as in kernel_avx2.cc: the code's bits placed in a half are
  // its value / 256 (subnormal codes as subnormal halves, converted exactly
  // whatever MXCSR's DAZ bit says).
  static BF<Arch> LoadExpAvg8Over256(const uint8_t* p) {
    const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h =
        _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
    return FromRegister<float, Arch>(_mm512_cvtph_ps(h));
  }
};

const KernelTable* Avx512Table() {
  static const KernelTable table = MakeTable<Arch>("avx512");
  return &table;
}

}  // namespace strata::cpu_adam::internal
