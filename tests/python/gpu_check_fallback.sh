#!/usr/bin/env bash
# scripts/gpu_check.sh --frontend on a machine whose Python cannot build the
# package: the failure is reported (exit 1, naming the build log and the
# package list), and the device time left runs the report instead of being
# lost. A stand-in interpreter makes the build fail; --host runs the rest
# on the host device.
#   gpu_check_fallback.sh BUILD_DIR
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:?usage: gpu_check_fallback.sh BUILD_DIR}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/python3" <<'PY'
#!/bin/sh
# Answers --version and the package listing; anything else fails.
case "$1" in
  --version) echo "Python 3.99.0"; exit 0 ;;
  -) cat >/dev/null; echo "python 3.99.0 (a stand-in that builds nothing)"; exit 0 ;;
esac
exit 1
PY
chmod +x "$tmp/python3"
OUT="$tmp/out" PYTHON="$tmp/python3" STRATA_GPU_CHECK_BUDGET=300 \
  STRATA_GPU_CHECK_NVME="$tmp/nvme" \
  bash "$ROOT/scripts/gpu_check.sh" --host --frontend "$BUILD" > "$tmp/log" 2>&1
rc=$?
fail() { echo "gpu_check_fallback: $*"; cat "$tmp/log"; exit 1; }
[ "$rc" = 1 ] || fail "exit $rc, not 1"
grep -q "FAIL: scripts/build_python.sh ($tmp/out/frontend/build_python.log" "$tmp/log" ||
  fail "no failure line naming the build log"
[ -s "$tmp/out/frontend/build_python.log" ] || fail "no build log"
grep -q "3.99.0" "$tmp/out/frontend/python_packages.txt" || fail "no package list"
[ -f "$tmp/out/report/report.json" ] || fail "the report did not run after the failed build"
grep -q "pytest" "$tmp/log" && fail "pytest ran without a package"
echo "gpu_check_fallback: the failed build is reported and the report ran"
