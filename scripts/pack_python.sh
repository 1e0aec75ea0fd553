#!/usr/bin/env bash
# Builds the Python package `strata` (the _strata extension and the PyTorch
# frontend) for every Python 3.12 or later this machine has, against a build
# tree, into OUT/strata-<X.Y>/python, and checks each one with
# tests/python/binding_check.py (the engine's calls without torch).
#
#   scripts/pack_python.sh [BUILD_DIR] [OUT_DIR]
#     BUILD_DIR  default .gpu/build (the sm_90 build ../shared/gpu/pack.sh packs)
#     OUT_DIR    default .gpu/pydeps (carried beside the pack, with pytest)
#   STRATA_OTHER_PYTHONS  the interpreters (space-separated paths); default:
#     python3.12 ... python3.14 on PATH and pyenv's versions, the newest
#     patch release of each minor version.
#
# Carried to a GPU machine, it is what `scripts/gpu_check.sh --frontend` uses
# when that machine cannot build the package for its own Python (no Python
# headers, no pybind11): an extension built for 3.12 loads in any 3.12.x, and
# its libstrata.so is the pack's build tree, whose path remote.sh maps.
# Exits 77 when there is no such Python here.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$ROOT/.gpu/build}
out=${2:-$ROOT/.gpu/pydeps}
[ -e "$build/libstrata.so" ] || { echo "pack_python.sh: no libstrata.so in $build" >&2; exit 2; }
candidates=()
if [ -n "${STRATA_OTHER_PYTHONS:-}" ]; then
  read -r -a candidates <<< "$STRATA_OTHER_PYTHONS"
else
  for v in 3.12 3.13 3.14; do
    p=$(command -v "python$v" 2>/dev/null) && candidates+=("$p")
  done
  for d in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9].* 2>/dev/null | sort -V); do
    [ -x "$d/bin/python3" ] && candidates+=("$d/bin/python3")
  done
fi
# One interpreter per minor version (the last found), each one that runs.
declare -A pick
for p in "${candidates[@]}"; do
  ver=$("$p" -c 'import sys; assert sys.version_info >= (3, 12); print("%d.%d" % sys.version_info[:2])' \
    2>/dev/null) || continue
  pick[$ver]=$p
done
if [ ${#pick[@]} = 0 ]; then
  echo "pack_python.sh: no Python 3.12 or later here (STRATA_OTHER_PYTHONS names some): nothing built"
  exit 77
fi
status=0
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for ver in $(printf '%s\n' "${!pick[@]}" | sort -V); do
  p=${pick[$ver]}
  dest=$out/strata-$ver
  echo "== pack_python.sh: Python $ver ($p) into $dest"
  rm -rf "$dest"
  if ! PYTHON=$p STRATA_JOBS=2 "$ROOT/scripts/build_python.sh" "$build" "$dest" >"$scratch/build.log" 2>&1; then
    cat "$scratch/build.log"
    echo "pack_python.sh: FAIL: the package does not build for Python $ver ($p)"
    status=1
    continue
  fi
  grep -i "warning" -A3 "$scratch/build.log" || true
  # Only the package is carried: not the CMake tree around it.
  find "$dest" -mindepth 1 -maxdepth 1 ! -name python -exec rm -rf {} +
  find "$dest" -name __pycache__ -type d -prune -exec rm -rf {} +
  mkdir -p "$scratch/$ver"
  if ! "$p" -B "$ROOT/tests/python/binding_check.py" "$dest/python" "$scratch/$ver"; then
    echo "pack_python.sh: FAIL: binding_check.py with Python $ver"
    status=1
  fi
done
exit $status
