#!/usr/bin/env bash
# README's two commands on another Debian release, in a tree of Debian's own
# packages made with mmdebstrap (or debootstrap), so that a change that
# breaks the newer stack (GCC 14, xsimd 13, Python 3.13, torch 2.6) shows
# before it lands.
#
#   scripts/check_platform.sh [--ci] [--tree-only] [trixie]
#
# The tree is cached in ${STRATA_PLATFORM_CACHE:-/var/cache/strata/platform}/<release>
# and made again when it is missing or its package list changed (a stamp
# file holds the list). The checkout (tracked files and untracked ones git
# does not ignore) is copied to /work/strata inside it and run there, in a
# mount namespace of its own (proc, sys and dev mounted for the run, gone
# with it), as root. Its build trees (/work/strata/build, and build-ci for
# --ci) are kept between runs, so a rerun rebuilds what changed.
#
#   (default)    scripts/run.sh, then scripts/test.sh, then `pip install ./python`
#                in a fresh venv with the library built by pip, inside the tree
#   --ci         what .ci/run needs, in less time: the build with warnings as
#                errors (scripts/setup.sh --tests; at -O1, without the
#                benchmarks, of the test programs only those it runs, the
#                other tests' sources compiled with -fsyntax-only by
#                scripts/check_syntax.sh), the demo trained
#                (configs/demo.json), the cpu_adam suites and the PyTorch
#                frontend's pytest suite (CTest -L python)
#   --tree-only  make (or check) the tree and stop
#
# Each stage prints a line when it starts and its elapsed time when it ends,
# as scripts/test.sh does. Needs root (mounts, chroot) and Debian's package
# archive (only when the tree is made).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=full
RELEASE=trixie
for arg in "$@"; do
  case "$arg" in
    --ci) MODE=ci ;;
    --tree-only) MODE=tree ;;
    trixie) RELEASE="$arg" ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "usage: scripts/check_platform.sh [--ci] [--tree-only] [trixie] (unknown: $arg)" >&2
      exit 2
      ;;
  esac
done
if [ "$(id -u)" -ne 0 ]; then
  echo "check_platform: needs root (mmdebstrap, mounts, chroot)" >&2
  exit 1
fi

STAGE_PREFIX="[$RELEASE] "
# shellcheck source=scripts/stage.sh
. "$ROOT/scripts/stage.sh"

# What README's commands need there: scripts/setup.sh's packages with
# --tests, so that it finds nothing missing and the run needs no network.
# (Debian 13's clang is 19, and its fuzzer runtime libclang-rt-19-dev.)
PACKAGES=(build-essential cmake ninja-build pkg-config git ca-certificates
  liburing-dev libtbb-dev libxsimd-dev libhwloc-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
  libfmt-dev libspdlog-dev libopenblas-dev fio gnuplot-nox
  python3-dev pybind11-dev libdlpack-dev libgloo-dev
  python3-torch python3-pytest python3-venv python3-pip python3-setuptools
  clang libclang-rt-19-dev chromium procps)
CACHE="${STRATA_PLATFORM_CACHE:-/var/cache/strata/platform}"
TREE="$CACHE/$RELEASE"
STAMP="$TREE/.strata-platform-stamp"
WANT_STAMP="$RELEASE ${PACKAGES[*]}"

stage "the $RELEASE tree ($TREE)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_STAMP" ]; then
  echo "check_platform: $TREE is up to date (made $(date -r "$STAMP" '+%F %T'))"
else
  echo "check_platform: making $TREE from Debian's $RELEASE packages (several minutes)"
  rm -rf "$TREE.new"
  mkdir -p "$CACHE"
  include=$(IFS=,; echo "${PACKAGES[*]}")
  if command -v mmdebstrap >/dev/null; then
    mmdebstrap --variant=apt --include="$include" "$RELEASE" "$TREE.new" \
      "deb http://deb.debian.org/debian $RELEASE main"
  elif command -v debootstrap >/dev/null; then
    debootstrap --variant=minbase --include="$include" "$RELEASE" "$TREE.new" \
      http://deb.debian.org/debian
  else
    echo "check_platform: neither mmdebstrap nor debootstrap is installed (apt-get install mmdebstrap)" >&2
    exit 1
  fi
  echo "$WANT_STAMP" >"$TREE.new/.strata-platform-stamp"
  rm -rf "$TREE"
  mv "$TREE.new" "$TREE"
fi
if [ "$MODE" = tree ]; then
  stage ""
  exit 0
fi

stage "copy the checkout into $TREE/work/strata"
WORK="$TREE/work/strata"
# Everything but the build tree goes; files keep their times, so a rerun on
# the same checkout rebuilds only what changed.
mkdir -p "$WORK"
find "$WORK" -mindepth 1 -maxdepth 1 ! -name 'build*' -exec rm -rf {} +
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
  xargs -0 -r tar --no-recursion -cf - --ignore-failed-read) | tar -xf - -C "$WORK"
cp -L /etc/resolv.conf "$TREE/etc/resolv.conf" 2>/dev/null || true

# Runs "$1" under bash in the tree, in /work/strata, with proc, sys and dev
# mounted in a private mount namespace (unmounted when it ends).
in_tree() {
  unshare --mount --propagation private /bin/bash -c '
    set -e
    T="$1"; shift
    mount -t proc proc "$T/proc"
    mount -t sysfs sys "$T/sys"
    mount --rbind /dev "$T/dev"
    mount -t tmpfs -o size=4g tmpfs "$T/dev/shm"
    mount -t tmpfs tmpfs "$T/tmp"
    exec chroot "$T" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root LANG=C.UTF-8 CI="${CI:-}" STRATA_JOBS="${STRATA_JOBS:-}" STRATA_PLATFORM_CHECK=0 \
      STRATA_FUZZ_SECONDS="${STRATA_FUZZ_SECONDS:-}" /bin/bash -c "cd /work/strata && $*"
  ' in_tree "$TREE" "$1"
}

in_tree '. /etc/os-release; echo "$PRETTY_NAME"; gcc --version | head -n 1; cmake --version | head -n 1
  python3 --version; python3 -c "import torch; print(\"torch\", torch.__version__)"
  dpkg-query -W -f="\${Package} \${Version}\n" libxsimd-dev libtbb-dev liburing-dev pybind11-dev libgloo-dev'

status=0
if [ "$MODE" = ci ]; then
  # -O1 instead of -O3, no benchmarks, and only the test programs the stage
  # runs (labels cpu_adam and python): every library and command built with
  # warnings as errors, and every other test's sources compiled with
  # -fsyntax-only (scripts/check_syntax.sh), so GCC 14's front-end warnings
  # cover them, in well under half the time of building them (the
  # optimizer kernels keep their own -O3).
  stage "build with warnings as errors, -O1, no benchmarks, the tests it runs (scripts/setup.sh --tests)"
  # (Its own build tree, build-ci, so that the full check keeps -O3.)
  in_tree "STRATA_BUILD_DIR=build-ci STRATA_CMAKE_ARGS='-DCMAKE_CXX_FLAGS=-DNDEBUG -DCMAKE_CXX_FLAGS_RELEASE=-O1 -DSTRATA_BUILD_BENCH=OFF -DSTRATA_TEST_LABELS_BUILT=cpu_adam;python' scripts/setup.sh --tests" ||
    status=1
  if [ "$status" = 0 ]; then
    stage "every other test's sources, -fsyntax-only with warnings as errors (scripts/check_syntax.sh)"
    in_tree "scripts/check_syntax.sh build-ci" || status=1
  fi
  if [ "$status" = 0 ]; then
    stage "the demo (strata train --config configs/demo.json)"
    in_tree "build-ci/apps/strata/strata train --config configs/demo.json --nvme-path build-ci/run/nvme" ||
      status=1
    stage "CTest: the cpu_adam suites and the PyTorch frontend (-L python)"
    in_tree "ctest --test-dir build-ci -j \$(nproc) --output-on-failure --timeout 900 -L 'cpu_adam|python'" ||
      status=1
  fi
else
  stage "scripts/run.sh"
  in_tree "scripts/run.sh" || status=1
  stage "scripts/test.sh"
  in_tree "scripts/test.sh" || status=1
  stage "pip install ./python as a first install does (the library built by pip)"
  in_tree "tests/python/pip_install_test.sh build /usr/bin/python3 --full" || status=1
fi
stage ""
[ "$status" = 0 ] && echo "check_platform: $RELEASE passed" || echo "check_platform: $RELEASE FAILED"
exit "$status"
