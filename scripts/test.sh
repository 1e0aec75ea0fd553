#!/usr/bin/env bash
# Builds everything and runs every test: the GoogleTest suites through CTest,
# then installs the library into a staging prefix and builds the consumer in
# examples/link against the *installed* package (CMake and pkg-config), then
# fuzzes the config parser, the command line and the checkpoint manifest reader for
# ${STRATA_FUZZ_SECONDS:-60} s (scripts/fuzz.sh;
# skipped, saying why, without clang). Also: Clang's thread-safety analysis
# of every .cc under src/ (scripts/check_thread_safety.sh), the docs check
# (scripts/check_docs.sh) and the config and nvme tests under ASan + UBSan
# (scripts/sanitize.sh; STRATA_SANITIZE_TESTS=0 skips it), and the GPU check
# in host mode (scripts/gpu_check.sh --host, and --host --frontend), and
# the Debian 13 check (scripts/check_platform.sh --ci; STRATA_PLATFORM_CHECK=0
# skips it). Each stage prints a line when it starts and one with its
# elapsed time when it ends.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
JOBS="${STRATA_JOBS:-$(nproc)}"

# shellcheck source=scripts/stage.sh
. "$ROOT/scripts/stage.sh"

stage "setup and build (scripts/setup.sh --tests)"
"$ROOT/scripts/setup.sh" --tests

status=0
stage "CTest"
ctest --test-dir "$BUILD_DIR" -j "$JOBS" --output-on-failure --timeout 900 || status=$?

stage "GPU check in host mode (scripts/gpu_check.sh --host: strata report --tiny, its page checked)"
"$ROOT/scripts/gpu_check.sh" --host "$BUILD_DIR" || status=1

# (Debian's interpreter: the one with torch, as the build's Python package.)
stage "GPU check of the PyTorch frontend in host mode (scripts/gpu_check.sh --host --frontend)"
PYTHON=/usr/bin/python3 "$ROOT/scripts/gpu_check.sh" --host --frontend "$BUILD_DIR" || status=1

stage "thread-safety analysis (clang -Werror=thread-safety over every .cc under src/)"
"$ROOT/scripts/check_thread_safety.sh" "$BUILD_DIR" || status=1

stage "docs check (paths, config keys and strata options named in README.md and docs/*.md; no issue references)"
"$ROOT/scripts/check_docs.sh" || status=1

if [ "${STRATA_SANITIZE_TESTS:-1}" != 0 ]; then
  stage "sanitizers (ASan + UBSan build of the config and nvme tests, then run)"
  "$ROOT/scripts/sanitize.sh" || status=1
fi

stage "install + link check (examples/link)"
STAGE="$BUILD_DIR/stage"
rm -rf "$STAGE" "$BUILD_DIR/link-cmake"
cmake --install "$BUILD_DIR" --prefix "$STAGE" >/dev/null
link_ok=1
if cmake -S "$ROOT/examples/link" -B "$BUILD_DIR/link-cmake" -G Ninja \
     -DCMAKE_PREFIX_PATH="$STAGE" >/dev/null &&
   cmake --build "$BUILD_DIR/link-cmake" >/dev/null &&
   "$BUILD_DIR/link-cmake/strata_link_example" "$ROOT/configs/zero2_cpu_offload.json"; then
  echo "examples/link (find_package): ok"
else
  echo "examples/link (find_package): FAILED"; link_ok=0
fi
if PKG_CONFIG_PATH="$STAGE/lib/pkgconfig" \
   c++ -o "$BUILD_DIR/strata_link_pc" "$ROOT/examples/link/main.cc" \
       $(PKG_CONFIG_PATH="$STAGE/lib/pkgconfig" pkg-config --cflags --libs strata) &&
   "$BUILD_DIR/strata_link_pc" "$ROOT/configs/zero2_cpu_offload.json" >/dev/null; then
  echo "examples/link (pkg-config): ok"
else
  echo "examples/link (pkg-config): FAILED"; link_ok=0
fi
PYDIR=$(find "$STAGE" -type d -path '*-packages/strata' 2>/dev/null | head -n 1)
if [ -n "$PYDIR" ]; then
  # The installed package imports and runs from the staging prefix alone.
  if PYTHONPATH="$(dirname "$PYDIR")" /usr/bin/python3 -c \
       "import strata, sys; assert strata.__file__.startswith('$STAGE'); \
        print('installed python package:', strata.parse_config({})['strata']['device'] != '')"; then
    echo "python package (installed): ok"
  else
    echo "python package (installed): FAILED"; link_ok=0
  fi
fi
[ "$link_ok" = 1 ] || status=1

stage "config, command-line and checkpoint manifest fuzz (${STRATA_FUZZ_SECONDS:-60} s)"
"$ROOT/scripts/fuzz.sh" "${STRATA_FUZZ_SECONDS:-60}" || status=1

# The newer stack users run (Debian 13: GCC 14, xsimd 13, Python 3.13,
# torch 2.6), in a tree of Debian's packages: the build with warnings as
# errors, the demo, the cpu_adam suites and the PyTorch frontend's suite.
# STRATA_PLATFORM_CHECK=0 skips it (the platform check itself sets it for
# the test.sh it runs inside the tree).
if [ "${STRATA_PLATFORM_CHECK:-1}" != 0 ]; then
  stage "Debian 13 (scripts/check_platform.sh --ci trixie)"
  "$ROOT/scripts/check_platform.sh" --ci trixie || status=1
fi
stage ""
exit "$status"
