#!/usr/bin/env python3
"""Trains a small Llama-style decoder through Strata with a Hugging Face-style ZeRO-3 config.

    PYTHONPATH=build/python python3 examples/torch/train_llama.py --steps 40 \
        --save-dir /tmp/llama-ckpt --save-every 10
    ... --resume                                   # continue from the newest checkpoint
    ... --offload-optimizer nvme --offload-param nvme --nvme-path /local_nvme
    ... --grad-ckpt                                # recompute each decoder layer in backward
    ... --optimizer-states bf16                    # compact optimizer states (bf16-master, int8)

The config (configs/hf_zero3_llama.json) is what the Hugging Face trainer
hands DeepSpeed: batch sizes, clipping, the optimizer's lr/betas/eps/
weight_decay, bf16 and the schedule's steps are "auto", and this script fills
them (strata.initialize's auto_values) from its command line. The model
(RMSNorm, causal attention with rotary position embeddings, SwiGLU MLP, an
output head tied to the token embedding) and the data (tokens of a fixed
random Markov chain, drawn deterministically from a seed and the micro-batch's
position in the stream) are defined here: nothing is downloaded. Biases, norm
weights and the embedding train without weight decay (a second parameter
group). Each optimizer step prints the loss and the step's learning rate;
the last line is a JSON summary (losses and lrs per step).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import strata

# ---- data ---------------------------------------------------------------------


class TokenStream:
    """An endless, deterministic token stream: a Markov chain over `vocab`
    tokens in which each token has `fanout` possible successors (fixed by
    `seed`). Micro-batch n is a function of (seed, n) alone, so a resumed run
    continues the stream exactly where the checkpoint's data_position says."""

    def __init__(self, vocab, seed, fanout=4):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.seed = seed
        self.next = torch.randint(0, vocab, (vocab, fanout), generator=g)
        # Skewed successor probabilities: the best achievable loss is below log(fanout).
        self.probs = torch.softmax(torch.randn(fanout, generator=g) * 1.5, dim=0)

    def batch(self, n, batch_size, seq):
        """(inputs, targets) of micro-batch n, each [batch_size, seq] int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + n)
        tok = torch.randint(0, self.vocab, (batch_size,), generator=g)
        choice = torch.multinomial(self.probs, batch_size * seq, replacement=True, generator=g)
        choice = choice.view(batch_size, seq)
        rows = [tok]
        for t in range(seq):
            tok = self.next[tok, choice[:, t]]
            rows.append(tok)
        rows = torch.stack(rows, dim=1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ---- model --------------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    """x / rms(x) * weight, computed in fp32, returned in x's dtype."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(seq, head_dim, base, device):
    """cos and sin, [seq, head_dim / 2] fp32, of the rotary angles t × base^(-2i/d)."""
    inv = 1.0 / base**(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x, cos, sin):
    """Rotates the pairs (x[..., i], x[..., i + d/2]) of x [b, h, t, d] by the
    position's angles (the rotate-half layout of Hugging Face's Llama), in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(torch.nn.Module):

    def __init__(self, d, heads, rope_base):
        super().__init__()
        self.heads = heads
        self.head_dim = d // heads
        self.rope_base = rope_base
        self.q_proj = torch.nn.Linear(d, d, bias=False)
        self.k_proj = torch.nn.Linear(d, d, bias=False)
        self.v_proj = torch.nn.Linear(d, d, bias=False)
        self.o_proj = torch.nn.Linear(d, d, bias=False)
        # Not buffers: the engine would cast buffers to the training dtype, and
        # the angles are kept in fp32.
        self._rope = {}

    def rope(self, seq, device):
        key = (seq, str(device))
        if key not in self._rope:
            self._rope[key] = rope_tables(seq, self.head_dim, self.rope_base, device)
        return self._rope[key]

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = ((proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2))
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.rope(t, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if hasattr(F, "scaled_dot_product_attention"):  # torch 2.x
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.x: scores and softmax in fp32
            att = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v.float()).to(x.dtype)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(torch.nn.Module):

    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, ffn, bias=False)
        self.up_proj = torch.nn.Linear(d, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):

    def __init__(self, d, heads, ffn, rope_base):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = Attention(d, heads, rope_base)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = SwiGLU(d, ffn)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def default_ffn(d):
    """Llama's SwiGLU width: 8/3 × d, rounded up to a multiple of 32."""
    return 32 * math.ceil(8 * d / 3 / 32)


class Llama(torch.nn.Module):
    """Token embedding, decoder layers, final RMSNorm, head tied to the
    embedding (the head's weight *is* the embedding's parameter). forward
    returns the mean next-token cross-entropy (in fp32)."""

    def __init__(self, vocab, d, layers, heads, ffn=None, rope_base=10000.0, grad_ckpt=False):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(d, heads, ffn or default_ffn(d), rope_base) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied
        for name, m in self.named_modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                std = 0.02
                if name.endswith(("o_proj", "down_proj")):  # residual branches' outputs
                    std /= math.sqrt(2 * layers)
                torch.nn.init.normal_(m.weight, std=std)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            if self.grad_ckpt and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups(model, weight_decay):
    """DeepSpeed/torch parameter groups: matrices of linear layers decay;
    biases, norm weights and embeddings (so the tied head too) do not. Each
    parameter appears once (a tied one under its first owner)."""
    no_decay_ids = set()
    for m in model.modules():
        if isinstance(m, (torch.nn.Embedding, RMSNorm, torch.nn.LayerNorm)):
            no_decay_ids.update(id(p) for p in m.parameters(recurse=False))
        bias = getattr(m, "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            no_decay_ids.add(id(bias))
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicated: a tied parameter once
        if p.requires_grad:
            (no_decay if id(p) in no_decay_ids else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# ---- configuration ------------------------------------------------------------

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs",
                      "hf_zero3_llama.json")


def load_config(args):
    """The JSON config with the command line's placement and schedule type."""
    with open(args.config, encoding="utf-8") as f:
        cfg = json.load(f)
    zero = cfg.setdefault("zero_optimization", {"stage": 3})
    for key, device in (("offload_optimizer", args.offload_optimizer),
                        ("offload_param", args.offload_param)):
        if device is None:
            continue
        section = zero.setdefault(key, {})
        section["device"] = device
        if device == "nvme":
            section["nvme_path"] = args.nvme_path
    if args.schedule is not None:
        cfg.setdefault("scheduler", {})["type"] = {"cosine": "WarmupCosineLR",
                                                   "linear": "WarmupDecayLR"}[args.schedule]
    if args.device is not None:
        cfg.setdefault("strata", {})["device"] = args.device
    if args.threads is not None:
        cfg.setdefault("strata", {})["threads"] = args.threads
    if args.optimizer_states is not None:
        cfg.setdefault("strata", {})["optimizer_states"] = args.optimizer_states
    return cfg


def auto_values(args):
    """The values for the config's "auto" keys (what the Hugging Face trainer
    would take from its TrainingArguments)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.clip,
        "lr": args.lr,
        "beta1": args.betas[0],
        "beta2": args.betas[1],
        "eps": args.eps,
        "weight_decay": args.weight_decay,
        "bf16_enabled": args.dtype == "bf16",
        "warmup_num_steps": args.warmup,
        "total_num_steps": args.steps,
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=CONFIG, help="DeepSpeed JSON (default %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of the whole run "
                    "(the schedule's total_num_steps)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="end the process after this optimizer step (as if interrupted; "
                    "the schedule still spans --steps)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=None, help="SwiGLU width (default 8/3 hidden)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    ap.add_argument("--warmup", type=int, default=5, help="warmup steps")
    ap.add_argument("--schedule", choices=["cosine", "linear"], default=None,
                    help="WarmupCosineLR or WarmupDecayLR (default: the config's)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="training dtype (bf16.enabled)")
    ap.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=None,
                    help="where the fp32 masters and Adam moments live (default: the config's)")
    ap.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default=None,
                    help="where the working copies of the parameters live (default: the "
                    "config's)")
    ap.add_argument("--nvme-path", default="/tmp/strata-nvme", help="directory for nvme swap")
    ap.add_argument("--device", choices=["auto", "host", "cuda"], default=None,
                    help="strata.device (default: the config's)")
    ap.add_argument("--threads", type=int, default=None, help="strata.threads")
    ap.add_argument("--optimizer-states", choices=["fp32", "bf16", "bf16-master", "int8"],
                    default=None, help="strata.optimizer_states (default: the config's, fp32)")
    ap.add_argument("--grad-ckpt", action="store_true",
                    help="non-reentrant activation checkpointing of each decoder layer")
    ap.add_argument("--save-dir", default=None, help="checkpoint root directory")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save a checkpoint every N optimizer steps (and after the last)")
    ap.add_argument("--resume", action="store_true",
                    help="restore the newest checkpoint under --save-dir and continue")
    ap.add_argument("--seed", type=int, default=1234, help="model initialization")
    ap.add_argument("--data-seed", type=int, default=99, help="the token stream")
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = ap.parse_args(argv)
    if (args.resume or args.save_every) and not args.save_dir:
        ap.error("--resume and --save-every need --save-dir")
    return args


# ---- training -----------------------------------------------------------------


def build_model(args):
    torch.manual_seed(args.seed)
    return Llama(args.vocab, args.hidden, args.layers, args.heads, args.ffn,
                 grad_ckpt=args.grad_ckpt)


def main(argv=None):
    args = parse_args(argv)
    for dev in (args.offload_optimizer, args.offload_param):
        if dev == "nvme":
            os.makedirs(args.nvme_path, exist_ok=True)
    cfg = load_config(args)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    groups = param_groups(model, args.weight_decay)
    engine = strata.initialize(model, cfg, auto_values=auto_values(args),
                               model_parameters=groups)
    gas = engine.gradient_accumulation_steps
    mb = int(engine.config["train_micro_batch_size_per_gpu"])
    zero = engine.config["zero_optimization"]
    sched = engine.config.get("scheduler") or {}
    if not args.quiet:
        print(f"llama: {n_params / 1e6:.2f}M parameters on {engine.device_name}, {engine.dtype}, "
              f"optimizer states: {zero['offload_optimizer']['device']}, "
              f"parameters: {zero['offload_param']['device']}, schedule: "
              f"{sched.get('type', 'none')}, {mb} x {gas} x {args.seq} tokens per step, "
              f"grad-ckpt: {args.grad_ckpt}", flush=True)

    start = 0
    if args.resume:
        info = engine.load_checkpoint(args.save_dir)
        start = int(info["optimizer_step"])
        if info["data_position"] != start * gas:
            raise SystemExit(f"{info['path']}: data_position {info['data_position']} is not "
                             f"optimizer_step {start} x gradient_accumulation_steps {gas}")
        if not args.quiet:
            print(f"resumed from {info['path']} at step {start}", flush=True)

    data = TokenStream(args.vocab, args.data_seed)
    last = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    losses, lrs = [], []
    tokens_per_step = mb * gas * args.seq
    for step in range(start, last):
        t0 = time.perf_counter()
        total = 0.0
        for k in range(gas):
            idx, tgt = data.batch(step * gas + k, mb, args.seq)
            loss = engine(idx.to(engine.device), tgt.to(engine.device))
            engine.backward(loss)
            stats = engine.step()
            total += loss.item() / gas
        assert stats["applied"], "the last micro-batch of a window applies the optimizer"
        dt = time.perf_counter() - t0
        losses.append(total)
        lrs.append(stats["lr"])
        if not args.quiet:
            print(f"step {step + 1:4d}/{args.steps}  loss {total:.4f}  lr {stats['lr']:.3e}  "
                  f"{tokens_per_step / dt:8.0f} tok/s", flush=True)
        done = step + 1
        if args.save_dir and ((args.save_every and done % args.save_every == 0) or
                              done == last):
            engine.save_checkpoint(args.save_dir, data_position=done * gas,
                                   note=f"train_llama step {done}")
    engine.synchronize()
    summary = {"start_step": start, "losses": losses, "lrs": lrs, "next_lr": engine.get_lr()}
    print(json.dumps(summary), flush=True)
    engine.close()
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
