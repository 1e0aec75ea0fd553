#!/usr/bin/env bash
# scripts/gpu_check.sh --frontend on a machine whose Python cannot build the
# package, on the host device (--host):
#   1. with a package built elsewhere for that Python's minor version and
#      carried (scripts/pack_python.sh's layout, STRATA_GPU_PYDEPS), the
#      frontend's checks run with it, and a note says so;
#   2. without one, the failure is reported (exit 1, naming the build log and
#      the package list) and the device time left runs the report instead.
# The interpreter is Debian's behind a stand-in that refuses what CMake asks
# it (sysconfig, pybind11), so that the build fails while the tests can run.
#   gpu_check_fallback.sh BUILD_DIR PYTHON
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:?usage: gpu_check_fallback.sh BUILD_DIR PYTHON}"
PY="${2:?usage: gpu_check_fallback.sh BUILD_DIR PYTHON}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/python3" <<EOF2
#!/bin/sh
# Debian's Python, except for what a build asks of it.
case "\$*" in
  *sysconfig*|*pybind11*) echo "stand-in: no headers for builds" >&2; exit 1 ;;
esac
exec "$PY" "\$@"
EOF2
chmod +x "$tmp/python3"
ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
fail() { echo "gpu_check_fallback: $*"; cat "$tmp/log"; exit 1; }
check() {  # check OUT_DIR: gpu_check.sh --host --frontend with the stand-in; sets rc
  OUT="$1" PYTHON="$tmp/python3" STRATA_GPU_PYDEPS="$tmp/pydeps" STRATA_GPU_CHECK_BUDGET=300 \
    STRATA_GPU_CHECK_NVME="$tmp/nvme" \
    bash "$ROOT/scripts/gpu_check.sh" --host --frontend "$BUILD" > "$tmp/log" 2>&1
  rc=$?
}

# 1. A carried package for this minor version.
PYTHON="$PY" "$ROOT/scripts/build_python.sh" "$BUILD" "$tmp/pydeps/strata-$ver" >/dev/null ||
  { echo "gpu_check_fallback: could not build the carried package"; exit 1; }
check "$tmp/out1"
[ "$rc" = 0 ] || fail "with a carried package: exit $rc, not 0"
grep -q "using the carried package $tmp/pydeps/strata-$ver/python" "$tmp/log" ||
  fail "the carried package was not used"
grep -q "note: the package was not built here" "$tmp/log" || fail "no note that it was carried"
[ -s "$tmp/out1/frontend/build_python.log" ] || fail "no build log"
grep -q "pytest" "$tmp/log" || fail "the frontend's tests did not run"

# 2. None carried.
rm -rf "$tmp/pydeps"
check "$tmp/out2"
[ "$rc" = 1 ] || fail "without a carried package: exit $rc, not 1"
grep -q "FAIL: scripts/build_python.sh ($tmp/out2/frontend/build_python.log" "$tmp/log" ||
  fail "no failure line naming the build log"
grep -q "no package for Python $ver carried" "$tmp/log" || fail "the failure does not say none was carried"
grep -q "^python $ver" "$tmp/out2/frontend/python_packages.txt" || fail "no package list"
[ -f "$tmp/out2/report/report.json" ] || fail "the report did not run after the failed build"
grep -q "== gpu_check: pytest" "$tmp/log" && fail "pytest ran without a package"
echo "gpu_check_fallback: a carried package runs the frontend; without one the failure is named and the report runs"
