// Run-time choice of the kernel table. xsimd 8.1's cpuid probe tells which
// instruction sets the CPU has; it does not ask the OS whether AVX/AVX-512
// register state is enabled (XGETBV), nor about F16C, AVX512VL/DQ, so the
// probe is combined with GCC's __builtin_cpu_supports, which does both. We
// pick from a table of explicitly instantiated kernels rather than calling
// xsimd::dispatch because (1) tests, `strata bench adam --isa` and
// STRATA_CPU_ISA must run a chosen ISA, (2) the pre-SSE4.2 fallback is the
// plain scalar loop, which xsimd::dispatch cannot express (it asserts the
// last arch is available).
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
             __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && fma &&
             f16c;
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

namespace {

// A named ISA → its table, or why not.
StatusOr<const KernelTable*> NamedTable(std::string_view request, std::string_view source) {
  const Support& s = Supported();
  auto unsupported = [&](std::string_view what) {
    std::string names;
    for (const KernelTable* t : UsableTables()) {
      if (!names.empty()) names += ", ";
      names += t->isa;
    }
    return NotSupportedError(std::string(source) + " \"" + std::string(request) + "\" needs " +
                             std::string(what) +
                             ", which this CPU (or OS) does not provide; usable here: " + names);
  };
  if (request == "avx512") {
    if (!s.avx512 || !Avx512Table()) return unsupported("AVX-512 F/CD/BW/DQ/VL + FMA + F16C");
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
  return InvalidArgumentError(std::string(source) + " \"" + std::string(request) +
                              "\" is not one of auto, avx512, avx2, sse4.2, scalar");
}

}  // namespace

StatusOr<const KernelTable*> SelectTable(std::string_view request) {
  if (request != "auto" && !request.empty()) return NamedTable(request, "cpu_adam: isa");
  // STRATA_CPU_ISA names the ISA of every optimizer a process makes with
  // "auto" (the engine's, the benchmarks' default): one config can be run
  // under each ISA a machine has. Every ISA gives the same bits, so it
  // changes the speed, never the results.
  const std::string env = EnvString("STRATA_CPU_ISA", "");
  if (!env.empty() && env != "auto") {
    auto t = NamedTable(env, "STRATA_CPU_ISA: isa");
    if (!t.ok()) return t.status();
    STRATA_INFO_ONCE("cpu_adam.isa_env", "cpu_adam: STRATA_CPU_ISA={} selects the {} kernels", env,
                     (*t)->isa);
    if ((*t)->lanes == 1) {
      STRATA_WARN_ONCE("cpu_adam.scalar_fallback",
                       "cpu_adam: using the plain scalar loop (slow): STRATA_CPU_ISA={}", env);
    }
    return *t;
  }
  const KernelTable* best = UsableTables().front();
  if (best->lanes == 1) {
    STRATA_WARN_ONCE("cpu_adam.scalar_fallback",
                     "cpu_adam: no usable SIMD kernels (no SSE4.2); using the plain scalar loop "
                     "(slow)");
  }
  return best;
}

}  // namespace strata::cpu_adam::internal
