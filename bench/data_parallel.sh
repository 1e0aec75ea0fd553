#!/usr/bin/env bash
# Data parallelism on one machine: the example model trained by one rank
# accumulating 2 micro-batches a step against 2 ranks (strata train
# --nproc-per-node 2) of one micro-batch each: the same global batch, so the
# same losses; the 2 ranks once with zero_optimization.overlap_comm false
# (the reduction after backward) and once true (during the last
# micro-batch's backward). Runs are interleaved; per run the median over
# steps 2.. of the step time, the time waited for collectives (comm_s), their
# busy time on the collectives' stream (comm_busy_s, device events), the
# share of the reduced bytes issued during backward, the CPU optimizer's
# blocking time, tokens/s, the plan's DRAM bytes of one rank (optimizer
# states and accumulator), the time of the checkpoint saved after the last
# step (one rank: states.bin; two: a states file per rank), the final loss
# and whether every step's loss is the same bits as one rank's.
#
#   bench/data_parallel.sh [-s STRATA] [-n RUNS] [-t STEPS] [-D DEVICE] [-3 | -H | -V] [LAYERSxHIDDEN]
#
# Default: 6x512 (13.1M parameters), micro-batch 4 x 64 tokens, bf16, stage 2,
# offload_optimizer cpu, clipping 1.0, 3 runs of 8 steps, the host device.
# -3: stage 3 with offload_param cpu (two ranks partition the parameters);
# the table then also gives each rank's host parameter copies (plan) and the
# parameter bytes it received by all-gather per step, and a fourth run of
# two ranks gathers each module only when it is fetched
# (stage3_prefetch_bucket_size 0: nothing gathered ahead), and a fifth, with
# -3 only, runs the step inline (strata.overlap_optimizer false; the others
# run it beside the next forward pass). The column "fetch wait s" is the time
# the hooks waited for parameters (fetch_wait_s), "opt wait s" the time they
# waited for the step in flight to reach a module (optimizer_wait_s).
# -H: as -3 with offload_param none: each rank's part of the parameters in
# HBM (the column params/rank is the plan's HBM row for them), the modules
# gathered within device memory.
# -V: as -3 with offload_optimizer and offload_param nvme (a directory under
# the run's temporary one): each rank's NVMe holds its pieces of the modules
# (params/rank: the plan's NVMe row, two versions).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STRATA="$ROOT/build/apps/strata/strata"
RUNS=3
STEPS=8
DEVICE=host
ZERO='"stage": 2, "offload_optimizer": {"device": "cpu"}'
while getopts "s:n:t:D:3HV" o; do
  case "$o" in
    s) STRATA="$OPTARG" ;;
    n) RUNS="$OPTARG" ;;
    t) STEPS="$OPTARG" ;;
    D) DEVICE="$OPTARG" ;;
    3) ZERO='"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}' ;;
    H) ZERO='"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}' ;;
    V) ZERO='"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "@NVME@"}, "offload_param": {"device": "nvme", "nvme_path": "@NVME@"}' ;;
    *) echo "usage: $0 [-s STRATA] [-n RUNS] [-t STEPS] [-D DEVICE] [-3 | -H | -V] [LAYERSxHIDDEN]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
SIZE="${1:-6x512}"
layers="${SIZE%x*}" hidden="${SIZE#*x}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/nvme"
ZERO="${ZERO//@NVME@/$WORK/nvme}"
STAGE3=0
[[ "$ZERO" == *'"stage": 3'* ]] && STAGE3=1
config() {  # NAME GAS RANKS OVERLAP_COMM [MORE zero_optimization KEYS] [MORE strata KEYS]
  cat >"$WORK/$1.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": $2,
 "train_batch_size": $((4 * $2 * $3)), "bf16": {"enabled": true}, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "zero_optimization": {$ZERO, "overlap_comm": $4,
   "reduce_bucket_size": 262144${5:+, $5}},
 "strata": {"device": "$DEVICE", "hbm_budget": "1G",${6:+ $6,}
   "model": {"layers": $layers, "hidden": $hidden, "seq_len": 64, "vocab": 256}}}
JSON
}
config one 2 1 false
config two 1 2 false
config ovl 1 2 true
NAMES="two ovl"
if [ "$STAGE3" = 1 ]; then
  config dem 1 2 false '"stage3_prefetch_bucket_size": 0'
  NAMES="two ovl dem"
  if [[ "$ZERO" == *'"offload_param": {"device": "cpu"}'* ]]; then
    config inl 1 2 false "" '"overlap_optimizer": false'
    NAMES="two ovl dem inl"
  fi
fi
for i in $(seq "$RUNS"); do
  "$STRATA" train --config "$WORK/one.json" --steps "$STEPS" --json \
    --checkpoint-dir "$WORK/ckpt-one-$i" 2>/dev/null >"$WORK/one-$i.out"
  for name in $NAMES; do
    "$STRATA" train --config "$WORK/$name.json" --steps "$STEPS" --json --nproc-per-node 2 \
      --checkpoint-dir "$WORK/ckpt-$name-$i" 2>/dev/null >"$WORK/$name-$i.out"
  done
  rm -rf "$WORK"/ckpt-*
done
/usr/bin/python3 - "$WORK" "$RUNS" $NAMES <<'PY'
import json, re, statistics as st, sys
work, runs, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print(f"{'ranks':>5} {'overlap':>7} {'ahead':>5} {'step':>6} {'run':>3} {'step s':>8} {'comm s':>8} "
      f"{'busy s':>7} {'fetch wait s':>12} {'opt wait s':>10} {'ovl %':>6} "
      f"{'opt s':>8} {'tok/s':>8} {'dram/rank':>10} {'params/rank':>11} {'gathered':>9} "
      f"{'save s':>7} {'final loss':>18} {'same losses':>11}")
# The step runs beside the next forward pass with one rank, and with two at
# stage 3 with offload_param cpu (strata.overlap_optimizer, the default).
one_cfg = open(f"{work}/one.json").read()
stage3_cpu = '"stage": 3' in one_cfg and '"offload_param": {"device": "cpu"}' in one_cfg
for i in range(1, runs + 1):
    one = json.load(open(f"{work}/one-{i}.out"))
    for name in ["one"] + names:
        ranks = 1 if name == "one" else 2
        j = json.load(open(f"{work}/{name}-{i}.out"))
        per = j["per_step"][1:] or j["per_step"]
        med = lambda k: st.median(p.get(k, 0) for p in per)
        red = sum(p.get("comm_reduced_bytes", 0) for p in per)
        ovl = 100 * sum(p.get("comm_overlapped_bytes", 0) for p in per) / red if red else 0
        dram = sum(b["needed_bytes"] for b in j["budgets"] if b["tier"] == "dram")
        # The host parameter copies as the plan names them ("... copies 2 x
        # 12.63 MiB", "updated parameters 25.05 MiB", "parameters ...").
        # With offload_param none: the HBM row's "parameters [(this rank's
        # part of N)] 12.63 MiB".
        copies = "-"
        text = open(f"{work}/{name}.json").read()
        tiers = (("hbm",) if '"offload_param": {"device": "none"}' in text
                 else ("nvme",) if '"offload_param": {"device": "nvme"' in text
                 else ("pinned", "dram"))
        for b in j["budgets"]:
            m = re.search(r"(parameter copies 2 x|updated parameters|parameters 2 x|parameters"
                          r"(?: \(this rank's part of \d+\))?) ([0-9.]+ [KMG]iB)", b["detail"])
            if m and b["tier"] in tiers:
                copies = ("2x" if "2 x" in m.group(1) else "") + m.group(2).replace(" ", "")
                break
        gathered = med("comm_gathered_bytes") / 1e6
        same = j["losses"] == one["losses"]
        step = "inline" if name == "inl" or (ranks == 2 and not stage3_cpu) else "beside"
        print(f"{ranks:>5} {str(name == 'ovl'):>7} {str(name != 'dem'):>5} {step:>6} {i:>3} "
              f"{med('step_time_s'):>8.3f} {med('comm_s'):>8.3f} {med('comm_busy_s'):>7.3f} "
              f"{med('fetch_wait_s'):>12.3f} {med('optimizer_wait_s'):>10.3f} "
              f"{ovl:>5.0f}% {med('optimizer_wall_s'):>8.3f} "
              f"{j['tokens_per_s']:>8.0f} {dram / 2**20:>8.1f}Mi {copies:>11} {gathered:>7.1f}MB "
              f"{j['checkpoint']['save_s'][-1]:>7.3f} {j['losses'][-1]:>18.15f} {str(same):>11}")
PY
