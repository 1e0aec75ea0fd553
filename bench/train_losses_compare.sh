#!/usr/bin/env bash
# Bitwise check of two `strata` binaries (a change against the build before
# it): the per-step losses of `strata train --steps N --json` on the shipped
# example configs, on the demo with delayed_param_update, and on the demo with
# three micro-batches per step and the optimizer on the CPU. Prints one line
# per run (same / DIFF) and exits 1 on any difference. Needs /usr/bin/python3.
#   bench/train_losses_compare.sh STRATA_A STRATA_B [steps=6]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
A="$1"
B="$2"
STEPS="${3:-6}"
WORK="$BUILD_DIR/run/losses_compare"
mkdir -p "$WORK/nvme"
PY=/usr/bin/python3
"$PY" - "$ROOT/configs/demo.json" "$WORK" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
dpu = json.loads(json.dumps(c))
dpu.setdefault("strata", {})["delayed_param_update"] = True
json.dump(dpu, open(sys.argv[2] + "/demo_dpu.json", "w"))
gas = json.loads(json.dumps(c))
gas["gradient_accumulation_steps"] = 3
gas["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
json.dump(gas, open(sys.argv[2] + "/demo_gas3.json", "w"))
PY
status=0
for cfg in "$ROOT/configs/demo.json" "$ROOT/configs/zero2_cpu_offload.json" \
           "$ROOT/configs/zero3_cpu_offload.json" "$ROOT/configs/zero3_nvme_offload.json" \
           "$WORK/demo_dpu.json" "$WORK/demo_gas3.json"; do
  for bin in "$A" "$B"; do
    "$bin" train --config "$cfg" --nvme-path "$WORK/nvme" --steps "$STEPS" --json 2>/dev/null |
      "$PY" -c "import json,sys; print(repr(json.load(sys.stdin)['losses']))"
  done > "$WORK/out.txt"
  if [ "$(sed -n 1p "$WORK/out.txt")" = "$(sed -n 2p "$WORK/out.txt")" ]; then
    echo "same  $(basename "$cfg")"
  else
    echo "DIFF  $(basename "$cfg")"; cat "$WORK/out.txt"; status=1
  fi
done
exit "$status"
