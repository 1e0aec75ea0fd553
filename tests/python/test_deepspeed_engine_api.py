"""DeepSpeed's engine as scripts use it, beyond the training loop of
test_deepspeed_api.py: the Module-like methods, the step's return values
and counters, the boundary and no_sync, fine-tuning from a checkpoint's
weights, the loader's sampler, the namespace's config error and
RepeatingLoader."""

import os

import pytest
import torch

import strata
import strata.deepspeed as deepspeed

BATCH = 4


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def config(gas=2):
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas,
            "gradient_clipping": 1.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.9]}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "strata": {"device": "host", "hbm_budget": "64M", "threads": 1}}


def loss_of(engine, seed):
    g = torch.Generator().manual_seed(seed)
    return engine(torch.randn(BATCH, 6, generator=g)).square().mean()


def test_the_engine_as_deepspeeds_module_and_counters():
    torch.manual_seed(0)
    model = MLP()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config())
    assert [n for n, _ in engine.named_parameters()] == ["a.weight", "a.bias", "b.weight",
                                                         "b.bias"]
    assert list(engine.parameters()) == list(model.parameters())
    assert engine.dp_world_size == 1 and engine.gradient_clipping() == 1.5
    assert engine.get_mom() == [(0.8, 0.9)]
    assert engine.to("cpu") is engine and engine.to(torch.float32) is engine
    with pytest.raises(deepspeed.NotSupportedError, match="keeps the parameters on cpu"):
        engine.to(torch.float16)
    assert engine.train() is engine and engine.eval() is engine and not model.training
    engine.train()

    # Micro-batch 1 of 2: no step applied; backward returns the loss.
    with engine.no_sync():
        loss = loss_of(engine, 1)
        assert engine.backward(loss) is loss
    assert engine.step() is None and not engine.was_step_applied()
    assert engine.global_steps == 0 and engine.global_samples == 0
    # A declared boundary that disagrees is refused, and nothing ran.
    engine.set_gradient_accumulation_boundary(False)
    assert not engine.is_gradient_accumulation_boundary()
    engine.backward(loss_of(engine, 2))
    with pytest.raises(strata.FailedPreconditionError, match="micro-batch 2 of a window"):
        engine.step()
    assert engine.micro_steps == 1
    engine.set_gradient_accumulation_boundary(True)
    assert engine.step() is None and engine.was_step_applied()
    assert engine.last_stats["applied"] and engine.skipped_steps == 0
    assert engine.global_steps == 1 and engine.global_samples == engine.train_batch_size()
    engine.empty_partition_cache()

    # retain_graph: the same graph twice.
    loss = loss_of(engine, 3)
    engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    engine.step()
    engine.destroy()


def test_fine_tuning_from_a_checkpoints_weights(tmp_path):
    torch.manual_seed(1)
    engine, _, _, _ = deepspeed.initialize(model=MLP(), config=config(gas=1))
    for k in range(3):
        engine.backward(loss_of(engine, k))
        engine.step()
    engine.save_checkpoint(tmp_path, client_state={"epoch": 2})
    trained = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.destroy()

    torch.manual_seed(2)
    tuned, _, _, _ = deepspeed.initialize(model=MLP(), config=config(gas=1))
    with pytest.raises(deepspeed.NotSupportedError, match="load_module_only=True"):
        tuned.load_checkpoint(tmp_path, load_optimizer_states=False)
    path, client = tuned.load_checkpoint(tmp_path, load_optimizer_states=False,
                                         load_lr_scheduler_states=False, load_module_only=True)
    assert path.endswith("global_step3") and client["epoch"] == 2
    for k, v in tuned.state_dict().items():
        assert torch.equal(v, trained[k]), k
    assert tuned.global_steps == 0  # the counters start afresh
    tuned.backward(loss_of(tuned, 9))
    tuned.step()
    assert tuned.was_step_applied()
    tuned.destroy()


def test_the_loader_the_accelerator_and_the_namespace(tmp_path):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfigError
    from deepspeed.utils import RepeatingLoader
    data = torch.utils.data.TensorDataset(torch.arange(12.0).view(12, 1))
    engine, _, loader, _ = deepspeed.initialize(model=MLP(), config=config(),
                                                training_data=data)
    assert isinstance(loader.data_sampler, torch.utils.data.distributed.DistributedSampler)
    assert sorted(x.item() for (b,) in loader for x in b) == list(range(12))
    engine.destroy()
    if not torch.cuda.is_available():
        assert not get_accelerator().is_fp16_supported()
    assert get_accelerator().is_bf16_supported()
    cfg = config()
    cfg["zero_optimization"]["stage"] = 7
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage") as e:
        deepspeed.initialize(model=MLP(), config=cfg)
    assert isinstance(e.value, ValueError) and isinstance(e.value, strata.InvalidArgumentError)
    repeating = RepeatingLoader([1, 2])
    assert [next(repeating) for _ in range(5)] == [1, 2, 1, 2, 1]


def test_parameters_carry_deepspeeds_zero3_attributes():
    from deepspeed.zero import GatheredParameters, ZeroParamStatus
    model = MLP()
    shapes = [p.shape for p in model.parameters()]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config())
    for k, p in enumerate(model.parameters()):
        assert p.ds_id == k and p.ds_shape == shapes[k] and p.ds_numel == shapes[k].numel()
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0
    with GatheredParameters(model.a.weight):
        assert model.a.weight.ds_status == ZeroParamStatus.AVAILABLE
        assert model.a.weight.shape == shapes[0]
    assert model.a.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    engine.destroy()  # the model's own parameters again
    assert not hasattr(model.a.weight, "ds_id") and model.a.weight.shape == shapes[0]


class Checkpointed(MLP):
    def __init__(self, use):
        super().__init__()
        self.use = use

    def forward(self, x):
        import deepspeed.checkpointing as ckpt
        h = torch.tanh(self.a(x))  # (a reentrant checkpoint needs an input requiring grad)
        return ckpt.checkpoint(self.b, h) if self.use else self.b(h)


def test_activation_checkpointing_as_deepspeed_scripts_call_it():
    import deepspeed.checkpointing
    deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    assert deepspeed.checkpointing.is_configured()
    losses = {}
    for use in (False, True):
        torch.manual_seed(6)
        engine, _, _, _ = deepspeed.initialize(model=Checkpointed(use), config=config(gas=1))
        got = []
        for k in range(4):
            loss = loss_of(engine, k)
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        losses[use] = got
        engine.destroy()
    assert losses[True] == losses[False]  # the same arithmetic, recomputed
    with pytest.raises(deepspeed.NotSupportedError, match="tensor and pipeline parallelism"):
        deepspeed.checkpointing.configure(object())


@pytest.mark.skipif(torch.cuda.is_available() and torch.distributed.is_nccl_available(),
                    reason="NCCL and a CUDA device are here: 'nccl' is used as asked")
def test_init_distributed_nccl_without_cuda_uses_gloo():
    """A GPU script's `deepspeed.init_distributed(dist_backend="nccl")` (its
    `--backend nccl` default) on a machine without CUDA or NCCL: gloo,
    with one warning saying so, instead of torch's "Distributed package
    doesn't have NCCL built in"."""
    import subprocess
    import sys
    code = ("import warnings, torch, strata.deepspeed as deepspeed\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    deepspeed.init_distributed(dist_backend='nccl')\n"
            "    deepspeed.init_distributed(dist_backend='nccl')  # idempotent: no second word\n"
            "print(torch.distributed.get_backend(), len(w), w[0].message if w else None)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0, r.stdout
    backend, count, message = r.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (backend, count) == ("gloo", "1"), r.stdout
    assert "dist_backend 'nccl' asked for" in message and "using 'gloo'" in message
