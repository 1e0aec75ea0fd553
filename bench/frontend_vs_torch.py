#!/usr/bin/env python3
"""Tokens/s of the PyTorch frontend against plain PyTorch in HBM, in one process.

    PYTHONPATH=<package dir> python3 bench/frontend_vs_torch.py [--size 1b|tiny] \
        [--device cuda|host] [--steps N] [--warmup N] [--placements none/none,cpu/none,cpu/cpu] \
        [--micro-batch B] [--seq S] [--trace-dir DIR] [--json]

The model is examples/torch/train_llama.py's Llama (RMSNorm, rotary
attention, SwiGLU, a head tied to the embedding). `--size 1b`: 16 layers,
hidden 2048, 16 heads, SwiGLU 5632, vocab 32000 (0.9B parameters), sequence
2048; `tiny` is for the host device (the script's own test).

Rows, each timed over `--steps` optimizer steps after `--warmup`, the median
step quoted, one micro-batch a step (gradient_accumulation_steps 1, so that
the CPU step during backward can hide behind the whole backward pass):
  - torch: the model in fp32 on the device, forward and backward under
    torch.autocast(bfloat16), torch.optim.AdamW(fused=True) where the device
    is CUDA (foreach otherwise), gradient clipping 1.0;
  - strata none/none, cpu/none, cpu/cpu: strata.initialize with bf16, the
    same AdamW hyper-parameters and clipping, strata.speculative_step on
    (the CPU step during backward; applies where the optimizer is on the CPU).
Each row prints tokens/s and its ratio to torch's (measured in this run), and
with --trace-dir the Strata rows write their step timeline
(strata.trace_path) there. The last line is the JSON of every row.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

import strata

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = importlib.util.spec_from_file_location(
    "train_llama", os.path.join(HERE, "..", "examples", "torch", "train_llama.py"))
train_llama = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(train_llama)

SIZES = {
    # layers, hidden, heads, ffn, vocab, seq
    "1b": (16, 2048, 16, 5632, 32000, 2048),
    "tiny": (2, 64, 4, 176, 96, 32),
}
LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--device", choices=["cuda", "host"], default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="default: the size's")
    ap.add_argument("--placements", default="none/none,cpu/none,cpu/cpu")
    ap.add_argument("--hbm-budget", default="0", help="strata.hbm_budget (0: the free memory)")
    ap.add_argument("--threads", type=int, default=0, help="strata.threads (0: every core)")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    return ap.parse_args(argv)


def build(args):
    layers, hidden, heads, ffn, vocab, seq = SIZES[args.size]
    torch.manual_seed(1234)
    model = train_llama.Llama(vocab, hidden, layers, heads, ffn)
    return model, vocab, args.seq or seq


def batch(vocab, n, mb, seq, device):
    g = torch.Generator().manual_seed(n)
    idx = torch.randint(0, vocab, (mb, seq + 1), generator=g)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_torch(args, vocab, seq, device):
    model, _, _ = build(args)
    model = model.to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            **fused)
    times = []
    for step in range(args.warmup + args.steps):
        idx, tgt = batch(vocab, step, args.micro_batch, seq, device)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def strata_config(args, opt, par):
    zero = {"stage": 3, "offload_optimizer": {"device": opt}, "offload_param": {"device": par}}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WD}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "strata": {"device": args.device, "hbm_budget": args.hbm_budget,
                   "speculative_step": opt == "cpu"},
    }
    if args.threads > 0:
        cfg["strata"]["threads"] = args.threads
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        cfg["strata"]["trace_path"] = os.path.join(args.trace_dir, f"{opt}-{par}.json")
    return cfg


def time_strata(args, vocab, seq, opt, par):
    model, _, _ = build(args)
    engine = strata.initialize(model, strata_config(args, opt, par))
    device = engine.device
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        idx, tgt = batch(vocab, step, args.micro_batch, seq, device)
        engine.synchronize()
        t0 = time.perf_counter()
        loss = engine(idx, tgt)
        engine.backward(loss)
        stats = engine.step()
        assert stats["applied"]
        engine.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    name = engine.device_name
    engine.close()
    return times, losses, name


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA torch or no GPU (torch.cuda.is_available() is "
                                     "False)"}))
        return 0
    model, vocab, seq = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    tokens = args.micro_batch * seq
    rows = []

    def row(name, times, extra=None):
        med = statistics.median(times)
        r = {"row": name, "step_s": med, "tokens_per_s": tokens / med,
             "steps": len(times), **(extra or {})}
        if rows:
            r["vs_torch"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        rows.append(r)
        if not args.json:
            ratio = f"  {r['vs_torch']:.3f}x torch" if "vs_torch" in r else ""
            print(f"{name:>16}: step {med * 1e3:8.1f} ms  {r['tokens_per_s']:10.0f} tok/s{ratio}",
                  flush=True)

    if not args.json:
        print(f"llama {args.size}: {n_params / 1e6:.1f}M parameters, {args.micro_batch} x {seq} "
              f"tokens a step, device {device}", flush=True)
    row("torch", time_torch(args, vocab, seq, device),
        {"autocast": "bf16", "adamw": "fused" if device.type == "cuda" else "foreach"})
    for placement in args.placements.split(","):
        opt, par = placement.split("/")
        times, losses, name = time_strata(args, vocab, seq, opt, par)
        row(f"strata {placement}", times, {"device": name, "first_loss": losses[0],
                                            "last_loss": losses[-1]})
    print(json.dumps({"parameters": n_params, "tokens_per_step": tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
