#!/usr/bin/env bash
# Compiles with -fsyntax-only, with the build's own compiler and flags
# (compile_commands.json), the sources of the test programs a build
# configured with STRATA_TEST_LABELS_BUILT leaves out (tests_left_out.txt in
# the build tree). The compiler's front-end warnings (as errors, where the
# build has -Werror) then cover every test in less than half the time of
# building them. scripts/check_platform.sh --ci runs it after the build.
# Fails when a source fails, or when a listed source has no compile command.
#   scripts/check_syntax.sh [build-dir]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-${STRATA_BUILD_DIR:-$ROOT/build}}"
JOBS="${STRATA_JOBS:-$(nproc)}"
python3 - "$BUILD_DIR" "$ROOT" "$JOBS" <<'PY'
import json, os, shlex, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
build, root, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
listed = [l for l in open(os.path.join(build, "tests_left_out.txt")).read().splitlines() if l]
wanted = {os.path.realpath(f) for f in listed if f.endswith((".cc", ".cpp", ".cxx"))}
todo, found = [], set()
for e in json.load(open(os.path.join(build, "compile_commands.json"))):
    f = os.path.realpath(os.path.join(e["directory"], e["file"]))
    if f not in wanted or f in found:
        continue
    found.add(f)
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif a not in ("-c", "-MD", "-MMD"):
            keep.append(a)
    todo.append((f, keep + ["-fsyntax-only"], e["directory"]))

def run(job):
    f, cmd, cwd = job
    return f, subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)

failed = []
with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
    for f, r in pool.map(run, todo):
        if r.returncode != 0:
            failed.append(os.path.relpath(f, root))
            sys.stderr.write(r.stderr)
missing = sorted(os.path.relpath(f, root) for f in wanted - found)
print(f"syntax check: {len(todo)} sources of the test programs the build left out, "
      f"{len(failed)} failed" + (": " + ", ".join(failed) if failed else ""))
if missing:
    print("syntax check: FAILED: no compile command for " + ", ".join(missing))
sys.exit(1 if failed or missing else 0)
PY
