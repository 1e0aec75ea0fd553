#!/usr/bin/env bash
# Runs a bounded subset of the test suites under AddressSanitizer and UBSan
# (STRATA_SANITIZE=ON): the config loader and the NVMe tier, the code that
# parses untrusted input and does raw I/O into caller buffers. (The
# scheduler's concurrency is checked by the thread-safety analysis, and the
# config parser, the command line and the manifest reader are fuzzed under
# ASan/UBSan by scripts/fuzz.sh.) The build is clang's in build-asan/, shared
# with scripts/fuzz.sh (scripts/asan_build.sh), so its libraries compile once
# for both; without clang, the default compiler builds it in
# build-asan-default/, saying so. Any sanitizer report fails the run (UBSan
# halts on the first error).
#
# Environment: those of scripts/asan_build.sh, STRATA_JOBS (nproc).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="${STRATA_JOBS:-$(nproc)}"
TESTS=(config_test nvme_test)
# shellcheck source=scripts/asan_build.sh
. "$ROOT/scripts/asan_build.sh"
if ! asan_have_compiler; then
  echo "sanitizers: $ASAN_CXX not found; building with the default compiler instead (Debian: apt-get install clang)"
  ASAN_BUILD_DIR="${STRATA_ASAN_BUILD_DIR:-$ROOT/build-asan-default}"
  ASAN_CC=cc ASAN_CXX=c++
fi
asan_configure sanitizers || exit 1
BUILD_DIR="$ASAN_BUILD_DIR"
echo "sanitizers: building ${TESTS[*]} in $BUILD_DIR (log $BUILD_DIR/build.log)"
if ! cmake --build "$BUILD_DIR" --target "${TESTS[@]}" -j "$JOBS" >"$BUILD_DIR/build.log" 2>&1; then
  tail -n 40 "$BUILD_DIR/build.log"
  echo "sanitizers: FAILED to build (see $BUILD_DIR/build.log)"
  exit 1
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
status=0
for t in "${TESTS[@]}"; do
  bin="$(find "$BUILD_DIR/tests" -type f -name "$t" -perm -u+x | head -n 1)"
  if "$bin" --gtest_brief=1 >"$BUILD_DIR/$t.log" 2>&1; then
    echo "sanitizers: $t ok ($(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' "$BUILD_DIR/$t.log" | head -n 1))"
  else
    tail -n 40 "$BUILD_DIR/$t.log"
    echo "sanitizers: $t FAILED (full log $BUILD_DIR/$t.log)"
    status=1
  fi
done
exit "$status"
