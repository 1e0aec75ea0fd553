#!/usr/bin/env bash
# Compiles the scheduler's sources with Clang's thread-safety analysis as
# errors (-Werror=thread-safety): every GUARDED_BY field read or written
# without its mutex, and every REQUIRES/EXCLUDES contract broken, fails.
# Syntax-only, with the include paths of the CMake build (compile_commands.json).
#   scripts/check_thread_safety.sh [build-dir]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-${STRATA_BUILD_DIR:-$ROOT/build}}"
CLANG="${CLANGXX:-$(command -v clang++ || command -v clang++-14 || true)}"
if [ -z "$CLANG" ]; then
  echo "thread-safety check: clang++ not found (Debian package clang); skipped"
  exit 0
fi
python3 - "$BUILD_DIR/compile_commands.json" "$ROOT" "$CLANG" <<'PY'
import json, shlex, subprocess, sys
db, root, clang = sys.argv[1], sys.argv[2], sys.argv[3]
failed = 0
files = 0
for e in json.load(open(db)):
    f = e["file"]
    if not f.startswith(root + "/src/scheduler/") or not f.endswith(".cc"):
        continue
    args = shlex.split(e["command"])[1:]
    keep = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-c"):
            skip = a != "-c"
            continue
        if a == f or a.startswith("-fdiagnostics-color"):
            continue
        keep.append(a)
    cmd = [clang, *keep, "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
           "-Wno-unknown-warning-option", "-Wno-ignored-optimization-argument", f]
    files += 1
    r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
    if r.returncode != 0:
        failed += 1
        sys.stderr.write(r.stderr)
print(f"thread-safety check: {files} scheduler sources, {failed} failed")
sys.exit(1 if failed or files == 0 else 0)
PY
