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
# Environment: STRATA_FUZZ_BUILD_DIR (build-fuzz), STRATA_FUZZ_CXX (clang++),
#              STRATA_FUZZ_CC (clang), STRATA_JOBS (nproc).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_TO_RUN="${1:-60}"
CLI_SECONDS=$((SECONDS_TO_RUN / 4 > 0 ? SECONDS_TO_RUN / 4 : 1))
MANIFEST_SECONDS=$CLI_SECONDS
CONFIG_SECONDS=$((SECONDS_TO_RUN - 2 * CLI_SECONDS > 0 ? SECONDS_TO_RUN - 2 * CLI_SECONDS : 1))
BUILD_DIR="${STRATA_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
CC_BIN="${STRATA_FUZZ_CC:-clang}"
CXX_BIN="${STRATA_FUZZ_CXX:-clang++}"
JOBS="${STRATA_JOBS:-$(nproc)}"

if ! command -v "$CXX_BIN" >/dev/null 2>&1 || ! command -v "$CC_BIN" >/dev/null 2>&1; then
  echo "fuzz: SKIPPED: $CXX_BIN not found (Debian: apt-get install clang libclang-rt-14-dev)"
  exit 0
fi
mkdir -p "$BUILD_DIR"
if ! cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" \
     -DSTRATA_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF >"$BUILD_DIR/configure.log" 2>&1; then
  echo "fuzz: FAILED to configure the clang build (see $BUILD_DIR/configure.log)"
  exit 1
fi
if ! grep -q '^STRATA_HAVE_LIBFUZZER:INTERNAL=1' "$BUILD_DIR/CMakeCache.txt"; then
  echo "fuzz: SKIPPED: $CXX_BIN cannot link -fsanitize=fuzzer (Debian: apt-get install libclang-rt-14-dev)"
  exit 0
fi
cmake --build "$BUILD_DIR" --target config_fuzz cli_fuzz manifest_fuzz -j "$JOBS"

CORPUS="$(mktemp -d)"
trap 'rm -rf "$CORPUS"' EXIT
ARTIFACTS="$BUILD_DIR/fuzz-artifacts"
mkdir -p "$ARTIFACTS"
echo "== config fuzz: ${CONFIG_SECONDS} s"
# New inputs go to the scratch corpus (first directory); the seeds are read only.
if "$BUILD_DIR/tests/config/config_fuzz" -max_total_time="$CONFIG_SECONDS" -timeout=10 \
     -rss_limit_mb=2048 -max_len=8192 -print_final_stats=1 \
     -dict="$ROOT/tests/config/config_fuzz.dict" -artifact_prefix="$ARTIFACTS/" \
     "$CORPUS" "$ROOT/configs" "$ROOT/tests/config/data" 2>"$BUILD_DIR/fuzz.log"; then
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::' "$BUILD_DIR/fuzz.log" || true
  echo "config fuzz: ok"
else
  tail -n 60 "$BUILD_DIR/fuzz.log"
  echo "config fuzz: FAILED (input kept in $ARTIFACTS; full log $BUILD_DIR/fuzz.log)"
  exit 1
fi

CLI_CORPUS="$CORPUS/cli"
mkdir -p "$CLI_CORPUS"
echo "== command-line fuzz: ${CLI_SECONDS} s"
if "$BUILD_DIR/tests/apps/cli_fuzz" -max_total_time="$CLI_SECONDS" -timeout=10 \
     -rss_limit_mb=2048 -max_len=1024 -print_final_stats=1 \
     -dict="$ROOT/tests/apps/cli_fuzz.dict" -artifact_prefix="$ARTIFACTS/" \
     "$CLI_CORPUS" "$ROOT/tests/apps/cli_fuzz_seeds" 2>"$BUILD_DIR/cli_fuzz.log"; then
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::' "$BUILD_DIR/cli_fuzz.log" || true
  echo "command-line fuzz: ok"
else
  tail -n 60 "$BUILD_DIR/cli_fuzz.log"
  echo "command-line fuzz: FAILED (input kept in $ARTIFACTS; full log $BUILD_DIR/cli_fuzz.log)"
  exit 1
fi

MANIFEST_CORPUS="$CORPUS/manifest"
mkdir -p "$MANIFEST_CORPUS"
echo "== checkpoint manifest fuzz: ${MANIFEST_SECONDS} s"
if "$BUILD_DIR/tests/scheduler/manifest_fuzz" -max_total_time="$MANIFEST_SECONDS" -timeout=10 \
     -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
     -dict="$ROOT/tests/scheduler/manifest_fuzz.dict" -artifact_prefix="$ARTIFACTS/" \
     "$MANIFEST_CORPUS" "$ROOT/tests/scheduler/manifest_fuzz_seeds" 2>"$BUILD_DIR/manifest_fuzz.log"; then
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::' "$BUILD_DIR/manifest_fuzz.log" || true
  echo "checkpoint manifest fuzz: ok"
else
  tail -n 60 "$BUILD_DIR/manifest_fuzz.log"
  echo "checkpoint manifest fuzz: FAILED (input kept in $ARTIFACTS; full log $BUILD_DIR/manifest_fuzz.log)"
  exit 1
fi
