"""A DeepSpeed training loop on strata.deepspeed, with one changed import.

The script-shaped test below uses the API surface DeepSpeed scripts use:
add_config_arguments and args.deepspeed_config, initialize's 4-tuple with
training_data and an lr_scheduler callable, the engine's methods, the
submodules imported as `deepspeed.*`, checkpoints with tags, `latest` and
client_state, save_16bit_model(dir, filename), zero_to_fp32, zero.Init
and GatheredParameters. Its losses are torch AdamW's (fp32, same data), and
what Strata does not do is refused naming it.
"""

import argparse
import copy
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import strata.deepspeed as deepspeed  # noqa: E402  (the one changed import)
from test_torch_frontend import BATCH, GPT, batches  # noqa: E402

STEPS = 4
GAS = 2
MB = BATCH  # the micro-batch: one of test_torch_frontend.batches()


def ds_config(path):
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW",
                         "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                    "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "strata": {"device": "host", "hbm_budget": "64M", "threads": 1}}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return cfg


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.items = [(i, t) for i, t in batches(n)]

    def __len__(self):
        return len(self.items) * MB

    def __getitem__(self, k):
        idx, tgt = self.items[k // MB]
        return idx[k % MB], tgt[k % MB]


def test_a_deepspeed_loop_trains_as_torch_and_checkpoints_with_tags(tmp_path, monkeypatch):
    # The submodules resolve under the name "deepspeed" (no real DeepSpeed here).
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    assert get_accelerator().device_name() in ("cpu", "cuda")
    assert deepspeed.comm.get_world_size() == 1 and deepspeed.comm.get_rank() == 0

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")])
    ds_config(args.deepspeed_config)

    torch.manual_seed(5)
    model = GPT()
    ref = copy.deepcopy(model)
    data = Tokens(STEPS * GAS)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    assert engine.gradient_accumulation_steps() == GAS
    assert engine.train_micro_batch_size_per_gpu() == MB
    assert engine.train_batch_size() == MB * GAS
    assert engine.zero_optimization_stage() == 2
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.local_rank == 0 and engine.global_steps == 0

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.01)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    got, want, boundaries = [], [], []
    for k, (idx, tgt) in enumerate(loader):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
        ref_loss = ref(idx, tgt)
        (ref_loss / GAS).backward()
        want.append(ref_loss.item())
        if (k + 1) % GAS == 0:
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
    assert boundaries == [False, True] * STEPS
    assert engine.global_steps == STEPS and engine.global_samples == STEPS * GAS * MB
    assert engine.get_global_grad_norm() > 0
    assert got == pytest.approx(want, rel=2e-4)
    assert engine.get_lr() == pytest.approx(ref_sched.get_last_lr())

    # Checkpoints: a tag, latest, client_state.
    ckpt = tmp_path / "ckpt"
    # (A Namespace: any picklable object is saved; it loads with
    # STRATA_TRUST_CLIENT_STATE=1, below.)
    assert engine.save_checkpoint(ckpt, client_state={"epoch": 3, "w": torch.ones(2),
                                                      "args": argparse.Namespace(lr=0.5)})
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    engine.save_checkpoint(ckpt, tag="mine", save_latest=False)
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    want_sd = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.save_16bit_model(tmp_path / "out", "model.safetensors")
    engine.save_16bit_model(tmp_path / "out")
    assert (tmp_path / "out" / "pytorch_model.bin").is_file()
    assert oct((tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777) == "0o600"

    # zero_to_fp32 through latest: the model's keys and shapes, loaded strictly.
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    fresh = GPT()
    fresh.load_state_dict(sd, strict=True)
    for k, v in want_sd.items():
        assert torch.equal(sd[k], v), k

    # DeepSpeed's name for strata.register_external_parameter.
    assert deepspeed.zero.register_external_parameter is strata_errors().register_external_parameter

    # GatheredParameters: read, and write with modifier_rank.
    with deepspeed.zero.GatheredParameters([model.wpe], modifier_rank=0):
        assert torch.equal(model.wpe.data.float(), want_sd["wpe"])
        model.wpe.data.fill_(0.25)
    assert torch.all(engine.state_dict()["wpe"] == 0.25)
    engine.destroy()

    # A new engine resumes from `latest`: path, client_state, counters, lr.
    torch.manual_seed(9)
    model2 = GPT()
    engine2, _, _, _ = deepspeed.initialize(
        model=model2, config=str(tmp_path / "ds.json"),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    monkeypatch.delenv("STRATA_TRUST_CLIENT_STATE", raising=False)
    with pytest.raises(strata_errors().FailedPreconditionError, match="argparse.Namespace"):
        engine2.load_checkpoint(ckpt)
    monkeypatch.setenv("STRATA_TRUST_CLIENT_STATE", "1")
    path, client = engine2.load_checkpoint(ckpt)
    assert path is not None and f"global_step{STEPS}" in path
    assert client["epoch"] == 3 and torch.equal(client["w"], torch.ones(2))
    assert client["args"] == argparse.Namespace(lr=0.5)
    assert engine2.global_steps == STEPS
    assert engine2.lr_scheduler.last_epoch == scheduler.last_epoch
    for k, v in engine2.state_dict().items():
        assert torch.equal(v, want_sd[k]), k
    assert engine2.load_checkpoint(tmp_path / "nothing-here") == (None, None)
    engine2.destroy()


def test_the_config_scheduler_is_an_object_with_deepspeeds_interface(tmp_path):
    # WarmupLR from the config: linear warmup 0 -> 3e-3 over 3 steps.
    cfg = ds_config(tmp_path / "ds.json")
    cfg["gradient_accumulation_steps"] = 1
    cfg["scheduler"] = {"type": "WarmupLR",
                        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                   "warmup_num_steps": 3, "warmup_type": "linear"}}
    torch.manual_seed(5)
    model = GPT()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=cfg)
    assert scheduler is engine.lr_scheduler and scheduler is not None
    assert scheduler.optimizer is optimizer and scheduler.type == "WarmupLR"
    assert scheduler.last_batch_iteration == -1
    used = []
    for idx, tgt in batches(5):
        ahead = scheduler.get_lr()
        assert scheduler.get_last_lr() == ahead == engine.get_lr()
        engine.backward(engine(idx, tgt))
        engine.step()
        stats = engine.last_stats
        assert stats["lr"] == pytest.approx(ahead[0], rel=1e-12)  # the lr it said came next
        used.append(stats["lr"])
    assert scheduler.last_batch_iteration == 4 == engine.global_steps - 1
    # The warmup ramps to its maximum and stays there.
    assert used == sorted(used) and used[0] < used[3] and used[4] == pytest.approx(3e-3)
    assert scheduler.state_dict() == {"last_batch_iteration": 4}
    with pytest.raises(deepspeed.NotSupportedError, match="step it a second time"):
        scheduler.step()
    with pytest.raises(strata_errors().FailedPreconditionError, match="schedule is at 4"):
        scheduler.load_state_dict({"last_batch_iteration": 1})
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    engine.destroy()

    # Restored with the engine's step: the next lr is the one it would have been.
    model2 = GPT()
    engine2, _, _, scheduler2 = deepspeed.initialize(model=model2, config=cfg)
    engine2.load_checkpoint(ckpt)
    assert scheduler2.state_dict() == {"last_batch_iteration": 4}
    assert scheduler2.get_lr() == pytest.approx([3e-3])
    engine2.destroy()

    # A scheduler given to initialize takes precedence over the config's
    # (the section is dropped, saying so), as in DeepSpeed.
    with pytest.warns(UserWarning, match="\"scheduler\" section is ignored"):
        engine3, _, _, scheduler3 = deepspeed.initialize(
            model=GPT(), config=cfg,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert isinstance(scheduler3, torch.optim.lr_scheduler.StepLR)
    assert "scheduler" not in engine3.config
    for idx, tgt in batches(2):
        engine3.backward(engine3(idx, tgt))
        engine3.step()
    assert engine3.get_lr() == pytest.approx([3e-3 / 4])
    engine3.destroy()


def test_what_strata_does_not_do_is_refused_naming_it(tmp_path):
    cfg = ds_config(tmp_path / "ds.json")
    model = GPT()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(deepspeed.NotSupportedError, match="initialize\\(optimizer=torch.optim"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=cfg)
    with pytest.raises(deepspeed.NotSupportedError, match="tensor and pipeline parallelism"):
        deepspeed.initialize(model=model, mpu=object(), config=cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # (opt not given)
    with pytest.raises(deepspeed.NotSupportedError, match="bound to another optimizer"):
        deepspeed.initialize(model=model, lr_scheduler=sched, config=cfg)
    with pytest.raises(deepspeed.NotSupportedError, match="pipeline parallelism"):
        deepspeed.pipe.PipelineModule([])
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    with pytest.raises(deepspeed.NotSupportedError, match="mixture-of-experts"):
        split_params_into_different_moe_groups_for_optimizer({"params": []})
    with pytest.raises(strata_errors().InvalidArgumentError, match="no config"):
        deepspeed.initialize(model=model)
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "ds.json"))
    with pytest.raises(strata_errors().InvalidArgumentError, match="pass one"):
        deepspeed.initialize(args=args, model=model, config=cfg)


def strata_errors():
    import strata
    return strata


# Two ranks through strata.launch: init_distributed, a DistributedSampler
# loader (each rank its half of the data), checkpoints saved and loaded by
# both, GatheredParameters written from rank 0, save_16bit_model called by
# both (rank 0 writes); every rank ends with the same parameters.
TWO_RANKS = """
import hashlib, json, os, sys
import torch
sys.path.insert(0, {here!r})
import strata.deepspeed as deepspeed
from test_torch_frontend import GPT, batches

out = sys.argv[1]
stage = int(sys.argv[2])
deepspeed.init_distributed()
rank = deepspeed.comm.get_rank()
torch.manual_seed(2)
model = GPT()
cfg = json.load(open(os.path.join(out, "ds.json")))
cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
# (Stage 0 takes no offload, as in DeepSpeed: the states stay on the device.)
cfg["zero_optimization"] = {{"stage": stage}}
data = [(i[k], t[k]) for i, t in batches(8) for k in range(i.shape[0])]
engine, _, loader, _ = deepspeed.initialize(model=model, config=cfg, training_data=data)
seen = []
for idx, tgt in loader:
    seen.append(int(idx[0, 0]))
    engine.backward(engine(idx, tgt))
    engine.step()
engine.save_checkpoint(os.path.join(out, f"ckpt{{stage}}"))
with deepspeed.zero.GatheredParameters([model.wpe], modifier_rank=0):
    if rank == 0:
        model.wpe.data.fill_(0.5)
path, client = engine.load_checkpoint(os.path.join(out, f"ckpt{{stage}}"))
# (Every rank calls it: the state_dict is gathered from all; rank 0 writes.)
engine.save_16bit_model(os.path.join(out, f"model{{stage}}"))
sd = engine.state_dict()
digest = hashlib.sha256()
for k in sorted(sd):
    t = sd[k].float().contiguous().view(-1)
    digest.update(bytes(t.view(torch.uint8).tolist()))
json.dump({{"rank": rank, "seen": seen, "digest": digest.hexdigest(),
           "steps": engine.global_steps, "path": path}},
          open(os.path.join(out, f"rank{{rank}}-stage{{stage}}.json"), "w"))
engine.destroy()
"""


def test_two_ranks_through_the_launcher(tmp_path):
    """Stages 0 (DeepSpeed's plain data parallelism: Strata runs it as stage
    1), 1 and 3: every rank the same parameters, and the same across the
    stages."""
    from launch_util import run_launch
    ds_config(tmp_path / "ds.json")
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS.format(here=HERE))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("STRATA_GLOO_DIR", None)
    digests = set()
    for stage in (0, 1, 3):
        r = run_launch(["--nproc_per_node", "2", str(script), str(tmp_path), str(stage)], env)
        assert r.returncode == 0, r.stdout
        ranks = [json.loads((tmp_path / f"rank{k}-stage{stage}.json").read_text())
                 for k in range(2)]
        assert ranks[0]["digest"] == ranks[1]["digest"], stage
        # Each rank half of the 8 x BATCH samples: the sampler split the data.
        assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 8 // 2
        assert ranks[0]["steps"] == ranks[1]["steps"] > 0
        saved = torch.load(tmp_path / f"model{stage}" / "pytorch_model.bin", weights_only=True)
        assert set(saved) == set(GPT().state_dict()), stage
        digests.add(ranks[0]["digest"])
    assert len(digests) == 1
