#!/usr/bin/env bash
# `pip install` as a Python user runs it: a fresh venv that sees the
# system's torch (--system-site-packages), `pip install --no-build-isolation
# --no-index ./python` (offline: the interpreter's setuptools and wheel),
# then, from another directory, `import strata` from the venv and a few
# training steps of README's loop against torch's AdamW; `pip uninstall`
# leaves no file of the package behind.
#
#   tests/python/pip_install_test.sh BUILD_DIR PYTHON [--full]
#
# The library is taken from BUILD_DIR (STRATA_BUILD_DIR), so only the
# extension is compiled; --full builds the library too, from the checkout,
# as a user's first `pip install` does (scripts/check_platform.sh).
# Exit 77 (CTest: skipped) when PYTHON has no venv, pip, setuptools, wheel
# or torch.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "${1:?usage: pip_install_test.sh BUILD_DIR PYTHON [--full]}" && pwd)
python=${2:?usage: pip_install_test.sh BUILD_DIR PYTHON [--full]}
full=${3:-}
for mod in venv pip setuptools wheel torch; do
  if ! "$python" -c "import $mod" 2>/dev/null; then
    echo "pip_install_test: SKIP: $python has no $mod (Debian: python3-venv python3-pip python3-setuptools python3-wheel python3-torch)"
    exit 77
  fi
done
venv="$build/pip-venv"
rm -rf "$venv"
"$python" -m venv --system-site-packages "$venv"
vpy="$venv/bin/python"
env=()
[ "$full" = --full ] || env=(STRATA_BUILD_DIR="$build")
log="$build/pip-install.log"
if ! env "${env[@]}" "$vpy" -m pip install --no-build-isolation --no-index "$ROOT/python" >"$log" 2>&1; then
  tail -n 40 "$log"
  echo "pip_install_test: FAILED: pip install (log: $log)"
  exit 1
fi
echo "pip_install_test: installed ($(grep -c '' "$log") lines of log in $log)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# Nothing from the checkout or the build tree on the path: the venv's copy.
env -u PYTHONPATH "$vpy" - "$venv" <<'EOF'
import os, sys
import torch
import strata
venv = sys.argv[1]
assert strata.__file__.startswith(os.path.realpath(venv)) or strata.__file__.startswith(venv), \
    f"strata imported from {strata.__file__}, not the venv {venv}"
print("strata from", os.path.dirname(strata.__file__))

def model_and_data(seed):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(8, 24, generator=g)
    y = torch.randint(0, 5, (8,), generator=g)
    return model, x, y

cfg = {"train_micro_batch_size_per_gpu": 8,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                             "offload_param": {"device": "cpu"}},
       "strata": {"device": "host", "threads": 1}}
model, x, y = model_and_data(0)
engine = strata.initialize(model, config=cfg)
losses = []
for _ in range(5):
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
engine.synchronize()
engine.close()

ref, x, y = model_and_data(0)
opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
ref_losses = []
for _ in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())
print("strata losses", [round(v, 6) for v in losses])
print("torch  losses", [round(v, 6) for v in ref_losses])
assert losses[-1] < losses[0], "the loss did not fall"
assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)), \
    "strata's losses are not torch AdamW's"
EOF

files=$("$vpy" -m pip show -f strata | sed -n '/^Files:/,$p' | tail -n +2 | wc -l)
echo "pip_install_test: the package has $files files; uninstalling"
"$vpy" -m pip uninstall -y strata >/dev/null
if env -u PYTHONPATH "$vpy" -c 'import strata' 2>/dev/null; then
  echo "pip_install_test: FAILED: strata still imports after pip uninstall"
  exit 1
fi
left=$(find "$venv/lib" -path '*-packages/strata*' | head -n 5)
if [ -n "$left" ]; then
  echo "pip_install_test: FAILED: pip uninstall left: $left"
  exit 1
fi
echo "pip_install_test: passed"
