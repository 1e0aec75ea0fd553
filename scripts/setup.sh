#!/usr/bin/env bash
# Installs what Strata needs from Debian's packages (only what is missing),
# then configures and builds into ${STRATA_BUILD_DIR:-build}. Run by run.sh
# (the build's packages) and test.sh (with --tests: also the tools the tests
# use); can be run on its own. Needs root for apt-get.
#   scripts/setup.sh [--tests]
#
# Environment: STRATA_BUILD_DIR (build), STRATA_BUILD_TYPE (Release),
#              STRATA_CMAKE_ARGS (extra cmake arguments, e.g. -DSTRATA_CUDA=OFF),
#              STRATA_JOBS (nproc), STRATA_SETUP_TESTS=1 (as --tests).
set -euo pipefail
WITH_TESTS="${STRATA_SETUP_TESTS:-0}"
for arg in "$@"; do
  case "$arg" in
    --tests) WITH_TESTS=1 ;;
    *) echo "usage: scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
BUILD_TYPE="${STRATA_BUILD_TYPE:-Release}"
JOBS="${STRATA_JOBS:-$(nproc)}"

# The build (every target, the test binaries included) and the main job.
PACKAGES=(build-essential cmake ninja-build pkg-config git
  liburing-dev libtbb-dev libxsimd-dev xtl-dev libhwloc-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
  libfmt-dev libspdlog-dev libopenblas-dev fio gnuplot-nox
  python3-dev pybind11-dev libdlpack-dev   # the Python package (python/)
  libgloo-dev)  # the host device's collectives (several ranks without a GPU)
# What only the tests use. Without them the build still configures: the
# pytest case reports "Not Run" with the reason, the browser test skips, and the thread-safety check
# and the fuzzer say they are skipped.
# clang's fuzzer runtime is versioned: Debian 12's clang is 14, Debian 13's 19.
CLANG_RT=libclang-rt-14-dev
if [ -r /etc/os-release ]; then
  case "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" in
    trixie) CLANG_RT=libclang-rt-19-dev ;;
  esac
fi
TEST_PACKAGES=(
  clang "$CLANG_RT"               # clang: thread-safety analysis (check_thread_safety.sh); its
                                  # libFuzzer runtime: scripts/fuzz.sh (config parser)
  python3-torch python3-pytest    # the Python package's tests (tests/python): torch 1.13 on
                                  # Debian 12, 2.6 on Debian 13
  python3-venv python3-pip python3-setuptools python3-wheel  # pip install ./python (CTest)
  chromium)                       # headless: renders `strata report`'s page (report_browser_test)
if [ "$WITH_TESTS" = 1 ]; then PACKAGES+=("${TEST_PACKAGES[@]}"); fi
# The Debian 13 tree of scripts/check_platform.sh (not needed inside that
# tree, where STRATA_PLATFORM_CHECK=0).
if [ "$WITH_TESTS" = 1 ] && [ "${STRATA_PLATFORM_CHECK:-1}" != 0 ]; then PACKAGES+=(mmdebstrap); fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "strata setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "strata setup: these Debian packages are missing and installing them needs root: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# CUDA and NCCL come from the CUDA installation when there is one (CUDA_HOME or
# /usr/local/cuda); without nvcc every CPU path still builds and runs.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

# The Python package is built for Debian's interpreter, the one python3-torch
# is installed for (another python3 may come first on PATH).
PYTHON_ARGS=()
if [ -x /usr/bin/python3 ]; then PYTHON_ARGS=(-DPython_EXECUTABLE=/usr/bin/python3); fi

# The tests' build fails on any compiler warning, so that warnings stay gone.
WERROR_ARGS=()
if [ "$WITH_TESTS" = 1 ]; then WERROR_ARGS=(-DSTRATA_WERROR=ON); fi

cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" "${PYTHON_ARGS[@]}" \
  "${WERROR_ARGS[@]}" ${STRATA_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
