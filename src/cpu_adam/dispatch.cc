// Run-time choice of the kernel table. xsimd 8.1's cpuid probe tells which
// instruction sets the CPU has; it does not ask the OS whether AVX/AVX-512
// register state is enabled (XGETBV), nor about F16C, AVX512VL/DQ, so the
// probe is combined with GCC's __builtin_cpu_supports, which does both. We
// pick from a table of explicitly instantiated kernels rather than calling
// xsimd::dispatch because (1) tests and `strata bench adam --isa` must run a
// chosen ISA, (2) the pre-SSE4.2 fallback is the plain scalar loop, which
// xsimd::dispatch cannot express (it asserts the last arch is available).
#include <xsimd/xsimd.hpp>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <string>

#include "src/common/env_param.h"
#include "src/common/log.h"
#include "src/cpu_adam/kernel.h"

namespace strata::cpu_adam::internal {
namespace {

struct Support {
  bool avx512 = false;
  bool avx2 = false;
  bool sse42 = false;
};

Support Detect() {
  Support s;
#if defined(__x86_64__) || defined(__i386__)
  const auto arch = xsimd::available_architectures();
  __builtin_cpu_init();
  // F16C from CPUID leaf 1 (ECX bit 29): Clang's __builtin_cpu_supports does
  // not know "f16c" before version 15.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  const bool fma = __builtin_cpu_supports("fma");
  s.sse42 = arch.sse4_2 && __builtin_cpu_supports("sse4.2");
  s.avx2 = arch.fma3_avx2 && __builtin_cpu_supports("avx2") && fma && f16c;
  s.avx512 = arch.avx512bw && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl") && fma && f16c;
#endif
  return s;
}

const Support& Supported() {
  static const Support s = Detect();
  return s;
}

}  // namespace

std::vector<const KernelTable*> UsableTables() {
  std::vector<const KernelTable*> out;
  const Support& s = Supported();
  if (s.avx512 && Avx512Table()) out.push_back(Avx512Table());
  if (s.avx2 && Avx2Table()) out.push_back(Avx2Table());
  if (s.sse42 && Sse42Table()) out.push_back(Sse42Table());
  out.push_back(&ScalarTable());
  return out;
}

StatusOr<const KernelTable*> SelectTable(std::string_view request) {
  const Support& s = Supported();
  if (request == "auto" || request.empty()) {
    // Developer knob: STRATA_CPU_ADAM_MAX_ISA=avx2|sse4.2|scalar caps the
    // automatic choice (to exercise the fallbacks on a machine that has more).
    const std::string cap = EnvString("STRATA_CPU_ADAM_MAX_ISA", "");
    const std::vector<const KernelTable*> usable = UsableTables();
    const KernelTable* best = usable.front();
    if (!cap.empty()) {
      const int cap_rank = cap == "avx512"                      ? 0
                           : cap == "avx2" || cap == "avx2+fma" ? 1
                           : cap == "sse4.2"                    ? 2
                                                                : 3;
      auto rank = [](const KernelTable* t) {
        return t->isa == "avx512" ? 0 : t->isa == "avx2+fma" ? 1 : t->isa == "sse4.2" ? 2 : 3;
      };
      for (const KernelTable* t : usable) {
        if (rank(t) >= cap_rank) {
          best = t;
          break;
        }
      }
      STRATA_INFO_ONCE("cpu_adam.isa_cap",
                       "cpu_adam: STRATA_CPU_ADAM_MAX_ISA={} caps the ISA at {}", cap, best->isa);
    }
    if (best->lanes == 1) {
      STRATA_WARN_ONCE("cpu_adam.scalar_fallback",
                       "cpu_adam: no usable SIMD kernels (no SSE4.2, or capped); using the plain "
                       "scalar loop (slow)");
    }
    return best;
  }
  auto unsupported = [&](std::string_view what) {
    return NotSupportedError("cpu_adam: isa \"" + std::string(request) + "\" needs " +
                             std::string(what) +
                             ", which this CPU (or OS) does not provide; usable here: " + [] {
                               std::string names;
                               for (const KernelTable* t : UsableTables()) {
                                 if (!names.empty()) names += ", ";
                                 names += t->isa;
                               }
                               return names;
                             }());
  };
  if (request == "avx512") {
    if (!s.avx512 || !Avx512Table()) return unsupported("AVX-512 F/BW/DQ/VL + FMA + F16C");
    return Avx512Table();
  }
  if (request == "avx2" || request == "avx2+fma") {
    if (!s.avx2 || !Avx2Table()) return unsupported("AVX2 + FMA + F16C");
    return Avx2Table();
  }
  if (request == "sse4.2" || request == "sse42") {
    if (!s.sse42 || !Sse42Table()) return unsupported("SSE4.2");
    return Sse42Table();
  }
  if (request == "scalar") return &ScalarTable();
  return InvalidArgumentError("cpu_adam: isa \"" + std::string(request) +
                              "\" is not one of auto, avx512, avx2, sse4.2, scalar");
}

}  // namespace strata::cpu_adam::internal
