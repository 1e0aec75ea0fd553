#!/usr/bin/env bash
# CTest python_other_version: the package built for each Python 3.12 or later
# on this machine other than the build's (scripts/build_python.sh, the path
# a GPU machine's Python takes), and its binding checked there without torch
# (binding_check.py: training steps against AdamW, checkpoints, errors).
#   other_python_version.sh BUILD_DIR BUILD_PYTHON
# The interpreters: STRATA_OTHER_PYTHONS (space-separated paths) when set,
# else python3.12 ... python3.14 on PATH and pyenv's versions (newest patch
# release of each minor version). Skipped (exit 77) when there is none.
set -uo pipefail
build=$1 build_python=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build_ver=$("$build_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
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
# One interpreter per minor version (the last found: pyenv's newest patch
# release), each one that runs, none of the build's version.
declare -A pick
for p in "${candidates[@]}"; do
  ver=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
  [ "$ver" = "$build_ver" ] && continue
  pick[$ver]=$p
done
if [ ${#pick[@]} = 0 ]; then
  echo "other_python_version.sh: no Python 3.12 or later besides the build's ($build_ver) here" \
    "(STRATA_OTHER_PYTHONS names some): skipped"
  exit 77
fi
status=0
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for ver in $(printf '%s\n' "${!pick[@]}" | sort -V); do
  p=${pick[$ver]}
  out=$build/python-other/$ver
  echo "== Python $ver ($p): scripts/build_python.sh $build $out"
  if ! PYTHON=$p STRATA_JOBS=2 "$here/../../scripts/build_python.sh" "$build" "$out"; then
    echo "other_python_version.sh: FAIL: the package does not build for Python $ver ($p)"
    status=1
    continue
  fi
  mkdir -p "$scratch/$ver"
  "$p" "$here/binding_check.py" "$out/python" "$scratch/$ver" || status=1
done
exit $status
