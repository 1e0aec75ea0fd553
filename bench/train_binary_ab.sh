#!/usr/bin/env bash
# Interleaved A/B of two `strata` binaries on one config (a change against
# the build before it): N pairs of `strata train` runs, A then B, each in its
# own process, so both see the same machine noise. Prints per-run and median
# step time, tokens/s, fetch wait (share of the step, steady steps), overlap
# and whether the final losses are bitwise equal. Needs python3 (JSON).
#   bench/train_binary_ab.sh STRATA_A STRATA_B [pairs=5] [config=configs/demo.json]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
A="$1"
B="$2"
PAIRS="${3:-5}"
CONFIG="${4:-$ROOT/configs/demo.json}"
WORK="$BUILD_DIR/run/binary_ab"
mkdir -p "$WORK/nvme"
for i in $(seq 1 "$PAIRS"); do
  "$A" train --config "$CONFIG" --nvme-path "$WORK/nvme" --json > "$WORK/a.$i.json" 2>/dev/null
  "$B" train --config "$CONFIG" --nvme-path "$WORK/nvme" --json > "$WORK/b.$i.json" 2>/dev/null
done
python3 - "$WORK" "$PAIRS" <<'PY'
import json, statistics as st, sys
work, pairs = sys.argv[1], int(sys.argv[2])
rows = {"a": [], "b": []}
print(f"{'run':<8}{'final loss':>12}{'step s':>9}{'tok/s':>8}{'fetch wait %':>14}{'overlap':>9}")
for i in range(1, pairs + 1):
    for m in ("a", "b"):
        d = json.load(open(f"{work}/{m}.{i}.json"))
        steady = d["per_step"][1:]
        fw = 100 * st.median(s["fetch_wait_s"] / s["step_time_s"] for s in steady)
        r = (d["final_loss"], d["step_time_s"], d["tokens_per_s"], fw, d["overlap_efficiency"])
        rows[m].append(r)
        print(f"{m + ' ' + str(i):<8}{r[0]:>12.6f}{r[1]:>9.3f}{r[2]:>8.0f}{r[3]:>14.2f}{r[4]:>9.3f}")
med = {m: [st.median(x[k] for x in v) for k in range(5)] for m, v in rows.items()}
for m in ("a", "b"):
    r = med[m]
    print(f"{'median ' + m:<8}{'':>12}{r[1]:>9.3f}{r[2]:>8.0f}{r[3]:>14.2f}{r[4]:>9.3f}")
print(f"step time b/a: {med['b'][1] / med['a'][1]:.3f}")
print("final losses bitwise equal:", all(x[0] == y[0] for x, y in zip(rows["a"], rows["b"])))
PY
