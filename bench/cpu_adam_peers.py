#!/usr/bin/python3
"""Strata's CPU AdamW beside its peers on the same machine: DeepSpeed's
cpu_adam (fp32 states, built unmodified from a DeepSpeed checkout with the
flags DeepSpeed's op builder uses) and torch.optim.AdamW (the for-loop and
`foreach` implementations, and `fused` where the CPU build has it).

The peers step the same fp32 arrays in this process, their order rotated
every repetition; `strata bench adam` (fp32, bf16 and int8 states) runs as
a separate process between the repetitions, so that every round sees the
same machine. Medians of the rounds are printed, as Mparams/s and as a
ratio to DeepSpeed's cpu_adam measured in the same round.

    /usr/bin/python3 bench/cpu_adam_peers.py --deepspeed-src DIR \\
        --strata build/apps/strata/strata --params 1e8 --threads 2 --rounds 5

Debian's python3-torch and libtorch-dev (torch's C++ headers) are needed;
DeepSpeed itself is not installed: only its csrc/ is compiled.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed-src", required=True,
                   help="a DeepSpeed checkout (its csrc/adam and csrc/includes are compiled)")
    p.add_argument("--strata", required=True, help="the strata command (build/apps/strata/strata)")
    p.add_argument("--params", type=float, default=1e8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (median)")
    p.add_argument("--tensors", type=int, default=64,
                   help="views the flat arrays are split into for torch's optimizers")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args()


def debian_torch_includes(torch):
    """Debian ships torch's C++ headers in libtorch-dev, under /usr/include,
    not in the Python package's include/ that cpp_extension names."""
    pkg = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "extension.h")
    if os.path.isfile(pkg):
        return []
    if not os.path.isfile("/usr/include/torch/extension.h"):
        sys.exit("cpu_adam_peers: torch/extension.h not found: install libtorch-dev (Debian) "
                 "or a torch with its C++ headers")
    return ["/usr/include/torch/csrc/api/include"]


def main():
    args = parse_args()
    n = int(args.params)
    # OpenMP (DeepSpeed) and torch's intra-op pool read these at start-up.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    from torch.utils import cpp_extension
    torch.set_num_threads(args.threads)

    flags = open("/proc/cpuinfo").read()
    simd = "-D__AVX512__" if " avx512f" in flags else ("-D__AVX256__" if " avx2" in flags else "-D__SCALAR__")
    src = os.path.abspath(args.deepspeed_src)
    for f in ("csrc/adam/cpu_adam.cpp", "csrc/adam/cpu_adam_impl.cpp", "csrc/includes/cpu_adam.h"):
        if not os.path.isfile(os.path.join(src, f)):
            sys.exit(f"cpu_adam_peers: {os.path.join(src, f)}: not found (--deepspeed-src must be a DeepSpeed checkout)")
    build = tempfile.mkdtemp(prefix="ds_cpu_adam.")
    ds = cpp_extension.load(
        name="ds_cpu_adam_op",
        sources=[os.path.join(src, "csrc/adam/cpu_adam.cpp"), os.path.join(src, "csrc/adam/cpu_adam_impl.cpp")],
        extra_include_paths=[os.path.join(src, "csrc/includes")] + debian_torch_includes(torch),
        # op_builder/builder.py's TorchCPUOpBuilder flags for a CPU build.
        extra_cflags=["-O3", "-std=c++17", "-g", "-Wno-reorder", "-march=native", "-fopenmp", simd,
                      "-D__DISABLE_CUDA__"],
        extra_ldflags=["-fopenmp"],
        build_directory=build, verbose=False)

    lr, beta1, beta2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    g = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-5
    ds.create_adam(0, lr, beta1, beta2, eps, wd, True, False)

    views = list(p.chunk(args.tensors))
    params = [torch.nn.Parameter(x, requires_grad=True) for x in views]
    for q, gv in zip(params, grad.chunk(args.tensors)):
        q.grad = gv
    variants = {}

    def ds_step(step):
        ds.adam_update(0, step, lr, beta1, beta2, eps, wd, True, p, grad, m, v)
    variants["deepspeed cpu_adam"] = ds_step

    def torch_variant(**kw):
        opt = torch.optim.AdamW(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, **kw)
        # Fill the states first: the first step allocates them.
        opt.step()
        return lambda step: opt.step()
    variants["torch AdamW (for-loop)"] = torch_variant(foreach=False)
    variants["torch AdamW (foreach)"] = torch_variant(foreach=True)
    fused_note = None
    try:
        variants["torch AdamW (fused)"] = torch_variant(fused=True)
    except (TypeError, RuntimeError) as e:
        fused_note = f"torch {torch.__version__}: fused AdamW not available on CPU ({str(e).splitlines()[0]})"

    rates = {k: [] for k in variants}
    ratios = {k: [] for k in variants}
    strata_rates = {}
    strata_ratios = {}
    names = list(variants)
    step = 1
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this = {}
        for k in order:
            times = []
            for _ in range(args.steps):
                step += 1
                t0 = time.perf_counter()
                variants[k](step)
                times.append(time.perf_counter() - t0)
            this[k] = n / statistics.median(times) / 1e6
            rates[k].append(this[k])
        base = this["deepspeed cpu_adam"]
        for k in names:
            ratios[k].append(this[k] / base)
        out = subprocess.run([args.strata, "bench", "adam", "--params", str(n), "--threads", str(args.threads),
                              "--optimizer", "adamw", "--states", "fp32,bf16,int8", "--reps", "5", "--json"],
                             check=True, capture_output=True, text=True).stdout
        for f in json.loads(out)["formats"]:
            key = f"strata ({f['states']} states)"
            strata_rates.setdefault(key, []).append(f["params_per_s"] / 1e6)
            strata_ratios.setdefault(key, []).append(f["params_per_s"] / 1e6 / base)

    rows = [(k, statistics.median(rates[k]), statistics.median(ratios[k])) for k in names]
    rows += [(k, statistics.median(strata_rates[k]), statistics.median(strata_ratios[k])) for k in strata_rates]
    if args.json:
        print(json.dumps({"params": n, "threads": args.threads, "rounds": args.rounds, "simd": simd,
                          "torch": torch.__version__, "fused_note": fused_note,
                          "rows": [{"name": k, "mparams_per_s": a, "vs_deepspeed": b} for k, a, b in rows]}, indent=1))
        return
    print(f"cpu_adam_peers: AdamW, {n} params, {args.threads} threads, DeepSpeed built with {simd}, "
          f"torch {torch.__version__}, {args.rounds} rounds (medians; ratio to DeepSpeed in the same round)")
    print(f"  {'optimizer':32s} {'Mparams/s':>10s} {'vs DeepSpeed':>13s}")
    for k, a, b in rows:
        print(f"  {k:32s} {a:10.1f} {b:13.2f}")
    if fused_note:
        print(f"  ({fused_note})")


if __name__ == "__main__":
    main()
