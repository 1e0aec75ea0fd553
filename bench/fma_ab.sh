#!/usr/bin/env bash
# The AVX2 optimizer kernels with fused multiply-adds (xsimd's fma, as they
# were up to commit f25a2df) against today's unfused ones (MulAdd), in one
# process, interleaved, with the roofline kernel (the same loads and stores)
# as the bound: AdamW over 2^26 elements, bf16 gradient and copy-out, fp32
# and bf16 states. Medians of 15 repetitions, and of each repetition's
# new/old ratio.
#
#   bench/fma_ab.sh [THREADS] [OLD_COMMIT]      (default 2, f25a2df)
#
# Needs the git history (the old kernels are read from OLD_COMMIT), g++ and
# an AVX2 + FMA + F16C CPU. Builds in a temporary directory.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
threads=${1:-2}
old=${2:-f25a2df}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src/cpu_adam"
git -C "$ROOT" show "$old:src/cpu_adam/kernel_impl.h" |
  sed 's/namespace strata::cpu_adam::internal {/namespace strata::cpu_adam::internal_fused {\nusing namespace strata::cpu_adam::internal;/; s|}  // namespace strata::cpu_adam::internal|}  // namespace internal_fused|' \
    >"$tmp/src/cpu_adam/kernel_impl_fused.h"
archio() { sed -n '/^template <>$/,/^};$/p'; }
git -C "$ROOT" show "$old:src/cpu_adam/kernel_avx2.cc" | archio >"$tmp/archio_old.inc"
archio <"$ROOT/src/cpu_adam/kernel_avx2.cc" >"$tmp/archio_new.inc"
cat >"$tmp/tu_new.cc" <<'CC'
#include <immintrin.h>
#include "src/cpu_adam/kernel_impl.h"
namespace strata::cpu_adam::internal {
using Arch = xsimd::fma3<xsimd::avx2>;
#include "archio_new.inc"
KernelTable MakeNew() { return MakeTable<Arch>("avx2 unfused"); }
}
CC
cat >"$tmp/tu_old.cc" <<'CC'
#include <immintrin.h>
#include "src/cpu_adam/kernel_impl_fused.h"
namespace strata::cpu_adam::internal_fused {
using Arch = xsimd::fma3<xsimd::avx2>;
#include "archio_old.inc"
}
namespace strata::cpu_adam::internal {
KernelTable MakeOld() { return internal_fused::MakeTable<internal_fused::Arch>("avx2 fused"); }
}
CC
flags=(-std=c++20 -O3 -mavx2 -mfma -mf16c -ffp-contract=off -I"$tmp" -I"$ROOT" -I"$ROOT/include")
g++ "${flags[@]}" -c "$tmp/tu_new.cc" -o "$tmp/tu_new.o"
g++ "${flags[@]}" -c "$tmp/tu_old.cc" -o "$tmp/tu_old.o"
g++ "${flags[@]}" "$ROOT/bench/fma_ab.cc" "$tmp/tu_new.o" "$tmp/tu_old.o" -o "$tmp/fma_ab" -lpthread
"$tmp/fma_ab" "$threads"
