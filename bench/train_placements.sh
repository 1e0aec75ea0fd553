#!/usr/bin/env bash
# Placements of the same model, interleaved: offload_optimizer/offload_param
# none/none (everything in HBM: the baseline), cpu/none, cpu/cpu and
# nvme/nvme, each in its own `strata train` process, N rounds alternating so
# that all see the same machine noise. Prints each run, then the medians:
# tokens/s, tokens/s as a ratio to none/none, the step's bound efficiency and
# what bounds it. Needs python3.
#   bench/train_placements.sh [rounds=3] [config] [nvme-dir]
# Default config: configs/gpu-270m.json on a machine with a GPU, else
# configs/demo.json on the host device (a smaller shape), with an HBM budget
# of $STRATA_PLACEMENTS_HBM (256M) so that none/none fits.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
STRATA="$BUILD_DIR/apps/strata/strata"
ROUNDS="${1:-3}"
if [ -n "${2:-}" ]; then
  CONFIG="$2"
elif "$STRATA" info --json 2>/dev/null | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin).get("gpu",{}).get("devices") else 1)'; then
  CONFIG="$ROOT/configs/gpu-270m.json"
else
  # The demo's states do not fit its 26 MiB budget all in HBM: one budget
  # that holds none/none, for every placement.
  CONFIG="$ROOT/configs/demo.json"
  export STRATA_PLACEMENTS_HBM="${STRATA_PLACEMENTS_HBM:-256M}"
fi
WORK="$BUILD_DIR/run/placements"
NVME="${3:-$WORK/nvme}"
mkdir -p "$WORK" "$NVME"
PLACEMENTS="none/none cpu/none cpu/cpu nvme/nvme"
python3 - "$CONFIG" "$WORK" "$NVME" $PLACEMENTS <<'PY'
import json, os, sys
src, work, nvme, *placements = sys.argv[1:]
base = json.load(open(src))
if os.environ.get("STRATA_PLACEMENTS_HBM"):
    base.setdefault("strata", {})["hbm_budget"] = os.environ["STRATA_PLACEMENTS_HBM"]
for p in placements:
    opt, par = p.split("/")
    c = json.loads(json.dumps(base))
    z = c.setdefault("zero_optimization", {})
    z["offload_optimizer"] = {"device": opt, **({"nvme_path": nvme, "buffer_count": 4} if opt == "nvme" else {})}
    z["offload_param"] = {"device": par, **({"nvme_path": nvme, "buffer_count": 8} if par == "nvme" else {})}
    json.dump(c, open(f"{work}/{opt}_{par}.json", "w"), indent=1)
PY
echo "config: $CONFIG"
for i in $(seq 1 "$ROUNDS"); do
  for p in $PLACEMENTS; do
    name="${p/\//_}"
    if ! "$STRATA" train --config "$WORK/$name.json" --json > "$WORK/$name.$i.json" 2> "$WORK/$name.$i.err"; then
      echo "$p round $i failed: $(tail -1 "$WORK/$name.$i.err")"
    fi
  done
done
python3 - "$WORK" "$ROUNDS" $PLACEMENTS <<'PY'
import json, statistics, sys, os
work, rounds, *placements = sys.argv[1:]
rows = {}
print(f"{'placement':<11}{'round':>6}{'tok/s':>10}{'step s':>9}{'bound eff':>10}  bound by; device")
for p in placements:
    name = p.replace("/", "_")
    for i in range(1, int(rounds) + 1):
        f = f"{work}/{name}.{i}.json"
        if not os.path.exists(f) or os.path.getsize(f) == 0:
            continue
        d = json.load(open(f))
        if "error" in d:
            continue
        rows.setdefault(p, []).append(d)
        print(f"{p:<11}{i:>6}{d['tokens_per_s']:>10.0f}{d['step_time_s']:>9.3f}{d.get('bound_efficiency', 0):>10.3f}  {d.get('bound_by', '')}; {d.get('device', '?')}")
base = statistics.median(d["tokens_per_s"] for d in rows.get("none/none", [])) if rows.get("none/none") else None
# Every figure names the device it was measured on; ratios across devices
# would be meaningless, so a mix is called out.
devices = sorted({d.get("device", "?") for ds in rows.values() for d in ds})
print()
print(f"device: {', '.join(devices) if devices else '-'}")
if len(devices) > 1:
    print("warning: the runs used different devices; the ratios compare different machines")
print(f"{'placement':<11}{'tok/s':>10}{'vs none/none':>14}{'bound eff':>10}  final loss")
for p, ds in rows.items():
    t = statistics.median(d["tokens_per_s"] for d in ds)
    b = statistics.median(d.get("bound_efficiency", 0) for d in ds)
    ratio = f"{t / base:.3f}" if base else "-"
    print(f"{p:<11}{t:>10.0f}{ratio:>14}{b:>10.3f}  {ds[-1]['final_loss']:.6f}")
PY
