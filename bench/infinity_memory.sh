#!/usr/bin/env bash
# Host memory and step time of training with everything on NVMe
# (offload_optimizer and offload_param nvme) at several model sizes: for each
# size, `strata train` of the example model for a few steps on the host
# device, then a line with the parameters, the model states' bytes, the
# process's peak RSS (GNU time's maximum resident set size), RSS per
# parameter, the plan's pinned and DRAM needs and the host memory it plans
# (pinned + DRAM + the host device's "HBM", which is host memory too) with
# the ratio of the peak RSS to it, the median step time and NVMe bytes read
# and written per step (over the steps after the first), and
# the NVMe bound ratio: step time / (bytes read / read rate + bytes written /
# write rate), the rates those the engine measured on the directory when it
# planned (StepStats::nvme_read_gbytes_per_s / nvme_write_gbytes_per_s).
#
#   bench/infinity_memory.sh [-s STRATA] [-d NVME_DIR] [-n STEPS] [-p PINNED] [-H HBM]
#                            [-g GRAD_TIER] [-u SUB_GROUP] [-a GAS] [-D DEVICE] [-S STATES]
#                            [SIZE ...]
#
# SIZE is LAYERSxHIDDEN of the example model (default: 8x2048 16x2048
# 32x2048, about 268M, 537M and 1.07B parameters: the same module size, so
# that what grows is only the parameter count). Micro-batch 1, sequence 16,
# hbm_budget HBM (default 3G), pinned_budget PINNED (default 6G; a budget
# that does not hold the optimizer pipeline's buffers of whole sub-groups
# streams them in pieces), strata.grad_tier GRAD_TIER (default nvme: the gradient sums
# on NVMe too), sub_group_size SUB_GROUP (default 5e7), GAS micro-batches a
# step (default 1), strata.device DEVICE (default host; cuda on a GPU box,
# where the "planned" column leaves HBM out), strata.optimizer_states
# STATES (default fp32; bf16, bf16-master, int8). NVME_DIR (default
# build/run/infinity) needs room for the largest size's states twice, its
# parameters twice and its gradients (about 34 bytes a parameter).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STRATA="$ROOT/build/apps/strata/strata"
DIR="$ROOT/build/run/infinity"
STEPS=3
PINNED=6G
GRAD_TIER=nvme
SUB_GROUP=5e7
GAS=1
DEVICE=host
STATES=fp32
HBM=3G
while getopts "s:d:n:p:H:g:u:a:D:S:" o; do
  case "$o" in
    s) STRATA="$OPTARG" ;;
    d) DIR="$OPTARG" ;;
    n) STEPS="$OPTARG" ;;
    p) PINNED="$OPTARG" ;;
    H) HBM="$OPTARG" ;;
    g) GRAD_TIER="$OPTARG" ;;
    u) SUB_GROUP="$OPTARG" ;;
    a) GAS="$OPTARG" ;;
    D) DEVICE="$OPTARG" ;;
    S) STATES="$OPTARG" ;;
    *) echo "usage: $0 [-s STRATA] [-d NVME_DIR] [-n STEPS] [-p PINNED] [-H HBM] [-g GRAD_TIER] [-u SUB_GROUP] [-a GAS] [-D DEVICE] [-S STATES] [SIZE ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(8x2048 16x2048 32x2048)
[ -x /usr/bin/time ] || { echo "infinity_memory: needs GNU time (/usr/bin/time; Debian's time package)" >&2; exit 2; }
PY=/usr/bin/python3
mkdir -p "$DIR"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

printf "%-9s %12s %9s %9s %8s %9s %9s %9s %8s %8s %9s %9s %11s %10s %10s\n" size parameters states \
  peak_rss "B/param" pinned dram planned rss/plan step "read" written "r/w GB/s" "step/bound" piece
for size in "${SIZES[@]}"; do
  layers="${size%x*}" hidden="${size#*x}"
  cfg="$WORK/c-$size.json"
  cat >"$cfg" <<JSON
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": $GAS,
 "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
 "zero_optimization": {"stage": 3,
   "offload_optimizer": {"device": "nvme", "nvme_path": "$DIR"},
   "offload_param": {"device": "nvme", "nvme_path": "$DIR"},
   "sub_group_size": $SUB_GROUP, "stage3_max_live_parameters": 1e8},
 "strata": {"device": "$DEVICE", "hbm_budget": "$HBM", "pinned_budget": "$PINNED",
   "grad_tier": "$GRAD_TIER", "optimizer_states": "$STATES",
   "model": {"layers": $layers, "hidden": $hidden, "seq_len": 16}}}
JSON
  if ! /usr/bin/time -f "%M" -o "$WORK/rss" "$STRATA" train --config "$cfg" --steps "$STEPS" --json \
      >"$WORK/out.json" 2>"$WORK/err"; then
    echo "infinity_memory: $size failed: $(tail -1 "$WORK/err")" >&2
    continue
  fi
  "$PY" - "$size" "$WORK/out.json" "$WORK/rss" <<'PY'
import json, re, statistics, sys
size, out, rss_file = sys.argv[1:]
j = json.load(open(out))
rss = int(open(rss_file).read().split()[-1]) * 1024  # KiB
per = j["per_step"][1:] or j["per_step"]
step = statistics.median(p["step_time_s"] for p in per)
# Bytes per step: the median over the steps after the first (the first
# reads no optimizer states: they were initialized in place).
read = statistics.median(p["nvme_read_bytes"] for p in per)
written = statistics.median(p["nvme_written_bytes"] for p in per)
rr, wr = j.get("nvme_read_gbytes_per_s", 0), j.get("nvme_write_gbytes_per_s", 0)
bound = read / (rr * 1e9) + written / (wr * 1e9) if rr > 0 and wr > 0 else float("nan")
need = {b["tier"]: b["needed_bytes"] for b in j["budgets"]}
# The optimizer pipeline's unit: whole sub-groups, or pieces of N elements.
cut = [re.search(r"in pieces of (\d+)", b["detail"]) for b in j["budgets"] if b["tier"] == "pinned"]
piece = cut[0].group(1) if cut and cut[0] else "whole"
# pinned + dram (+ the host device's "HBM", host memory as well): strata train's figure.
planned = j.get("planned_host_bytes") or float("nan")
g = lambda b: f"{b / 2**30:.2f}G"
print(f"{size:<9} {j['parameters']:>12} {g(j['state_bytes']):>9} {g(rss):>9} "
      f"{rss / j['parameters']:>8.1f} {g(need.get('pinned', 0)):>9} {g(need.get('dram', 0)):>9} "
      f"{g(planned):>9} {rss / planned:>8.2f} "
      f"{step:>7.2f}s {g(read):>9} {g(written):>9} {f'{rr:.2f}/{wr:.2f}':>11} {step / bound:>10.2f} "
      f"{piece:>10}")
PY
done
