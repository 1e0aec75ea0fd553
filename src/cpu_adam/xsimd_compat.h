// Internal to src/cpu_adam: what differs between the xsimd versions the
// kernels build with (Debian 12's xsimd 8.1, Debian 13's 13.x), in one place,
// so that kernel_impl.h and the per-ISA translation units have one code path.
//
//   BitCast<ToBatch>(x)        the lanes' bits as another batch type of the
//                              same arch (xsimd 8 takes the batch type,
//                              xsimd >= 9 the element type)
//   FromRegister<T, A>(r)      a batch from the ISA's raw register (__m256i,
//                              __m512, ...): explicit, as xsimd >= 9 requires
//
// Raw registers from a batch: `x.data` (a public member in every version).
#pragma once

#include <xsimd/xsimd.hpp>

#if !defined(XSIMD_VERSION_MAJOR) || XSIMD_VERSION_MAJOR < 8
#error "Strata's CPU optimizer needs xsimd 8.1 or later"
#endif

namespace strata::cpu_adam::internal {

template <class ToBatch, class T, class A>
inline ToBatch BitCast(const xsimd::batch<T, A>& x) {
#if XSIMD_VERSION_MAJOR >= 9
  return xsimd::bitwise_cast<typename ToBatch::value_type>(x);
#else
  return xsimd::bitwise_cast<ToBatch>(x);
#endif
}

template <class T, class A, class Register>
inline xsimd::batch<T, A> FromRegister(const Register& r) {
  return xsimd::batch<T, A>(r);
}

}  // namespace strata::cpu_adam::internal
