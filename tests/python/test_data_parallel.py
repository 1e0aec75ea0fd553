"""Data parallelism through the PyTorch frontend, launched as torchrun does.

Two ranks (processes with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
each bring up torch.distributed's default process group (gloo) and train the
GPT of test_torch_frontend.py twice from the same weights on the same global
batch (rank r takes micro-batch s * 2 + r of step s): once as torch's
DistributedDataParallel + AdamW, once through strata.initialize, whose engine
does its own collectives (the default group only hands it a rendezvous
directory). The mean losses over the ranks and the final fp32 parameters
must agree, and every rank's strata parameters must be the same bits. The
model is the GPT, or torch's own nn.TransformerEncoder (test_torch_frontend's
Encoder). The ranks' checkpoint then loads on one rank with the parameters
they saved.
"""

import copy
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from launch_util import in_torch_rendezvous  # noqa: E402
from test_torch_frontend import BATCH, GPT, Encoder, batches, config  # noqa: E402

from strata._torch_compat import rendezvous_env  # noqa: E402

STEPS = 6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, args, tmp_path, timeout=300):
    """The ranks as processes, each one's output in a file. A rank that
    fails gets its peers ended 30 s later (as a launcher would: they may be
    waiting for it in torch's rendezvous); the ranks are launched once more
    (on a new port) when one failed inside torch's own rendezvous
    (launch_util.py)."""

    def launch(attempt):
        port = free_port()
        procs, logs = [], []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            env.pop("STRATA_GLOO_DIR", None)
            # As a launcher would: USE_LIBUV=0 for a torch whose TCPStore has
            # no libuv (Debian's torch 2.6), as strata.launch does.
            env.update(rendezvous_env(env))
            log = open(tmp_path / f"rank{r}-launch{attempt}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *args,
                                           str(tmp_path)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 30):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.1)
        outs = []
        for p, log in zip(procs, logs):
            p.wait()
            log.seek(0)
            outs.append(log.read())
            log.close()
        return [p.returncode for p in procs], outs

    codes, outs = launch(0)
    if any(c != 0 and in_torch_rendezvous(o) for c, o in zip(codes, outs)):
        for f in tmp_path.glob("rank*.json"):
            f.unlink()
        codes, outs = launch(1)
    for r, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0, (f"rank {r} exited with {code} (-9: ended after its peer failed, or "
                           f"after {timeout} s):\n{out}\n" +
                           "".join(f"--- rank {q}:\n{o}\n" for q, o in enumerate(outs) if q != r))
    results = []
    for r in range(world):
        with open(tmp_path / f"rank{r}.json") as f:
            results.append(json.load(f))
    return results


def digest_of(sd):
    digest = hashlib.sha256()
    for k in sorted(sd):
        digest.update(bytes(sd[k].contiguous().view(-1).view(torch.uint8).tolist()))
    return digest.hexdigest()


def worker(make, opt, par, stage, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import strata

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    model = {"gpt": GPT, "encoder": Encoder}[make]()
    ref = copy.deepcopy(model)
    data = batches(STEPS * world)
    cfg = config(opt, par, os.path.join(out_dir, "nvme"), clip=0.5)
    cfg["zero_optimization"]["stage"] = stage
    cfg["train_batch_size"] = BATCH * world  # the global batch
    if rank == 0:
        os.makedirs(os.path.join(out_dir, "nvme"), exist_ok=True)
    dist.barrier()

    def mean(x):
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / world

    # torch's DistributedDataParallel + AdamW.
    p = cfg["optimizer"]["params"]
    ddp = DistributedDataParallel(ref)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=p["lr"], betas=tuple(p["betas"]),
                              eps=p["eps"], weight_decay=p["weight_decay"])
    want = []
    for s in range(STEPS):
        idx, tgt = data[s * world + rank]
        loss = ddp(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg["gradient_clipping"])
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        want.append(mean(loss.item()))

    engine = strata.initialize(model, cfg)
    got = []
    stats = None
    for s in range(STEPS):
        idx, tgt = data[s * world + rank]
        loss = engine(idx, tgt)
        engine.backward(loss)
        stats = engine.step()
        assert stats["applied"]
        got.append(mean(loss.item()))
    sd = engine.state_dict()  # a collective: every rank asks
    ref_sd = ref.state_dict()
    worst = max(((sd[k] - ref_sd[k]).abs().max().item() for k in sd), default=0.0)
    # A collective too: rank 0 writes the parameters and the manifest, each
    # rank its partition of the states.
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"), data_position=STEPS)
    engine.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"got": got, "want": want, "worst": worst, "digest": digest_of(sd),
                   "world_size": stats.get("world_size"),
                   "comm_reduced_bytes": stats.get("comm_reduced_bytes", 0)}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("make,opt,par,stage", [("gpt", "none", "none", 1),
                                                ("gpt", "cpu", "none", 2),
                                                ("encoder", "cpu", "none", 2),
                                                ("encoder", "cpu", "cpu", 3),
                                                ("encoder", "none", "none", 3),
                                                ("gpt", "cpu", "none", 3),
                                                ("encoder", "nvme", "nvme", 3),
                                                ("gpt", "nvme", "cpu", 3)])
def test_two_ranks_match_distributed_data_parallel(make, opt, par, stage, tmp_path):
    r0, r1 = run_ranks(2, [make, opt, par, str(stage)], tmp_path)
    assert r0["world_size"] == 2 and r0["comm_reduced_bytes"] > 0
    assert r0["digest"] == r1["digest"], "the ranks' parameters differ"
    for i, (a, b) in enumerate(zip(r0["got"], r0["want"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i + 1}: strata {a!r}, DDP {b!r}"
    if make == "gpt":
        assert r0["want"][-1] < r0["want"][0] * 0.95  # it trained
        # (nn.MultiheadAttention's key bias has a zero gradient in exact
        # arithmetic; Adam turns its rounding noise into O(lr) steps that no
        # two summation orders share, so the encoder's parameters are not
        # compared.)
        assert r0["worst"] < 1e-4, f"parameters differ from DDP's by up to {r0['worst']}"
    # The two ranks' checkpoint loads on one rank accumulating both
    # micro-batches (the same global batch): the parameters they saved.
    import strata
    model = {"gpt": GPT, "encoder": Encoder}[make]()
    cfg = config(opt, par, tmp_path / "nvme", gas=2, clip=0.5)
    cfg["zero_optimization"]["stage"] = stage
    cfg["train_batch_size"] = BATCH * 2
    engine = strata.initialize(model, cfg)
    info = engine.load_checkpoint(tmp_path / "ckpt")
    assert info["optimizer_step"] == STEPS and info["data_position"] == STEPS
    assert digest_of(engine.state_dict()) == r0["digest"], "not the parameters two ranks saved"
    engine.close()


if __name__ == "__main__":
    make_, opt_, par_, stage_, out_ = sys.argv[1:6]
    worker(make_, opt_, par_, int(stage_), out_)
