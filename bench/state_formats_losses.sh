#!/usr/bin/env bash
# The convergence table of the compact optimizer states: the demo model
# (configs/demo.json with the optimizer and parameters on the CPU, its other
# settings unchanged: same data, seed and schedule), or with --llama the
# frontend's Llama example (examples/torch/train_llama.py at its default
# size and settings, configs/hf_zero3_llama.json), trained STEPS steps with
# strata.optimizer_states fp32, bf16, bf16-master and int8. Prints the loss
# at steps 50, 100 and 300 (those within STEPS) and the last one per format,
# the final loss relative to fp32's, and the mean over the last tenth of the
# steps relative to fp32's. Losses do not depend on timing, so a
# loaded machine gives the same table. Needs /usr/bin/python3.
#   bench/state_formats_losses.sh [--llama] [steps=300]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
STRATA="$BUILD_DIR/apps/strata/strata"
LLAMA=0
if [ "${1:-}" = "--llama" ]; then
  LLAMA=1
  shift
fi
STEPS="${1:-300}"
WORK="$BUILD_DIR/run/state_formats"
mkdir -p "$WORK"
PY=/usr/bin/python3
for f in fp32 bf16 bf16-master int8; do
  if [ "$LLAMA" = 1 ]; then
    # (The script's last line is a JSON summary with the per-step losses.)
    PYTHONPATH="$BUILD_DIR/python" "$PY" "$ROOT/examples/torch/train_llama.py" --steps "$STEPS" \
      --optimizer-states "$f" --quiet 2>/dev/null | tail -1 > "$WORK/$f.out.json"
    continue
  fi
  "$PY" - "$ROOT/configs/demo.json" "$WORK/$f.json" "$f" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
c["zero_optimization"]["offload_param"] = {"device": "cpu"}
c["strata"]["optimizer_states"] = sys.argv[3]
json.dump(c, open(sys.argv[2], "w"))
PY
  "$STRATA" train --config "$WORK/$f.json" --steps "$STEPS" --json 2>/dev/null > "$WORK/$f.out.json"
done
"$PY" - "$WORK" "$STEPS" <<'PY'
import json, sys
work, steps = sys.argv[1], int(sys.argv[2])
marks = [s for s in (50, 100, 300) if s < steps] + [steps]
runs = {f: json.load(open(f"{work}/{f}.out.json"))["losses"] for f in ("fp32", "bf16", "bf16-master", "int8")}
tail = max(1, steps // 10)  # the last tenth of the steps, averaged: one batch's loss is noisy
print("| states | " + " | ".join(f"loss at step {s}" for s in marks) +
      f" | final vs fp32 | mean of the last {tail} | vs fp32 |")
print("|---|" + "---|" * (len(marks) + 3))
base = runs["fp32"][-1]
base_tail = sum(runs["fp32"][-tail:]) / tail
for f, l in runs.items():
    row = " | ".join(f"{l[s - 1]:.4f}" for s in marks)
    mean = sum(l[-tail:]) / tail
    print(f"| {f} | {row} | {l[-1] / base - 1:+.2%} | {mean:.4f} | {mean / base_tail - 1:+.2%} |")
PY
