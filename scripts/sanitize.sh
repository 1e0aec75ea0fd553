#!/usr/bin/env bash
# Runs a bounded subset of the test suites under AddressSanitizer and UBSan
# (STRATA_SANITIZE=ON) in its own build directory: the config loader and the
# NVMe tier, the code that parses untrusted input and does raw I/O into
# caller buffers. (The whole suite under ASan takes ~25 minutes to build on 2
# cores; the scheduler's concurrency is checked by the thread-safety analysis,
# and the config parser is also fuzzed under ASan/UBSan by scripts/fuzz.sh.)
# Any sanitizer report fails the run (UBSan halts on the first error).
#
# Environment: STRATA_SANITIZE_BUILD_DIR (build-asan), STRATA_JOBS (nproc).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_SANITIZE_BUILD_DIR:-$ROOT/build-asan}"
JOBS="${STRATA_JOBS:-$(nproc)}"
TESTS=(config_test nvme_test)
mkdir -p "$BUILD_DIR"
if ! cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF \
     >"$BUILD_DIR/configure.log" 2>&1; then
  echo "sanitizers: FAILED to configure (see $BUILD_DIR/configure.log)"
  exit 1
fi
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
