#!/usr/bin/env bash
# Interleaved A/B of one config key: N pairs of `strata train` runs, the key
# at value A (the reference) then at value B, each in its own process,
# alternating so that both see the same machine noise. KEY is a dotted path
# ("strata.grad_tier"); A and B are JSON values ('"dram"', 'false').
# OVERRIDES (JSON) is merged into the config first (objects key by key).
# Prints each run and the medians over the steps after the second: step
# time, the blocking part of Step() (optimizer_wall_s), the hooks' wait for
# the step's parameters (optimizer_wait_s), the sub-groups speculated and
# redone, and per run the bytes copied device-to-host per step and the peak
# RSS. Needs Debian's python3 (JSON).
#   bench/train_ab.sh KEY A B [pairs=5] [config=configs/demo.json] [overrides={}]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
if [ $# -lt 3 ]; then
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
KEY="$1"
VALUE_A="$2"
VALUE_B="$3"
PAIRS="${4:-5}"
CONFIG="${5:-$ROOT/configs/demo.json}"
OVERRIDES="${6:-{\}}"
STRATA="$BUILD_DIR/apps/strata/strata"
PY=/usr/bin/python3
WORK="$BUILD_DIR/run/train_ab"
mkdir -p "$WORK/nvme"
"$PY" - "$CONFIG" "$OVERRIDES" "$WORK" "$KEY" "$VALUE_A" "$VALUE_B" <<'PY'
import json, sys
config, overrides, work, key, a, b = sys.argv[1:7]
c = json.load(open(config))
def merge(x, y):
    for k, v in y.items():
        if isinstance(v, dict) and isinstance(x.get(k), dict):
            merge(x[k], v)
        else:
            x[k] = v
merge(c, json.loads(overrides))
*path, last = key.split(".")
for name, value in (("a", a), ("b", b)):
    node = c
    for p in path:
        node = node.setdefault(p, {})
    node[last] = json.loads(value)
    json.dump(c, open(f"{work}/{name}.json", "w"), indent=1)
PY
for i in $(seq 1 "$PAIRS"); do
  for mode in a b; do
    "$STRATA" train --config "$WORK/$mode.json" --nvme-path "$WORK/nvme" --json \
        > "$WORK/$mode.$i.json" 2>/dev/null
  done
done
"$PY" - "$WORK" "$PAIRS" "$KEY" "$VALUE_A" "$VALUE_B" <<'PY'
import json, statistics, sys
work, pairs, key, va, vb = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
keys = ("step_time_s", "optimizer_wall_s", "optimizer_wait_s")
label = {"a": f"{key}={va}", "b": f"{key}={vb}"}
rows = {"a": [], "b": []}
print(f"A: {label['a']}, B: {label['b']}")
print(f"{'run':<8}{'final loss':>12}{'step s':>9}{'blocking s':>11}{'wait s':>9}{'spec':>6}"
      f"{'redone':>7}{'d2h MiB/step':>13}{'peak RSS MiB':>13}")
for i in range(1, pairs + 1):
    for mode in rows:
        d = json.load(open(f"{work}/{mode}.{i}.json"))
        steady = d["per_step"][2:]
        med = [statistics.median(s[k] for s in steady) for k in keys]
        spec = sum(s.get("sub_groups_speculated", 0) for s in d["per_step"])
        redone = sum(s.get("sub_groups_redone", 0) for s in d["per_step"])
        d2h = d["pcie_d2h_bytes"] / d["steps"] / 2**20
        rss = d["peak_rss_bytes"] / 2**20
        rows[mode].append((d["final_loss"], *med))
        print(f"{mode.upper() + ' ' + str(i):<8}{d['final_loss']:>12.6f}{med[0]:>9.4f}"
              f"{med[1]:>11.4f}{med[2]:>9.4f}{spec:>6}{redone:>7}{d2h:>13.1f}{rss:>13.1f}")
med = {m: [statistics.median(r[k] for r in v) for k in range(1, 4)] for m, v in rows.items()}
for m, r in med.items():
    print(f"{'median ' + m.upper():<8}{'':>12}{r[0]:>9.4f}{r[1]:>11.4f}{r[2]:>9.4f}")
a, b = med["a"], med["b"]
blocking = (b[1] + b[2]) / (a[1] + a[2]) if a[1] + a[2] > 0 else float("nan")
print(f"B/A: step {b[0] / a[0]:.3f}, blocking + wait {blocking:.3f}")
same = all(x[0] == y[0] for x, y in zip(rows["a"], rows["b"]))
print("final losses bitwise equal:", same)
PY
