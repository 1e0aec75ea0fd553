#!/usr/bin/env bash
# Builds the Python package `strata` (the _strata extension and the PyTorch
# frontend) for a Python other than the one the project was built with: a
# GPU machine's Python and torch, against the library an existing build tree
# holds. It uses only what that machine has: CMake, a C++20 compiler, the
# interpreter's headers, pybind11 (its CMake package or pip's) and a DLPack
# header (the system's or torch's).
#
#   scripts/build_python.sh BUILD_DIR [OUT_DIR]
#     BUILD_DIR  the project's build tree (holds libstrata.so)
#     OUT_DIR    where to build (default BUILD_DIR/python-<X.Y> of that Python)
#   PYTHON       the interpreter (default python3)
#
# Then: PYTHONPATH=OUT_DIR/python $PYTHON -c 'import strata'
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:?usage: scripts/build_python.sh BUILD_DIR [OUT_DIR]}
python=$(command -v "${PYTHON:-python3}") || { echo "build_python.sh: no ${PYTHON:-python3}" >&2; exit 2; }
[ -e "$build/libstrata.so" ] || { echo "build_python.sh: no libstrata.so in $build" >&2; exit 2; }
ver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') ||
  { echo "build_python.sh: $python does not run a Python statement (python -c failed)" >&2; exit 2; }
out=${2:-$build/python-$ver}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$ROOT/python" -B "$out" "${gen[@]}" -DSTRATA_BUILD_DIR="$(cd "$build" && pwd)" \
  -DPython_EXECUTABLE="$python" >/dev/null
cmake --build "$out" -j "${STRATA_JOBS:-$(nproc)}"
echo "build_python.sh: strata for Python $ver in $out/python (PYTHONPATH=$out/python)"
