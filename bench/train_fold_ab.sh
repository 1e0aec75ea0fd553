#!/usr/bin/env bash
# Interleaved A/B of the gradient path: N pairs of `strata train` runs of one
# config, the last micro-batch accumulated (STRATA_FOLD_GRADS=off, the
# reference) then as the plan chooses (auto: folded into the optimizer where
# it pays), each in its own process, alternating so that both see the same
# machine noise. Prints each run, the medians of step time, tokens/s,
# grad_offload_s (gradient worker busy per step), optimizer_wall_s (Step()'s
# checks + launch) and optimizer_wait_s (the next forward waiting for the
# overlapped step) per step, the plan's gradient line, and
# whether the losses are bitwise equal. Needs python3.
#   bench/train_fold_ab.sh [pairs=5] [config=configs/demo.json] [steps]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
PAIRS="${1:-5}"
CONFIG="${2:-$ROOT/configs/demo.json}"
STEPS="${3:-}"
STRATA="$BUILD_DIR/apps/strata/strata"
WORK="$BUILD_DIR/run/fold_ab"
mkdir -p "$WORK/nvme"
args=(train --config "$CONFIG" --nvme-path "$WORK/nvme" --json)
[ -n "$STEPS" ] && args+=(--steps "$STEPS")
for i in $(seq 1 "$PAIRS"); do
  for mode in off auto; do
    STRATA_FOLD_GRADS=$mode "$STRATA" "${args[@]}" > "$WORK/$mode.$i.json" 2> "$WORK/$mode.$i.err"
  done
done
python3 - "$WORK" "$PAIRS" <<'PY'
import json, statistics, sys
work, pairs = sys.argv[1], int(sys.argv[2])
rows = {"off": [], "auto": []}
losses = {"off": [], "auto": []}
grad_line = {}
print(f"{'run':<9}{'step s':>9}{'tok/s':>8}{'grad_off s':>11}{'opt wall s':>11}{'opt wait s':>11}")
for i in range(1, pairs + 1):
    for mode in ("off", "auto"):
        d = json.load(open(f"{work}/{mode}.{i}.json"))
        steady = d["per_step"][1:] or d["per_step"]
        med = lambda k: statistics.median(s.get(k, 0) for s in steady)
        r = (d["step_time_s"], d["tokens_per_s"], med("grad_offload_s"), med("optimizer_wall_s"),
             med("optimizer_wait_s"))
        rows[mode].append(r)
        losses[mode].append(d["losses"])
        for b in d.get("budgets", []):
            for key in ("gradient landing", "last micro-batch accumulated"):
                if key in b["detail"]:
                    grad_line[mode] = b["detail"][b["detail"].index(key):].split(" + ")[0]
        print(f"{mode + ' ' + str(i):<9}{r[0]:>9.3f}{r[1]:>8.0f}{r[2]:>11.4f}{r[3]:>11.4f}{r[4]:>11.4f}")
med = {m: [statistics.median(x[k] for x in v) for k in range(5)] for m, v in rows.items()}
for m in ("off", "auto"):
    r = med[m]
    print(f"{'median ' + m:<9}{r[0]:>9.3f}{r[1]:>8.0f}{r[2]:>11.4f}{r[3]:>11.4f}{r[4]:>11.4f}")
print(f"step time auto/off: {med['auto'][0] / med['off'][0]:.3f}")
for m in ("off", "auto"):
    print(f"plan ({m}): {grad_line.get(m, '?')}")
print("losses bitwise equal:", all(a == b for a, b in zip(losses["off"], losses["auto"])))
PY
