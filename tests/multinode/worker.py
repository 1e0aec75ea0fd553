"""One rank of tests/multinode/two_machines.py: trains a small MLP through
strata.initialize on data that depends only on the step (rank r of a world
of w takes micro-batch k*w + r), and prints `DIGEST <rank> <sha256>` of its
final parameters, so that two ranks compare bitwise with one process that
accumulates 2 micro-batches.

Environment: INIT=torch|deepspeed brings torch.distributed up first
(init_process_group, or strata.deepspeed.init_distributed); PAUSE_RANK and
PAUSE_S make that rank stop PAUSE_S seconds before its third step (a slow
peer); STEPS (default 5); STEP_SLEEP seconds after each step, which prints
`STEP <n>` (so a harness can cut the link mid-run)."""

import hashlib
import os
import time

import torch

import strata

init = os.environ.get("INIT", "")
if init == "torch":
    import torch.distributed as dist
    dist.init_process_group("gloo")
elif init == "deepspeed":
    import strata.deepspeed as deepspeed
    deepspeed.init_distributed()
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
steps = int(os.environ.get("STEPS", "5"))
pause_rank = int(os.environ.get("PAUSE_RANK", "-1"))
micro = 2 // world
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": micro,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}
engine = strata.initialize(model, config)
data = torch.Generator().manual_seed(1)
for step in range(steps):
    batches = [torch.randn(4, 16, generator=data) for _ in range(2)]
    if step == 2 and rank == pause_rank:
        time.sleep(float(os.environ.get("PAUSE_S", "0")))
    for k in range(micro):
        loss = engine(batches[k * world + rank]).square().mean()
        engine.backward(loss)
        engine.step()
    print(f"STEP {step}", flush=True)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
digest = hashlib.sha256()
state = engine.state_dict()
for name in sorted(state):
    digest.update(state[name].float().numpy().tobytes())
print(f"DIGEST {rank} {digest.hexdigest()}", flush=True)
engine.close()
