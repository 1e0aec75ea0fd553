#!/usr/bin/env bash
# Fuzzes the config parser, the command line and the checkpoint manifest
# reader: builds tests/config/config_fuzz, tests/apps/cli_fuzz and
# tests/scheduler/manifest_fuzz (libFuzzer with ASan and UBSan) with clang in
# its own build directory and runs them for ${1:-60} seconds together (half
# for the config parser, seeded with configs/*.json and
# tests/config/data/*.json; a quarter each for the command line, seeded with
# tests/apps/cli_fuzz_seeds, and for manifests, seeded with
# tests/scheduler/manifest_fuzz_seeds: manifests `strata train` wrote).
# Fails (exit 1) if a fuzzer finds a crash, a leak, a timeout, memory over
# 2 GiB or a broken invariant; the input is kept under $BUILD_DIR/fuzz-artifacts.
# Skips (exit 0, saying why) when clang or its fuzzer runtime is missing.
#
# Environment: those of scripts/asan_build.sh, STRATA_JOBS (nproc).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_TO_RUN="${1:-60}"
CLI_SECONDS=$((SECONDS_TO_RUN / 4 > 0 ? SECONDS_TO_RUN / 4 : 1))
MANIFEST_SECONDS=$CLI_SECONDS
CONFIG_SECONDS=$((SECONDS_TO_RUN - 2 * CLI_SECONDS > 0 ? SECONDS_TO_RUN - 2 * CLI_SECONDS : 1))
JOBS="${STRATA_JOBS:-$(nproc)}"
# shellcheck source=scripts/asan_build.sh
. "$ROOT/scripts/asan_build.sh"
BUILD_DIR="$ASAN_BUILD_DIR"

if ! asan_have_compiler; then
  echo "fuzz: SKIPPED: $ASAN_CXX not found (Debian: apt-get install clang libclang-rt-14-dev)"
  exit 0
fi
asan_configure fuzz || exit 1
if ! grep -q '^STRATA_HAVE_LIBFUZZER:INTERNAL=1' "$BUILD_DIR/CMakeCache.txt"; then
  echo "fuzz: SKIPPED: $ASAN_CXX cannot link -fsanitize=fuzzer (Debian: apt-get install libclang-rt-14-dev)"
  exit 0
fi
cmake --build "$BUILD_DIR" --target config_fuzz cli_fuzz manifest_fuzz -j "$JOBS"

CORPUS="$(mktemp -d)"
trap 'rm -rf "$CORPUS"' EXIT
ARTIFACTS="$BUILD_DIR/fuzz-artifacts"
mkdir -p "$ARTIFACTS"
# run_fuzzer WHAT SECONDS BINARY MAX_LEN DICT LOG SEED_DIR...: one fuzzer for
# SECONDS; new inputs go to a scratch corpus of its own (the first
# directory), the seeds are read only. Exits the script on a finding.
run_fuzzer() {
  local what="$1" seconds="$2" binary="$3" max_len="$4" dict="$5" log="$6"
  shift 6
  local corpus="$CORPUS/$(basename "$binary")"
  mkdir -p "$corpus"
  echo "== $what fuzz: ${seconds} s"
  if "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
       -print_final_stats=1 -dict="$dict" -artifact_prefix="$ARTIFACTS/" \
       "$corpus" "$@" 2>"$log"; then
    grep -E '^#[0-9]+[[:space:]]+DONE|^stat::' "$log" || true
    echo "$what fuzz: ok"
  else
    tail -n 60 "$log"
    echo "$what fuzz: FAILED (input kept in $ARTIFACTS; full log $log)"
    exit 1
  fi
}

run_fuzzer config "$CONFIG_SECONDS" "$BUILD_DIR/tests/config/config_fuzz" 8192 \
  "$ROOT/tests/config/config_fuzz.dict" "$BUILD_DIR/fuzz.log" "$ROOT/configs" "$ROOT/tests/config/data"
run_fuzzer command-line "$CLI_SECONDS" "$BUILD_DIR/tests/apps/cli_fuzz" 1024 \
  "$ROOT/tests/apps/cli_fuzz.dict" "$BUILD_DIR/cli_fuzz.log" "$ROOT/tests/apps/cli_fuzz_seeds"
run_fuzzer "checkpoint manifest" "$MANIFEST_SECONDS" "$BUILD_DIR/tests/scheduler/manifest_fuzz" \
  65536 "$ROOT/tests/scheduler/manifest_fuzz.dict" "$BUILD_DIR/manifest_fuzz.log" \
  "$ROOT/tests/scheduler/manifest_fuzz_seeds"
