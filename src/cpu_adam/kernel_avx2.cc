// The kernels for AVX2 + FMA + F16C (8 fp32 lanes). Compiled with
// -mavx2 -mfma -mf16c; only called after the run-time check in cpu_adam.cc.
#include <immintrin.h>

#include "src/cpu_adam/kernel_impl.h"

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
  static bool IsAligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
};

const KernelTable* Avx2Table() {
  static const KernelTable table = MakeTable<Arch>("avx2+fma");
  return &table;
}

}  // namespace strata::cpu_adam::internal
