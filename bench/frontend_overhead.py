#!/usr/bin/env python3
"""The PyTorch frontend's overhead: the Llama-style model of
examples/torch/train_llama.py trained by plain PyTorch and through Strata, on
the host device, interleaved.

    PYTHONPATH=build/python /usr/bin/python3 bench/frontend_overhead.py \
        [--reps 7] [--steps 4] [--hidden 256] [--layers 4] [--seq 128] [--micro-batch 4] \
        [--threads N] [--nvme-path /tmp/strata-bench-nvme] [--profile cpu/none]

Sides (same model, same initial weights, same data, fp32 everywhere):
  torch     fp32 parameters, torch.optim.AdamW, clip_grad_norm_ 1.0
  cpu/none  Strata, offload_optimizer cpu, offload_param none (host device)
  cpu/nvme  Strata, offload_optimizer cpu, offload_param nvme
fp32 on both sides because the host device's compute is torch's CPU kernels
and torch 1.13 has no fast bf16 matmul there: a bf16 Strata run against an
fp32 torch run would measure the kernels, not the frontend.

Each repetition runs --steps optimizer steps (one micro-batch each) on every
side in turn (torch, cpu/none, cpu/nvme, torch, ...), timed from the first
forward to the end of the last step (engine.synchronize(): the optimizer
step in flight included). Prints each repetition, then per side the median
tokens/s, the ratio to torch's median and the engine's median time per step
in fetch wait, gradient offload and the optimizer (torch: its clip and
AdamW step, which are inside its step; Strata's optimizer runs on its own
thread, overlapped with the next step's forward). The torch side's step
less its optimizer (forward and backward alone) is the model's compute:
Strata's step time over it is what the frontend and the engine add beyond
it on the critical path. --profile SIDE runs that
side once more under cProfile and prints where the Python time goes.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
import train_llama  # noqa: E402  (the model and the token stream)

import strata  # noqa: E402
from strata import _group, _hooks  # noqa: E402  (the functions --breakdown times)

TORCH_DIR = os.path.dirname(torch.__file__)
STRATA_DIR = os.path.dirname(os.path.abspath(strata.__file__))
ENGINE_TIMES = ("fetch_wait_s", "grad_offload_s", "optimizer_s")


def config(opt, par, nvme_path, threads):
    zero = {"stage": 3,
            "offload_optimizer": {"device": opt},
            "offload_param": {"device": par}}
    for key, dev in (("offload_optimizer", opt), ("offload_param", par)):
        if dev == "nvme":
            zero[key]["nvme_path"] = nvme_path
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.1}},
        "bf16": {"enabled": False},
        "zero_optimization": zero,
        "strata": {"device": "host", **({} if threads is None else {"threads": threads})},
    }


class TorchSide:
    name = "torch"

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.1)

    def step(self, idx, tgt):
        loss = self.model(idx, tgt)
        loss.backward()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"optimizer_s": time.perf_counter() - t0}  # in the step, not overlapped

    def finish(self):
        pass


class StrataSide:

    def __init__(self, model, placement, args):
        self.name = placement
        opt, par = placement.split("/")
        cfg = config(opt, par, args.nvme_path,
                     args.threads if args.strata_threads is None else args.strata_threads)
        self.engine = strata.initialize(model, cfg,
                                        auto_values={"train_micro_batch_size_per_gpu":
                                                     args.micro_batch})

    def step(self, idx, tgt):
        loss = self.engine(idx, tgt)
        self.engine.backward(loss)
        return self.engine.step()

    def finish(self):
        self.engine.synchronize()


def run(side, data, first, steps, mb, seq):
    """(seconds, summed engine times) of `steps` steps from micro-batch `first`."""
    batches = [data.batch(first + s, mb, seq) for s in range(steps)]
    busy = dict.fromkeys(ENGINE_TIMES, 0.0)
    t0 = time.perf_counter()
    for idx, tgt in batches:
        st = side.step(idx, tgt)
        for k in ENGINE_TIMES:
            busy[k] += st.get(k, 0.0)
    side.finish()
    return time.perf_counter() - t0, busy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads and strata.threads, for every side (default: "
                    "both at their defaults: torch's threads, and strata.threads left out)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads alone, overriding --threads for torch")
    ap.add_argument("--strata-threads", type=int, default=None,
                    help="strata.threads alone (0: every PU), overriding --threads for Strata")
    ap.add_argument("--placements", default="cpu/none,cpu/nvme",
                    help="Strata's offload_optimizer/offload_param pairs, comma-separated")
    ap.add_argument("--nvme-path", default="/tmp/strata-bench-nvme")
    ap.add_argument("--profile", default=None, help="a side to run once more under cProfile")
    ap.add_argument("--breakdown", action="store_true",
                    help="run each Strata side once more with timers on the engine calls and "
                    "the frontend's methods, and print where its step goes")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = ap.parse_args()

    if args.threads is not None or args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads if args.torch_threads is not None else
                              args.threads)
    os.makedirs(args.nvme_path, exist_ok=True)

    def model():
        torch.manual_seed(1)
        return train_llama.Llama(args.vocab, args.hidden, args.layers, args.heads)

    sides = [TorchSide(model())]
    sides += [StrataSide(model(), p, args) for p in args.placements.split(",") if p]
    n_params = sum(p.numel() for p in model().parameters())
    data = train_llama.TokenStream(args.vocab, 5)
    tokens = args.steps * args.micro_batch * args.seq
    print(f"frontend_overhead: {n_params / 1e6:.2f}M parameters, hidden {args.hidden}, "
          f"{args.layers} layers, seq {args.seq}, micro-batch {args.micro_batch}, fp32, "
          f"{'default' if args.threads is None else args.threads} threads (torch "
          f"{torch.get_num_threads()}), {args.steps} steps x {args.reps} repetitions", flush=True)
    for side in sides:
        run(side, data, 0, args.warmup, args.micro_batch, args.seq)

    times = {s.name: [] for s in sides}
    busy = {s.name: [] for s in sides}
    position = args.warmup
    for rep in range(args.reps):
        line = []
        for side in sides:  # interleaved: every side once per repetition
            dt, b = run(side, data, position, args.steps, args.micro_batch, args.seq)
            times[side.name].append(dt)
            busy[side.name].append(b)
            line.append(f"{side.name} {tokens / dt:7.0f} tok/s")
        position += args.steps
        print(f"rep {rep + 1}: " + "  ".join(line), flush=True)

    base = tokens / statistics.median(times["torch"])
    summary = {}
    print(f"{'side':10s} {'tok/s':>8s} {'ratio':>6s} {'step ms':>8s} "
          + " ".join(f"{k[:-2] + ' ms':>16s}" for k in ENGINE_TIMES))
    for side in sides:
        tps = tokens / statistics.median(times[side.name])
        per_step = {k: 1e3 * statistics.median(b[k] for b in busy[side.name]) / args.steps
                    for k in ENGINE_TIMES}
        step_ms = 1e3 * statistics.median(times[side.name]) / args.steps
        summary[side.name] = {"tokens_per_s": tps, "ratio": tps / base, "step_ms": step_ms,
                              **per_step}
        cols = " ".join(f"{per_step[k]:16.1f}" if side.name != "torch" or k == "optimizer_s"
                        else f"{'-':>16s}" for k in ENGINE_TIMES)
        print(f"{side.name:10s} {tps:8.0f} {tps / base:6.2f} {step_ms:8.1f} {cols}")
    # Against torch's forward and backward alone (its step less its optimizer):
    # what Strata's step costs beyond the model's compute.
    compute = statistics.median(
        t - b["optimizer_s"] for t, b in zip(times["torch"], busy["torch"])) / args.steps
    print(f"torch forward+backward alone: {1e3 * compute:.1f} ms/step; Strata's step over it: "
          + ", ".join(f"{s.name} {summary[s.name]['step_ms'] / (1e3 * compute):.2f}x"
                      for s in sides[1:]))
    summary["torch"]["forward_backward_ms"] = 1e3 * compute

    if args.breakdown:
        for side in sides[1:]:
            print(f"where a {side.name} step goes ({args.steps} steps, ms per step):")
            parts = breakdown(side, data, position, args)
            for what, seconds in parts.items():
                print(f"  {what:58s} {1e3 * seconds / args.steps:8.2f}")
            summary[side.name]["breakdown_ms_per_step"] = {
                k: 1e3 * v / args.steps for k, v in parts.items()}
            position += args.steps
    if args.json:
        print(json.dumps(summary))

    if args.profile:
        side = next(s for s in sides if s.name == args.profile)
        prof = cProfile.Profile()
        prof.enable()
        run(side, data, position, args.steps, args.micro_batch, args.seq)
        prof.disable()
        stats = pstats.Stats(prof)
        print(f"cProfile of {args.profile}, {args.steps} steps (profiled: slower than timed):")
        for what, seconds in profile_breakdown(stats).items():
            print(f"  {what:58s} {1e3 * seconds / args.steps:8.1f} ms/step")
        stats.sort_stats("tottime").print_stats(20)
    return 0


class _TimedEngine:
    """The _strata.Engine of an Engine, every method call timed by name."""

    def __init__(self, target, acc, counts):
        self._target = target
        self._acc = acc
        self._counts = counts

    def __getattr__(self, name):
        f = getattr(self._target, name)
        if not callable(f):
            return f

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self._acc[name] = self._acc.get(name, 0.0) + time.perf_counter() - t0
                self._counts[name] = self._counts.get(name, 0) + 1

        return timed


# The frontend's own work around the model: fetching and mapping views
# (_Group.hold, release), handing gradients over (_Group.hand_over), the
# backward wrappers (_hooks._wrap), the saved-tensor hooks (the Engine's
# _pack, _unpack). As (where, attribute): a class, a module or "engine" (the
# Engine instance whose side runs).
FRONTEND_FUNCTIONS = ((_group._Group, "hold"), (_group._Group, "release"),
                      (_group._Group, "hand_over"), (_hooks, "_wrap"),
                      ("engine", "_pack"), ("engine", "_unpack"))


def breakdown(side, data, first, args):
    """Seconds over args.steps steps: wall, each engine call, and the
    frontend's functions less the engine calls inside them. Timers replace
    the class's, the module's and the instance's attributes for the run and
    the originals go back after it (one perf_counter pair per call: ~1 us
    each)."""
    engine = side.engine
    calls = {}
    counts = {}
    outer = {"frontend": 0.0, "engine_inside": 0.0}
    depth = [0]
    real = engine._engine
    engine._engine = _TimedEngine(real, calls, counts)

    def timed_version(f):
        # A plain function: as a class attribute it binds like the original
        # (self comes first), as a module or instance attribute it does not.
        def timed(*a, **k):
            if depth[0]:
                return f(*a, **k)
            depth[0] += 1
            before = sum(calls.values())
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                outer["frontend"] += time.perf_counter() - t0
                outer["engine_inside"] += sum(calls.values()) - before
                depth[0] -= 1

        return timed

    # The attributes as stored (vars(): the plain function of a class, the
    # bound method an Engine keeps in its __dict__), put back as they were.
    originals = []
    try:
        for where, name in FRONTEND_FUNCTIONS:
            owner = engine if where == "engine" else where
            original = vars(owner)[name]
            originals.append((owner, name, original))
            setattr(owner, name, timed_version(original))
        wall, _ = run(side, data, first, args.steps, args.micro_batch, args.seq)
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
        engine._engine = real
    out = {"wall": wall}
    for name in sorted(calls):
        out[f"engine.{name} ({counts[name] / args.steps:.0f} calls)"] = calls[name]
    out["frontend Python and torch ops (views, copies, hooks)"] = (outer["frontend"] -
                                                                  outer["engine_inside"])
    out["everything else (model forward/backward, autograd, data)"] = (
        wall - sum(calls.values()) - out["frontend Python and torch ops (views, copies, hooks)"])
    return out


def profile_breakdown(stats):
    """Exclusive time by where it is spent: the frontend's Python (every .py
    file of the strata package), the engine calls it makes (the _strata
    extension), torch calls made directly by the frontend (views, copies,
    placeholders), the rest (the model's forward, autograd, the data)."""
    out = {"engine calls (_strata: fetch, hand-over, step)": 0.0,
           "frontend Python (strata/*.py)": 0.0,
           "torch ops called by the frontend (copy_, from_dlpack, ...)": 0.0,
           "the rest (model forward and backward, data)": 0.0}
    keys = list(out)

    def frontend(func):
        path = os.path.abspath(func[0])
        return path.endswith(".py") and path.startswith(STRATA_DIR + os.sep)

    for func, (_, _, tt, _, callers) in stats.stats.items():
        if "_strata." in func[2]:
            out[keys[0]] += tt
        elif frontend(func):
            out[keys[1]] += tt
        elif func[0] == "~" or func[0].startswith(TORCH_DIR):
            from_frontend = sum(c[2] for caller, c in callers.items() if frontend(caller))
            out[keys[2]] += from_frontend
            out[keys[3]] += tt - from_frontend
        else:
            out[keys[3]] += tt
    return out


if __name__ == "__main__":
    sys.exit(main())
