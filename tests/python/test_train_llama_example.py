"""examples/torch/train_llama.py at a tiny size, on the host device.

The script's main() runs in this process (as its command line would): the
loss goes down, the learning rate follows the config's warmup schedule
(DeepSpeed's formula, computed here), a run saved at step k and resumed
with --resume gives bitwise the losses of an uninterrupted run, and in
fp32 its losses are those of plain PyTorch (torch.optim.AdamW with the same
no-decay parameter groups, clipping and schedule).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SPEC = importlib.util.spec_from_file_location(
    "train_llama", os.path.join(ROOT, "examples", "torch", "train_llama.py"))
train_llama = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(train_llama)

TINY = ["--device", "host", "--threads", "2", "--quiet", "--layers", "2", "--hidden", "32",
        "--heads", "2", "--vocab", "48", "--seq", "16", "--micro-batch", "3", "--grad-accum",
        "2", "--lr", "1e-2", "--warmup", "3", "--offload-optimizer", "cpu", "--offload-param",
        "cpu"]


def deepspeed_lr(schedule, n, lr, warmup, total, warmup_min_ratio=0.0, cos_min_ratio=1e-4):
    """The lr of optimizer step n >= 1 under DeepSpeed's WarmupCosineLR /
    WarmupDecayLR (linear warmup; warmup_min_lr 0, warmup_max_lr = lr)."""
    i = n - 2  # DeepSpeed's last_batch_iteration when step n runs
    w = max(2, warmup)
    if schedule == "cosine":
        if i < 0:
            return 0.0
        if i < w:
            return lr * (warmup_min_ratio + i / w * (1 - warmup_min_ratio))
        progress = min(1.0, (i - w + 1) / max(1, total - w))
        return lr * max(0.0, cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi *
                                                                                 progress)) / 2)
    if i < 0:
        return 0.0
    if i < w:
        return lr * i / w
    return lr * max(0.0, (total - i) / max(1, total - w))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_loss_decreases_and_lr_follows_the_schedule(schedule):
    steps = 12
    out = train_llama.main(TINY + ["--steps", str(steps), "--schedule", schedule])
    losses, lrs = out["losses"], out["lrs"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    for n, got in enumerate(lrs, start=1):
        assert got == pytest.approx(deepspeed_lr(schedule, n, 1e-2, 3, steps), rel=1e-9,
                                    abs=1e-15), (n, lrs)
    assert lrs[1] < lrs[2] < lrs[3] < lrs[4]  # warming up
    assert lrs[-1] < lrs[5]  # decaying


@pytest.mark.parametrize("dtype,ckpt", [("bf16", True), ("fp32", False)])
def test_save_then_resume_gives_the_uninterrupted_losses(dtype, ckpt, tmp_path):
    args = TINY + ["--steps", "7", "--dtype", dtype] + (["--grad-ckpt"] if ckpt else [])
    full = train_llama.main(args)
    first = train_llama.main(args + ["--save-dir", str(tmp_path), "--save-every", "2",
                                     "--stop-after", "3"])
    assert first["losses"] == full["losses"][:3]
    # Saved after steps 2 and 3 (the last); --resume takes the newest.
    assert len([d for d in os.listdir(tmp_path) if d.startswith("ckpt-")]) == 2
    rest = train_llama.main(args + ["--save-dir", str(tmp_path), "--resume"])
    assert rest["start_step"] == 3
    assert first["losses"] + rest["losses"] == full["losses"]  # bitwise
    assert first["lrs"] + rest["lrs"] == full["lrs"]
    assert rest["next_lr"] == full["next_lr"]


def test_param_groups_split_decay_from_no_decay():
    args = train_llama.parse_args(TINY)
    model = train_llama.build_model(args)
    decay, no_decay = train_llama.param_groups(model, 0.3)
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert model.lm_head.weight is model.embed_tokens.weight
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {
        "embed_tokens.weight", "norm.weight"} | {
            f"layers.{i}.{n}.weight" for i in range(2)
            for n in ("input_layernorm", "post_attention_layernorm")}
    assert all(p.dim() == 2 for p in decay["params"])


def reference_losses(args, groups_of, device="cpu"):
    """The run of `args` in plain PyTorch on `device`: AdamW over
    groups_of(model), the config's clipping, DeepSpeed's schedule as a
    per-step lr."""
    model = train_llama.build_model(args).to(device)
    opt = torch.optim.AdamW(groups_of(model), lr=args.lr, betas=tuple(args.betas), eps=args.eps)
    data = train_llama.TokenStream(args.vocab, args.data_seed)
    losses = []
    for step in range(args.steps):
        lr = deepspeed_lr("cosine", step + 1, args.lr, args.warmup, args.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        total = 0.0
        for k in range(args.grad_accum):
            idx, tgt = data.batch(step * args.grad_accum + k, args.micro_batch, args.seq)
            loss = model(idx.to(device), tgt.to(device))
            (loss / args.grad_accum).backward()
            total += loss.item() / args.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def test_fp32_matches_torch_adamw_with_the_same_param_groups():
    """Weight decay 0.5 at lr 1e-2 moves the norm weights by 0.5% a step: the
    no-decay group is visible in the losses (the reference that decays every
    parameter is measurably different), and Strata's match the one that
    does not decay it."""
    argv = TINY + ["--steps", "6", "--dtype", "fp32", "--weight-decay", "0.5"]
    args = train_llama.parse_args(argv)
    got = train_llama.main(argv)["losses"]
    want = reference_losses(args, lambda m: train_llama.param_groups(m, args.weight_decay))
    all_decay = reference_losses(
        args, lambda m: [{"params": list(m.parameters()), "weight_decay": args.weight_decay}])
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=1e-5), (i, got, want)
    assert max(abs(a - b) / b for a, b in zip(want, all_decay)) > 1e-4


def test_command_line():
    """As a program (docs/python.md's command lines): the last line is the JSON
    summary; --resume without --save-dir is refused naming the flags."""
    script = os.path.join(ROOT, "examples", "torch", "train_llama.py")
    run = subprocess.run([sys.executable, script, *TINY, "--steps", "2"], capture_output=True,
                         text=True, env=os.environ, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout.strip().splitlines()[-1])["losses"]) == 2
    run = subprocess.run([sys.executable, script, "--resume"], capture_output=True, text=True,
                         env=os.environ, timeout=120, check=False)
    assert run.returncode == 2 and "--resume and --save-every need --save-dir" in run.stderr
