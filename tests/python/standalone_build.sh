#!/usr/bin/env bash
# CTest python_standalone_build: the package built alone against the build
# tree's libstrata.so (scripts/build_python.sh, the path a GPU machine's
# Python takes), then the frontend's tests that cover the extension's calls
# run against that build, not the one in BUILD/python.
#   standalone_build.sh BUILD_DIR PYTHON
set -euo pipefail
build=$1 python=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=$build/python-standalone
PYTHON=$python STRATA_JOBS=2 "$here/../../scripts/build_python.sh" "$build" "$out"
export PYTHONPATH=$out/python
where=$("$python" -c 'import strata._strata as s; print(s.__file__)')
case $where in
  "$out"/python/strata/_strata*) ;;
  *) echo "standalone_build.sh: imported $where, not the standalone build" >&2; exit 1 ;;
esac
exec "$python" "$here/run_pytest.py" "$here/test_torch_frontend.py" "$here/test_safetensors.py" \
  "$here/test_zero_to_fp32.py"
