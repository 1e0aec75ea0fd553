#!/usr/bin/env bash
# Interleaved A/B of the optimizer overlap on the demo: N pairs of
# `strata train` runs, blocking steps (strata.overlap_optimizer=false, the
# reference) then overlapped steps (the default), each in its own process,
# alternating so that both see the same machine noise. Prints each run and
# the medians. Needs python3 (JSON).
#   bench/train_overlap_ab.sh [pairs=5] [config=configs/demo.json]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
PAIRS="${1:-5}"
CONFIG="${2:-$ROOT/configs/demo.json}"
STRATA="$BUILD_DIR/apps/strata/strata"
WORK="$BUILD_DIR/run/overlap_ab"
mkdir -p "$WORK/nvme"
python3 - "$CONFIG" "$WORK/blocking.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.setdefault("strata", {})["overlap_optimizer"] = False
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
for i in $(seq 1 "$PAIRS"); do
  "$STRATA" train --config "$WORK/blocking.json" --nvme-path "$WORK/nvme" --json \
      > "$WORK/blocking.$i.json" 2>/dev/null
  "$STRATA" train --config "$CONFIG" --nvme-path "$WORK/nvme" --json \
      > "$WORK/overlap.$i.json" 2>/dev/null
done
python3 - "$WORK" "$PAIRS" <<'PY'
import json, statistics, sys
work, pairs = sys.argv[1], int(sys.argv[2])
rows = {"blocking": [], "overlap": []}
print(f"{'run':<12}{'final loss':>12}{'step s':>9}{'tok/s':>8}{'overlap':>9}{'opt wait s':>11}")
for i in range(1, pairs + 1):
    for mode in ("blocking", "overlap"):
        d = json.load(open(f"{work}/{mode}.{i}.json"))
        steady = d["per_step"][1:]
        wait = statistics.median(s.get("optimizer_wait_s", 0) + s["optimizer_wall_s"] for s in steady)
        r = (d["final_loss"], d["step_time_s"], d["tokens_per_s"], d["overlap_efficiency"], wait)
        rows[mode].append(r)
        print(f"{mode + ' ' + str(i):<12}{r[0]:>12.6f}{r[1]:>9.3f}{r[2]:>8.0f}{r[3]:>9.3f}{r[4]:>11.4f}")
med = {m: [statistics.median(x[k] for x in v) for k in range(5)] for m, v in rows.items()}
for m in ("blocking", "overlap"):
    r = med[m]
    print(f"{'median ' + m:<12}{'':>12}{r[1]:>9.3f}{r[2]:>8.0f}{r[3]:>9.3f}{r[4]:>11.4f}")
print(f"step time overlap/blocking: {med['overlap'][1] / med['blocking'][1]:.3f}")
same = all(a[0] == b[0] for a, b in zip(rows["blocking"], rows["overlap"]))
print("final losses bitwise equal:", same)
PY
