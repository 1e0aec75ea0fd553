#!/usr/bin/env bash
# Packs Debian's pytest (pure Python: pytest, _pytest, pluggy, iniconfig,
# packaging, py.py, attrs) into a folder that a GPU machine without pytest
# can put on PYTHONPATH, so that `scripts/gpu_check.sh --frontend` runs the
# frontend's tests there. That machine has no network; its own pytest, when
# it has one, comes first. pytest 7.2 runs on Python 3.12 and 3.13 (with
# deprecation warnings from its assertion rewriting).
#
#   scripts/pack_pytest.sh [OUT_DIR]      (default .gpu/pydeps)
# Then carry it beside the pack: run with carry [".gpu/pack", ".gpu/pydeps"].
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$ROOT/.gpu/pydeps}
src=/usr/lib/python3/dist-packages
if [ ! -d "$src/_pytest" ]; then
  echo "pack_pytest.sh: no pytest in $src (apt-get install python3-pytest)" >&2
  exit 2
fi
mkdir -p "$out"
# Only these are replaced: the folder also holds scripts/pack_python.sh's
# packages.
for m in pytest _pytest pluggy iniconfig packaging py.py attr attrs; do
  if [ ! -e "$src/$m" ]; then
    echo "pack_pytest.sh: $src/$m is missing" >&2
    exit 2
  fi
  rm -rf "${out:?}/$m"
  cp -r "$src/$m" "$out/"
done
find "$out" -name __pycache__ -type d -prune -exec rm -rf {} +  # Debian's 3.11 bytecode
# The set is complete: pytest imports and runs from it alone (no
# dist-packages on the path).
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
cat > "$check/test_packed.py" <<'EOF'
import pytest


@pytest.mark.parametrize("x", [1, 2])
def test_packed(x, tmp_path):
    assert x > 0 and tmp_path.is_dir()
    assert 0.1 + 0.2 == pytest.approx(0.3)
EOF
(cd "$check" && /usr/bin/python3 -S -B - "$out" "$check/test_packed.py" <<'EOF'
import sys
sys.path = [sys.argv[1]] + [p for p in sys.path if "-packages" not in p]
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[2]]))
EOF
) >/dev/null || { echo "pack_pytest.sh: the packed pytest does not run on its own" >&2; exit 1; }
echo "pack_pytest.sh: pytest $(/usr/bin/python3 -c 'import pytest; print(pytest.__version__)') in $out ($(du -sh "$out" | cut -f1))"
