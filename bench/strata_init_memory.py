#!/usr/bin/python3
"""Peak host memory of building a model and handing it to Strata, with and
without strata.init (docs/perf.md, "strata.init: host memory while building").

Each variant runs in a fresh subprocess (ru_maxrss is a process's peak):
  plain  model = Model(); strata.initialize(model, config)
  init   with strata.init(config): model = Model(); strata.initialize(model, config)
and reports the peak RSS after importing torch and strata, after building,
and after initialize, and the fp32 parameter bytes (--repeat N: the
medians of N interleaved runs of each). The model: `layers`
blocks of Linear(d, 4d), Linear(4d, d), LayerNorm(d) (about 8·d² parameters
each). The config puts optimizer states and parameters on NVMe under
--nvme-dir (bf16 training copies, host device).

    /usr/bin/python3 bench/strata_init_memory.py --layers 24 --d 1280 --nvme-dir /tmp/x
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(args):
    import torch

    import strata

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = torch.nn.Linear(d, 4 * d)
            self.proj = torch.nn.Linear(4 * d, d)
            self.ln = torch.nn.LayerNorm(d)

        def forward(self, x):
            return x + self.proj(torch.relu(self.fc(self.ln(x))))

    class Model(torch.nn.Module):
        def __init__(self, layers, d):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_dir},
            "offload_param": {"device": "nvme", "nvme_path": args.nvme_dir},
            "sub_group_size": 20_000_000,
            "stage3_prefetch_bucket_size": 10_000_000,
            "stage3_max_live_parameters": 100_000_000,
        },
        "strata": {"device": "host", "hbm_budget": "1G", "threads": 2},
    }
    out = {"variant": args.child, "after_import": peak_bytes()}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.child == "init":
        with strata.init(cfg):
            model = Model(args.layers, args.d)
    else:
        model = Model(args.layers, args.d)
    out["build_s"] = time.perf_counter() - t0
    out["after_build"] = peak_bytes()
    out["param_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    t0 = time.perf_counter()
    engine = strata.initialize(model, cfg)
    out["initialize_s"] = time.perf_counter() - t0
    out["after_initialize"] = peak_bytes()
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=1280)
    ap.add_argument("--nvme-dir", default=None, help="spill and swap directory (default: a "
                    "temporary directory)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each variant, interleaved; figures are medians")
    ap.add_argument("--child", choices=["plain", "init"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    tmp = None
    if args.nvme_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="strata-init-bench-")
        args.nvme_dir = tmp.name
    runs = {"plain": [], "init": []}
    for _ in range(args.repeat):  # interleaved
        for variant in runs:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--layers",
                   str(args.layers), "--d", str(args.d), "--nvme-dir", args.nvme_dir]
            run = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            runs[variant].append(json.loads(run.stdout.strip().splitlines()[-1]))
    # The median of each figure over the runs.
    results = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "variant"}
               for v, rs in runs.items()}
    gib = 1 << 30
    params = results["plain"]["param_bytes"]
    print(f"model: {args.layers} layers x d={args.d}: {params // 4 / 1e6:.0f}M parameters, "
          f"{params / gib:.2f} GiB fp32; medians of {args.repeat} run(s) each")
    print(f"{'variant':8} {'import':>9} {'build':>9} {'build+init':>11} {'build s':>8} "
          f"{'init s':>7}   (peak RSS, GiB)")
    for v, r in results.items():
        print(f"{v:8} {r['after_import'] / gib:9.2f} {r['after_build'] / gib:9.2f} "
              f"{r['after_initialize'] / gib:11.2f} {r['build_s']:8.1f} {r['initialize_s']:7.1f}")
    p, i = results["plain"], results["init"]
    print(f"ratio init/plain: build {i['after_build'] / p['after_build']:.3f}, "
          f"build+initialize {i['after_initialize'] / p['after_initialize']:.3f}; "
          f"build peak above import: plain {(p['after_build'] - p['after_import']) / params:.2f}"
          f" x the parameter bytes, init "
          f"{(i['after_build'] - i['after_import']) / params:.3f} x")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
