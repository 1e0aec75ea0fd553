# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: the one clang build
# both use, so that the libraries are compiled once under AddressSanitizer +
# UBSan (STRATA_SANITIZE=ON) and serve the sanitized test suites and the
# libFuzzer targets alike. -O1 -g: ASan's usual level, and about a third
# less compile time than -O2 (the optimizer kernels keep their own -O3).
#
# Environment: STRATA_ASAN_BUILD_DIR (build-asan), STRATA_ASAN_CC (clang),
#              STRATA_ASAN_CXX (clang++).
ASAN_BUILD_DIR="${STRATA_ASAN_BUILD_DIR:-$ROOT/build-asan}"
ASAN_CC="${STRATA_ASAN_CC:-clang}"
ASAN_CXX="${STRATA_ASAN_CXX:-clang++}"

# asan_have_compiler: true when the compilers are installed.
asan_have_compiler() {
  command -v "$ASAN_CXX" >/dev/null 2>&1 && command -v "$ASAN_CC" >/dev/null 2>&1
}

# asan_configure WHO: configures $ASAN_BUILD_DIR (a no-op when it is
# configured already with the same arguments); WHO prefixes the message
# that names the log when it fails.
asan_configure() {
  mkdir -p "$ASAN_BUILD_DIR"
  if ! cmake -S "$ROOT" -B "$ASAN_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
       -DCMAKE_C_COMPILER="$ASAN_CC" -DCMAKE_CXX_COMPILER="$ASAN_CXX" \
       "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" \
       "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" \
       -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF \
       >"$ASAN_BUILD_DIR/configure.log" 2>&1; then
    echo "$1: FAILED to configure the ASan + UBSan build with $ASAN_CXX (see $ASAN_BUILD_DIR/configure.log)"
    return 1
  fi
}
