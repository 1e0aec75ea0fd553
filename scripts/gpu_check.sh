#!/usr/bin/env bash
# The one command for a lent GPU: builds nothing. Runs the CUDA tests
# (`ctest -L gpu`, each with a timeout; a test that times out is reported as a
# HANG by name), then `strata report --device cuda` with the time that is
# left, all within ${STRATA_GPU_CHECK_BUDGET:-560} s (a 10-minute device call
# less remote.sh's unpacking). Exits non-zero on any failure, hang or failed
# check. Works from a packed build through
# ../shared/gpu/remote.sh, which sets $BUILD and $STRATA:
#   bash .gpu/pack/remote.sh 'scripts/gpu_check.sh'
# Writes the report into $OUT/report when OUT is set, else BUILD/report; the
# NVMe measurements and swap files go to STRATA_GPU_CHECK_NVME (BUILD/report-nvme),
# never into $OUT.
#
#   scripts/gpu_check.sh [--host] [--quick] [BUILD_DIR]
# --host: no GPU needed; what CI runs (scripts/test.sh) so this script cannot
#   rot: a few of the gpu-labelled tests, then `strata report --tiny --device
#   host`, and checks the page (report.json parses, its sections ran, and
#   index.html holds one <svg> per chart).
# --quick: `strata report --quick` (3 minutes) instead of the full report.
# --frontend: the PyTorch frontend instead of the tests and the report:
#   builds the Python package for this machine's python3 against BUILD
#   (scripts/build_python.sh), runs the pytest suite with it (the CUDA cases
#   of tests/python/test_cuda_frontend.py on the GPU; every skip with its
#   reason), then bench/frontend_vs_torch.py (0.9B Llama, sequence 2048:
#   torch in HBM against Strata none/none, cpu/none, cpu/cpu), its JSON and
#   the step timelines into OUT/frontend (BUILD/frontend without OUT). With
#   --host: the bench at its tiny size on the host device and the CUDA
#   cases' skips, so that this path cannot rot. When the package cannot be
#   built there (no Python headers, no pybind11: OUT/frontend/build_python.log
#   and python_packages.txt say which), the one scripts/pack_python.sh built
#   for that minor version and carried in .gpu/pydeps runs instead (a note
#   says so); without one, the time left runs the quick report, and the exit
#   status says the frontend failed.
# --frontend needs pytest: without one on that Python it takes Debian's,
#   packed here by scripts/pack_pytest.sh into .gpu/pydeps and carried beside
#   the pack (carry [".gpu/pack", ".gpu/pydeps"]; STRATA_GPU_PYDEPS names
#   another folder). scripts/pack_python.sh puts the package built here for
#   each Python >= 3.12 there too, for a machine that cannot build it.
# Environment: BUILD (build tree; default build/), STRATA (the CLI; default
#   BUILD/apps/strata/strata), OUT, STRATA_GPU_CHECK_BUDGET (560 s),
#   STRATA_GPU_CHECK_TEST_TIMEOUT (per test, 90 s), STRATA_GPU_CHECK_JOBS (8),
#   STRATA_GPU_CHECK_NVME.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOST=0
QUICK=0
FRONTEND=0
BUILD_ARG=""
for arg in "$@"; do
  case "$arg" in
    --host) HOST=1 ;;
    --quick) QUICK=1 ;;
    --frontend) FRONTEND=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (--host, --quick, --frontend, BUILD_DIR)" >&2; exit 2 ;;
    *) BUILD_ARG="$arg" ;;
  esac
done
BUILD="${BUILD_ARG:-${BUILD:-$ROOT/build}}"
STRATA="${STRATA:-$BUILD/apps/strata/strata}"
BUDGET="${STRATA_GPU_CHECK_BUDGET:-560}"
TEST_TIMEOUT="${STRATA_GPU_CHECK_TEST_TIMEOUT:-90}"
JOBS="${STRATA_GPU_CHECK_JOBS:-8}"
REPORT_DIR="${OUT:+$OUT/report}"
REPORT_DIR="${REPORT_DIR:-$BUILD/report}"
NVME_DIR="${STRATA_GPU_CHECK_NVME:-$BUILD/report-nvme}"
if [ ! -x "$STRATA" ]; then
  echo "gpu_check.sh: $STRATA is not an executable: build first (or pass the build tree)" >&2
  exit 2
fi
if [ ! -f "$BUILD/CTestTestfile.cmake" ]; then
  echo "gpu_check.sh: $BUILD has no CTestTestfile.cmake: not a build tree with tests" >&2
  exit 2
fi
status=0
problems=()
notes=()
RUN_TESTS=1

# The PyTorch frontend (--frontend): the package for this python3, its tests,
# the timing against torch; then exit.
if [ "$FRONTEND" = 1 ]; then
  PY="${PYTHON:-python3}"
  FDIR="${OUT:+$OUT/frontend}"
  FDIR="${FDIR:-$BUILD/frontend}"
  mkdir -p "$FDIR"
  # What this Python has, for the record (and whether DeepSpeed's ZeRO-Offload
  # could run here as a baseline: it needs these packages, and no network).
  echo "== gpu_check: this Python's packages"
  timeout 60 "$PY" - <<'PY' 2>&1 | tee "$FDIR/python_packages.txt"
import importlib, sys
print("python", sys.version.split()[0])
import os, sysconfig
inc = sysconfig.get_paths()["include"]
print("headers", inc, "Python.h" if os.path.exists(os.path.join(inc, "Python.h")) else "no Python.h")
for name in ("torch", "pybind11", "numpy", "deepspeed", "pydantic", "pydantic_core", "hjson",
             "cpuinfo", "ninja", "psutil", "msgpack", "packaging", "tqdm", "einops"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', 'present')}")
    except Exception as e:
        print(f"{name} missing ({type(e).__name__})")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("torch.cuda:", e)
PY
  echo "== gpu_check: the Python package for $("$PY" --version 2>&1) (scripts/build_python.sh)"
  PYDEPS="${STRATA_GPU_PYDEPS:-$ROOT/.gpu/pydeps}"
  PKG="$BUILD/python-frontend/python"
  if ! PYTHON="$PY" timeout 300 "$ROOT/scripts/build_python.sh" "$BUILD" "$BUILD/python-frontend" \
      2>&1 | tee "$FDIR/build_python.log"; then
    # Built elsewhere for this minor version and carried (scripts/pack_python.sh)?
    ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)
    pre="$PYDEPS/strata-$ver/python"
    if [ -d "$pre/strata" ] && PYTHONPATH="$pre" "$PY" -c 'import strata._strata' \
        >>"$FDIR/build_python.log" 2>&1; then
      PKG="$pre"
      notes+=("note: the package was not built here ($FDIR/build_python.log); the one built for Python $ver by scripts/pack_python.sh and carried in $PYDEPS ran instead")
      echo "== gpu_check: using the carried package $pre (Python $ver)"
    else
      # Without the package the frontend cannot run; the device time left
      # goes to the quick report (the engine's GPU figures) instead of being lost.
      problems+=("FAIL: scripts/build_python.sh ($FDIR/build_python.log; $FDIR/python_packages.txt says what this Python has), and no package for Python $ver carried in $PYDEPS (scripts/pack_python.sh): the frontend did not run, the report instead")
      FRONTEND=0
      RUN_TESTS=0
      QUICK=1
      status=1
    fi
  fi
fi
if [ "$FRONTEND" = 1 ]; then
  export PYTHONPATH="$PKG"
  # No pytest on this Python: Debian's, carried (scripts/pack_pytest.sh).
  if ! "$PY" -c 'import pytest' 2>/dev/null; then
    if [ -d "$PYDEPS" ] && PYTHONPATH="$PYTHONPATH:$PYDEPS" "$PY" -c 'import pytest' 2>/dev/null; then
      export PYTHONPATH="$PYTHONPATH:$PYDEPS"
      echo "== gpu_check: pytest from $PYDEPS (this Python has none)"
    else
      echo "gpu_check: no pytest for $PY and none carried in $PYDEPS (scripts/pack_pytest.sh here, then carry .gpu/pydeps)"
    fi
  fi
  tests=("$ROOT/tests/python")
  [ "$HOST" = 1 ] && tests=("$ROOT/tests/python/test_cuda_frontend.py")
  LEFT=$((BUDGET - SECONDS - 60))
  echo "== gpu_check: pytest ${tests[*]} (${LEFT} s at most)"
  timeout --signal=TERM --kill-after=10 "$LEFT" "$PY" "$ROOT/tests/python/run_pytest.py" -rs \
    "${tests[@]}" 2>&1 | tee "$FDIR/pytest.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then problems+=("HANG: pytest (${LEFT} s)")
  elif [ "$rc" != 0 ]; then problems+=("FAIL: pytest exit $rc ($FDIR/pytest.log)"); fi
  LEFT=$((BUDGET - SECONDS - 10))
  bench=(--size 1b --device cuda --trace-dir "$FDIR/traces")
  [ "$HOST" = 1 ] && bench=(--size tiny --device host --steps 2 --warmup 1 --micro-batch 2 \
    --threads 2 --trace-dir "$FDIR/traces")
  if [ "$LEFT" -lt 30 ]; then
    problems+=("SKIPPED: bench/frontend_vs_torch.py (${LEFT} s left of ${BUDGET} s)")
  else
    echo "== gpu_check: bench/frontend_vs_torch.py ${bench[*]} (${LEFT} s at most)"
    timeout --signal=TERM --kill-after=10 "$LEFT" "$PY" "$ROOT/bench/frontend_vs_torch.py" \
      "${bench[@]}" 2>&1 | tee "$FDIR/bench.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ]; then problems+=("FAIL: bench/frontend_vs_torch.py exit $rc"); fi
    tail -n 1 "$FDIR/bench.log" > "$FDIR/bench.json"
  fi
  echo "== gpu_check: ${SECONDS} s of ${BUDGET} s"
  [ ${#notes[@]} = 0 ] || printf 'gpu_check: %s\n' "${notes[@]}"
  if [ ${#problems[@]} = 0 ]; then
    echo "gpu_check: all passed (frontend: $FDIR)"
    exit 0
  fi
  printf 'gpu_check: %s\n' "${problems[@]}"
  exit 1
fi

# 1. The tests: CUDA ones (and the rest of the gpu label) in GPU mode, a few
#    host ones in --host mode; at most half the budget.
if [ "$RUN_TESTS" = 1 ]; then
TEST_BUDGET=$((BUDGET / 2))
filter=()
if [ "$HOST" = 1 ]; then
  filter=(-R 'ArenaTest\.')
  TEST_BUDGET=$((TEST_BUDGET < 120 ? TEST_BUDGET : 120))
fi
echo "== gpu_check: tests (ctest -L gpu ${filter[*]}, ${TEST_TIMEOUT} s per test, ${TEST_BUDGET} s in all)"
LOG=$(mktemp)
timeout --signal=TERM --kill-after=10 "$TEST_BUDGET" \
  ctest --test-dir "$BUILD" -L gpu "${filter[@]}" --timeout "$TEST_TIMEOUT" -j "$JOBS" \
  --output-on-failure 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
# CTest's result lines: "  3/50 Test  #3: Name ....***Timeout  90.01 sec".
while read -r name; do
  problems+=("HANG: $name (no result within ${TEST_TIMEOUT} s)")
done < <(sed -n 's/.*Test *#[0-9]*: \([^ ]*\) .*\*\*\*Timeout.*/\1/p' "$LOG")
while read -r name; do
  problems+=("FAIL: $name")
done < <(sed -n 's/.*Test *#[0-9]*: \([^ ]*\) .*\*\*\*\(Failed\|Exception\).*/\1/p' "$LOG")
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  problems+=("HANG: the tests as a whole did not finish within ${TEST_BUDGET} s")
elif [ "$rc" != 0 ] && [ ${#problems[@]} = 0 ]; then
  problems+=("FAIL: ctest exit $rc")
fi
if grep -q "No tests were found" "$LOG"; then problems+=("FAIL: no gpu-labelled tests in $BUILD"); fi
# On a GPU a skipped CUDA case usually means the device was not usable: say
# how many (not a failure: a multi-GPU case skips on one GPU).
skipped=$(grep -c '(Skipped)$' "$LOG" || true)
if [ "$HOST" = 0 ] && [ "$skipped" -gt 0 ]; then
  notes+=("note: $skipped gpu-labelled tests skipped, first: $(grep -m1 '(Skipped)$' "$LOG" | sed 's/^[[:space:]]*//')")
fi
rm -f "$LOG"
[ ${#problems[@]} = 0 ] || status=1
fi

# 2. The report, with the time that is left (a margin for writing it).
LEFT=$((BUDGET - SECONDS - 15))
if [ "$HOST" = 1 ]; then
  args=(--tiny --device host)
else
  args=(--device cuda)
  [ "$QUICK" = 1 ] && args+=(--quick)
fi
if [ "$LEFT" -lt 20 ]; then
  problems+=("SKIPPED: strata report (${LEFT} s left of ${BUDGET} s)")
  status=1
else
  rm -f "$REPORT_DIR/report.json" "$REPORT_DIR/index.html"  # never check an older run's page
  echo "== gpu_check: $STRATA report ${args[*]} --out $REPORT_DIR --nvme-path $NVME_DIR --time-limit $LEFT"
  timeout --signal=TERM --kill-after=20 "$((LEFT + 30))" \
    "$STRATA" report "${args[@]}" --out "$REPORT_DIR" --nvme-path "$NVME_DIR" --time-limit "$LEFT"
  rc=$?
  if [ "$rc" != 0 ]; then problems+=("FAIL: strata report exit $rc"); status=1; fi
  # The page: report.json parses, every section that should have run did,
  # and index.html holds one <svg> per chart report.json counts.
  if [ ! -f "$REPORT_DIR/report.json" ]; then
    problems+=("FAIL: strata report wrote no $REPORT_DIR/report.json")
    status=1
  elif ! /usr/bin/env python3 - "$REPORT_DIR" "$HOST" <<'PY'
import json, sys
out, host = sys.argv[1], sys.argv[2] == "1"
j = json.load(open(out + "/report.json"))
html = open(out + "/index.html", encoding="utf-8").read()
charts = sum(s["charts"] for s in j["sections"])
svgs = html.count("<svg")
states = {s["id"]: s["state"] for s in j["sections"]}
bad = []
if svgs != charts or charts == 0:
    bad.append(f"index.html has {svgs} <svg>, report.json counts {charts} charts")
if "</html>" not in html or "<script" in html:
    bad.append("index.html is cut short or has a script")
must = ["machine", "pcie", "cpu_adam", "nvme", "training"] + ([] if host else ["gpu_adam"])
for sid in must:
    if states.get(sid) == "failed":
        bad.append(f"section {sid} failed")
    elif host and states.get(sid) != "ok":
        bad.append(f"section {sid}: {states.get(sid)}")
for s in j["sections"]:
    for f in s["figures"]:
        if not f["unit"] or not f["command"]:
            bad.append(f"figure {f['name']} has no unit or command")
print(f"gpu_check: page {out}/index.html: {svgs} charts; sections " +
      ", ".join(f"{k} {v}" for k, v in states.items()))
for b in bad:
    print("gpu_check: page:", b)
sys.exit(1 if bad else 0)
PY
  then
    problems+=("FAIL: the report's page ($REPORT_DIR)")
    status=1
  fi
fi

echo "== gpu_check: ${SECONDS} s of ${BUDGET} s"
[ ${#notes[@]} = 0 ] || printf 'gpu_check: %s\n' "${notes[@]}"
if [ ${#problems[@]} = 0 ]; then
  echo "gpu_check: all passed (report: $REPORT_DIR/index.html)"
else
  printf 'gpu_check: %s\n' "${problems[@]}"
fi
exit "$status"
