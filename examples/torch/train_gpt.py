#!/usr/bin/env python3
"""Trains a small GPT-style transformer through Strata with a DeepSpeed config.

    PYTHONPATH=build/python python3 examples/torch/train_gpt.py \
        --config configs/torch_gpt.json --steps 30
    ... --offload nvme --nvme-path /local_nvme     # states and parameters on NVMe
    ... --baseline                                 # also plain PyTorch, all on the device

The model (token + position embeddings, pre-norm attention/MLP blocks, a head
tied to the embedding) and the data (text from a small random grammar,
byte-level tokens) are defined here: nothing is downloaded. It runs on the
GPU when torch and Strata see one, else on Strata's host device. Each step
prints the loss and the engine's statistics (where the step's time went and
what bounds it).
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

import strata

# ---- data ---------------------------------------------------------------------

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "every child", "the engine"]
VERBS = ["sees", "likes", "moves", "writes", "finds", "keeps"]
OBJECTS = ["the ball", "a letter", "the river", "some bread", "the gradients", "a shard"]
PLACES = ["at home", "in the park", "on the disk", "near the GPU", "by the sea"]


def make_text(seed, n_bytes):
    rng = random.Random(seed)
    out = []
    size = 0
    while size < n_bytes:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.5:
            s += " " + rng.choice(PLACES)
        s += ". "
        out.append(s)
        size += len(s)
    return "".join(out).encode()


def batch(data, step, batch_size, seq, device):
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


# ---- model --------------------------------------------------------------------


class Block(torch.nn.Module):

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):  # torch 2.x
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):

    def __init__(self, vocab, seq, d, layers, heads):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[:idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ---- training -----------------------------------------------------------------

TIMES = ("fetch_wait_s", "grad_offload_s", "optimizer_s")


def load_config(args):
    with open(args.config, encoding="utf-8") as f:
        cfg = json.load(f)
    zero = cfg.setdefault("zero_optimization", {"stage": 3})
    if args.offload:
        for key in ("offload_optimizer", "offload_param"):
            section = zero.setdefault(key, {})
            section["device"] = args.offload
            if args.offload == "nvme":
                section["nvme_path"] = args.nvme_path
    if args.device:
        cfg.setdefault("strata", {})["device"] = args.device
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "..",
                                                     "configs", "torch_gpt.json"))
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--offload", choices=["none", "cpu", "nvme"],
                    help="where optimizer states and parameters live (overrides the config)")
    ap.add_argument("--nvme-path", default="/tmp/strata-nvme")
    ap.add_argument("--device", choices=["auto", "host", "cuda"], help="strata.device")
    ap.add_argument("--baseline", action="store_true",
                    help="also train the same model in plain PyTorch (all on the device, "
                    "torch.optim.AdamW) and compare tokens/s")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    cfg = load_config(args)
    if args.offload == "nvme":
        os.makedirs(args.nvme_path, exist_ok=True)
    text = torch.tensor(list(make_text(args.seed, 1 << 20)), dtype=torch.long)
    torch.manual_seed(args.seed)
    model = GPT(256, args.seq, args.hidden, args.layers, args.heads)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())

    engine = strata.initialize(model, cfg)
    mb = int(engine.config["train_micro_batch_size_per_gpu"])
    gas = engine.gradient_accumulation_steps
    tokens_per_step = mb * gas * args.seq
    zero = engine.config["zero_optimization"]
    print(f"strata: {n_params / 1e6:.2f}M parameters on {engine.device_name}, {engine.dtype}, "
          f"optimizer states: {zero['offload_optimizer']['device']}, "
          f"parameters: {zero['offload_param']['device']}, {tokens_per_step} tokens per step",
          flush=True)

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        window = dict.fromkeys(TIMES, 0.0)
        for k in range(gas):
            idx, tgt = batch(text, step * gas + k, mb, args.seq, engine.device)
            loss = engine(idx, tgt)
            engine.backward(loss)
            st = engine.step()
            for key in TIMES:  # the window's busy times (the optimizer's land in
                window[key] += st[key]  # the Step() that finds it finished)
            total += loss.item() / gas
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {step + 1:4d}  loss {total:.4f}  lr {st['lr']:.3e}  "
              f"{tokens_per_step / dt:9.0f} tok/s  "
              f"fetch_wait {1e3 * window['fetch_wait_s']:.1f} ms  "
              f"grad_offload {1e3 * window['grad_offload_s']:.1f} ms  "
              f"optimizer {1e3 * window['optimizer_s']:.1f} ms  "
              f"overlap {st['overlap_efficiency']:.2f}  bound_by {st['bound_by']}", flush=True)
    engine.synchronize()
    med = sorted(times[len(times) // 2:])[len(times[len(times) // 2:]) // 2]  # 2nd half
    result = {"strata_tokens_per_s": tokens_per_step / med, "final_loss": total}

    if args.baseline:
        device = engine.device
        engine.close()
        ref = GPT(256, args.seq, args.hidden, args.layers, args.heads)
        ref.load_state_dict(init)
        ref.to(device)
        p = cfg["optimizer"]["params"]
        opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]),
                                eps=p["eps"], weight_decay=p["weight_decay"])
        use_bf16 = cfg.get("bf16", {}).get("enabled", False)
        times = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            for k in range(gas):
                idx, tgt = batch(text, step * gas + k, mb, args.seq, device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    loss = ref(idx, tgt)
                (loss / gas).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.get("gradient_clipping", 0) or
                                           float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        med = sorted(times[len(times) // 2:])[len(times[len(times) // 2:]) // 2]
        result["torch_tokens_per_s"] = tokens_per_step / med
        result["ratio"] = result["strata_tokens_per_s"] / result["torch_tokens_per_s"]
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
