#!/usr/bin/env bash
# Interleaved A/B of the speculative step: N pairs of `strata train` runs,
# the step after backward (strata.speculative_step=false, the reference)
# then the speculative step (true), each in its own process, alternating so
# that both see the same machine noise. OVERRIDES (JSON) is merged into the
# config first (objects key by key). Prints each run and the medians over
# the steps after the second: step time, the blocking part of Step()
# (optimizer_wall_s) and the hooks' wait for the step's parameters
# (optimizer_wait_s), and the sub-groups speculated and redone. Needs
# Debian's python3 (JSON).
#   bench/train_speculation_ab.sh [pairs=5] [config=configs/demo.json] [overrides={}]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
PAIRS="${1:-5}"
CONFIG="${2:-$ROOT/configs/demo.json}"
OVERRIDES="${3:-{\}}"
STRATA="$BUILD_DIR/apps/strata/strata"
PY=/usr/bin/python3
WORK="$BUILD_DIR/run/speculation_ab"
mkdir -p "$WORK/nvme"
"$PY" - "$CONFIG" "$OVERRIDES" "$WORK" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
def merge(a, b):
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            merge(a[k], v)
        else:
            a[k] = v
merge(c, json.loads(sys.argv[2]))
for name, on in (("after", False), ("speculative", True)):
    c.setdefault("strata", {})["speculative_step"] = on
    json.dump(c, open(f"{sys.argv[3]}/{name}.json", "w"), indent=1)
PY
for i in $(seq 1 "$PAIRS"); do
  for mode in after speculative; do
    "$STRATA" train --config "$WORK/$mode.json" --nvme-path "$WORK/nvme" --json \
        > "$WORK/$mode.$i.json" 2>/dev/null
  done
done
"$PY" - "$WORK" "$PAIRS" <<'PY'
import json, statistics, sys
work, pairs = sys.argv[1], int(sys.argv[2])
keys = ("step_time_s", "optimizer_wall_s", "optimizer_wait_s")
rows = {"after": [], "speculative": []}
print(f"{'run':<16}{'final loss':>12}{'step s':>9}{'blocking s':>11}{'wait s':>9}{'spec':>6}{'redone':>7}")
for i in range(1, pairs + 1):
    for mode in rows:
        d = json.load(open(f"{work}/{mode}.{i}.json"))
        steady = d["per_step"][2:]
        med = [statistics.median(s[k] for s in steady) for k in keys]
        spec = sum(s.get("sub_groups_speculated", 0) for s in d["per_step"])
        redone = sum(s.get("sub_groups_redone", 0) for s in d["per_step"])
        rows[mode].append((d["final_loss"], *med))
        print(f"{mode + ' ' + str(i):<16}{d['final_loss']:>12.6f}{med[0]:>9.4f}{med[1]:>11.4f}"
              f"{med[2]:>9.4f}{spec:>6}{redone:>7}")
med = {m: [statistics.median(r[k] for r in v) for k in range(1, 4)] for m, v in rows.items()}
for m, r in med.items():
    print(f"{'median ' + m:<16}{'':>12}{r[0]:>9.4f}{r[1]:>11.4f}{r[2]:>9.4f}")
a, s = med["after"], med["speculative"]
print(f"speculative/after: step {s[0] / a[0]:.3f}, blocking + wait {(s[1] + s[2]) / (a[1] + a[2]):.3f}")
same = all(x[0] == y[0] for x, y in zip(rows["after"], rows["speculative"]))
print("final losses bitwise equal:", same)
PY
