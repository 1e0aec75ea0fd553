"""DeepSpeed's own unit tests of the engine API, re-expressed for strata.deepspeed.

Each test below follows one test of DeepSpeed's tests/unit (named in its
docstring): runtime/test_ds_initialize.py, runtime/test_lr_schedulers.py,
checkpoint/test_latest_checkpoint.py, checkpoint/test_tag_validation.py,
checkpoint/test_lr_scheduler.py, checkpoint/test_shared_weights.py,
runtime/zero/test_zero_context.py and runtime/zero/test_zero.py. They run in
one process on the host device with a small model shaped like DeepSpeed's
SimpleModel, and keep DeepSpeed's assertions. Where Strata deliberately
differs (the optimizer and scheduler objects it returns, what it refuses),
the test asserts Strata's documented behaviour instead and says why.
"""

import copy

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

import strata.deepspeed as deepspeed
from strata.deepspeed.runtime.lr_schedules import OneCycle, WarmupLR
from strata.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from strata.deepspeed.zero import ZeroParamStatus

HIDDEN = 10
HOST = {"device": "host", "hbm_budget": "64M", "threads": 1}


class SimpleModel(torch.nn.Module):
    """A stack of square Linear layers ending in a cross-entropy loss."""

    def __init__(self, hidden=HIDDEN, nlayers=1):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden)
                                           for _ in range(nlayers))
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return self.loss(x, y)


def batches(n, micro=2, hidden=HIDDEN, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro, hidden, generator=g),
             torch.randint(0, hidden, (micro,), generator=g)) for _ in range(n)]


def config(scheduler=None, stage=0, lr=0.00015, **extra):
    cfg = {"train_batch_size": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": lr}},
           "zero_optimization": {"stage": stage}, "strata": dict(HOST)}
    if scheduler is not None:
        cfg["scheduler"] = {"type": scheduler[0], "params": scheduler[1]}
    cfg.update(extra)
    return cfg


def train(engine, n, seed=0, micro=2):
    losses = []
    for x, y in batches(n, micro=micro, seed=seed):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ---- runtime/test_ds_initialize.py -------------------------------------------------------


@pytest.mark.parametrize("client_parameters", [True, False])
def test_config_optimizer(client_parameters):
    """test_ds_initialize.py TestConfigOptimizer: the config's optimizer, with
    model_parameters given or not."""
    model = SimpleModel()
    params = list(model.parameters()) if client_parameters else None
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        config={"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
                "strata": dict(HOST)}, model=model, model_parameters=params)
    # DeepSpeed asserts a FusedAdam here; Strata runs the config's Adam as its own
    # optimizer (a torch.optim.Optimizer), which is the engine's.
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    assert isinstance(optimizer, torch.optim.Optimizer) and optimizer is engine.optimizer
    assert optimizer.param_groups[0]["lr"] == 0.001
    assert loader is None and scheduler is None
    engine.destroy()


@pytest.mark.parametrize("optimizer_type", [None, "Optimizer", "Callable"])
def test_client_optimizer(optimizer_type):
    """test_ds_initialize.py TestClientOptimizer: no optimizer (the config's),
    a torch optimizer object, or a callable building one."""
    model = SimpleModel()
    cfg = {"train_batch_size": 1, "strata": dict(HOST)}
    if optimizer_type is None:
        client = None
        cfg["optimizer"] = {"type": "Adam"}
    elif optimizer_type == "Optimizer":
        client = torch.optim.Adam(model.parameters())
    else:
        def client(params):
            return torch.optim.AdamW(params=params)
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        config=cfg, model=model, model_parameters=list(model.parameters()), optimizer=client)
    # DeepSpeed returns the client's object itself (or the one the callable
    # built); Strata always returns its own optimizer (docs/python.md: the object's type
    # and param groups become the config's optimizer) and keeps the script's
    # object as engine.client_optimizer, whose lr it reads at every step.
    assert ds_optimizer is engine.optimizer
    if optimizer_type is None:
        assert engine.client_optimizer is None
        assert engine.config["optimizer"]["type"] == "Adam"
    elif optimizer_type == "Optimizer":
        assert engine.client_optimizer is client
        assert engine.config["optimizer"]["type"] == "Adam"
    else:
        assert isinstance(engine.client_optimizer, torch.optim.AdamW)
        assert engine.config["optimizer"]["type"] == "AdamW"
    engine.destroy()


def _my_lambda(epoch):
    return epoch // 10


@pytest.mark.parametrize("optimizer_type", [None, "Optimizer", "Callable"])
@pytest.mark.parametrize("scheduler_type", [None, "LRScheduler", "Callable"])
def test_client_lr_scheduler(scheduler_type, optimizer_type):
    """test_ds_initialize.py TestClientLrScheduler: every combination of a
    config / object / callable optimizer with a config / object / callable
    scheduler, an object bound to another optimizer refused."""
    model = SimpleModel()
    cfg = {"train_batch_size": 1, "strata": dict(HOST)}
    client_optimizer = None
    if optimizer_type is None:
        cfg["optimizer"] = {"type": "Adam"}
    elif optimizer_type == "Optimizer":
        client_optimizer = torch.optim.Adam(model.parameters())
    else:
        def client_optimizer(params):
            return torch.optim.AdamW(params=params)
    client_scheduler = None
    if scheduler_type is None:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
    elif scheduler_type == "LRScheduler":
        if isinstance(client_optimizer, torch.optim.Optimizer):
            client_scheduler = LambdaLR(client_optimizer, _my_lambda)
        else:
            client_scheduler = LambdaLR(torch.optim.Adam(model.parameters()), _my_lambda)
    else:
        def client_scheduler(opt):
            return LambdaLR(opt, _my_lambda)

    kwargs = dict(config=cfg, model=model, model_parameters=list(model.parameters()),
                  optimizer=client_optimizer, lr_scheduler=client_scheduler)
    if scheduler_type == "LRScheduler" and optimizer_type != "Optimizer":
        # DeepSpeed asserts (AssertionError); Strata refuses naming why.
        with pytest.raises(deepspeed.NotSupportedError, match="bound to another optimizer"):
            deepspeed.initialize(**kwargs)
        return
    engine, _, _, ds_scheduler = deepspeed.initialize(**kwargs)
    assert ds_scheduler is engine.lr_scheduler
    if scheduler_type is None:
        # DeepSpeed's is a WarmupLR; Strata's config schedule is a
        # ConfigLRScheduler naming its type (docs/python.md), with WarmupLR's interface.
        assert isinstance(ds_scheduler, deepspeed.ConfigLRScheduler)
        assert ds_scheduler.type == "WarmupLR" and not isinstance(ds_scheduler, LambdaLR)
    elif scheduler_type == "LRScheduler":
        assert ds_scheduler is client_scheduler
    else:
        assert isinstance(ds_scheduler, LambdaLR)
    engine.destroy()


@pytest.mark.parametrize("scheduler_type", [None, "LRScheduler", "Callable"])
def test_client_lr_scheduler_init_onecycle_steplr(scheduler_type):
    """test_ds_initialize.py TestClientLrSchedulerInit::
    test_diff_lrscheler_and_callable_onecyclelr_steplr: a scheduler given in
    code takes precedence over the config's; without one the config's
    OneCycle is built."""
    model = SimpleModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = {"train_batch_size": 1, "strata": dict(HOST)}
    sched = None
    if scheduler_type is None:
        cfg["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1}}
    elif scheduler_type == "LRScheduler":
        sched = StepLR(opt, step_size=30)
    else:
        def sched(o):
            return OneCycleLR(o, max_lr=0.01, total_steps=200)
    engine, _, _, ds_scheduler = deepspeed.initialize(
        config=cfg, model=model, model_parameters=list(model.parameters()), optimizer=opt,
        lr_scheduler=sched)
    if scheduler_type is None:
        assert isinstance(ds_scheduler, deepspeed.ConfigLRScheduler)  # (DeepSpeed: OneCycle)
        assert ds_scheduler.type == "OneCycle" and not isinstance(ds_scheduler, OneCycle)
    elif scheduler_type == "LRScheduler":
        assert isinstance(ds_scheduler, StepLR)
    else:
        assert isinstance(ds_scheduler, OneCycleLR)
    engine.destroy()


def test_client_scheduler_object_drives_the_step():
    """test_ds_initialize.py TestClientLrSchedulerInit::test_same_lrscheler_and_callable,
    carried on to the step: the client's LambdaLR (not the config's WarmupLR)
    sets the lr the engine's steps use, and its state_dict follows the steps."""
    model = SimpleModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = LambdaLR(opt, lambda e: 1.0 / (1 + e))
    cfg = {"train_batch_size": 1, "strata": dict(HOST),
           "scheduler": {"type": "WarmupLR", "params": {}}}
    with pytest.warns(UserWarning, match="\"scheduler\" section is ignored"):
        engine, _, _, ds_scheduler = deepspeed.initialize(
            config=cfg, model=model, model_parameters=list(model.parameters()), optimizer=opt,
            lr_scheduler=sched)
    assert ds_scheduler is sched and not isinstance(ds_scheduler, WarmupLR)
    used = []
    for x, y in batches(4, micro=1):
        engine.backward(engine(x, y))
        engine.step()
        used.append(engine.last_stats["lr"])
    assert used == pytest.approx([0.01 / (1 + e) for e in range(4)], rel=1e-6)
    assert sched.state_dict()["last_epoch"] == 4 and engine.get_lr() == sched.get_last_lr()
    engine.destroy()


# ---- runtime/test_lr_schedulers.py ---------------------------------------------------------

SCHEDULES = [("WarmupLR", {}),
             ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 10}),
             ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                           "decay_step_size": 5}),
             ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 1})]


@pytest.mark.parametrize("kind,params", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_get_lr_before_train_and_scheduler_optimizer_parity(kind, params):
    """test_lr_schedulers.py TestGetLrBeforeTrain and TestSchedulerOptimizerParity:
    before training the optimizer's groups hold the scheduler's lr; after each
    step the scheduler's get_lr() is the engine's."""
    engine, _, _, sched = deepspeed.initialize(config=config((kind, params)),
                                               model=SimpleModel())
    for group, lr in zip(engine.optimizer.param_groups, sched.get_lr()):
        assert group["lr"] == lr
    for x, y in batches(12):
        sched.get_lr()
        engine.backward(engine(x, y))
        engine.step()
        assert sched.get_lr() == engine.get_lr()
    engine.destroy()


def run_schedule(kind, params, steps, before=False):
    """The lr the config's schedule gives at each of `steps` engine steps,
    read before each step (`before`) or after it, as DeepSpeed's tests do."""
    engine, _, _, sched = deepspeed.initialize(config=config((kind, params)),
                                               model=SimpleModel())
    lrs = []
    for x, y in batches(steps):
        if before:
            lrs.extend(sched.get_lr())
        engine.backward(engine(x, y))
        engine.step()
        if not before:
            lrs.append(sched.get_lr())
    engine.destroy()
    return lrs


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps", [10, 15, 19, 33])
def test_lr_warmup_schedule(warmup_num_steps, warmup_type):
    """test_lr_schedulers.py TestLrSchedule::test_lr_warmup_schedule."""
    lrs = run_schedule("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2,
                                    "warmup_num_steps": warmup_num_steps,
                                    "warmup_type": warmup_type}, 2 * warmup_num_steps)
    assert lrs[0] == [0.1]
    assert lrs[warmup_num_steps] == [0.2]
    assert all(lr == [0.2] for lr in lrs[warmup_num_steps:])


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps", [10, 15, 19, 33])
def test_lr_warmup_decay_schedule(warmup_num_steps, warmup_type):
    """test_lr_schedulers.py TestLrSchedule::test_lr_warmup_decay_schedule."""
    total = 2 * warmup_num_steps
    lrs = run_schedule("WarmupDecayLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2,
                                         "warmup_num_steps": warmup_num_steps,
                                         "total_num_steps": total, "warmup_type": warmup_type},
                       total)
    assert lrs[0] == [0.1]
    assert lrs[warmup_num_steps] == [0.2]
    previous = lrs[warmup_num_steps]
    for lr in lrs[warmup_num_steps + 1:]:
        assert lr < previous
        previous = lr


def strictly_increasing(values):
    return all(a < b for a, b in zip(values, values[1:]))


def strictly_decreasing(values):
    return all(a > b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("min_lr,step_rate,step_size,staircase",
                         [(1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True),
                          (1e-3, 1e-3, 10, False), (1e-2, 1e-2, 19, True),
                          (1e-2, 1e-2, 19, False)])
def test_lr_range_test(min_lr, step_rate, step_size, staircase):
    """test_lr_schedulers.py TestLrRange: starts at the minimum, then rises
    continuously or in stairs of step_size."""
    lrs = run_schedule("LRRangeTest", {"lr_range_test_min_lr": min_lr,
                                       "lr_range_test_step_rate": step_rate,
                                       "lr_range_test_step_size": step_size,
                                       "lr_range_test_staircase": staircase},
                       max(50, 2 * step_size), before=True)
    assert lrs[0] == min_lr
    if staircase:
        for i in range(0, len(lrs), step_size):
            assert all(v == lrs[i] for v in lrs[i:i + step_size])
        assert strictly_increasing(lrs[::step_size])
    else:
        assert strictly_increasing(lrs)


@pytest.mark.parametrize("min_lr,max_lr,decay_rate,cycle_step_size,decay_step_size",
                         [(1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21),
                          (1e-3, 1e-1, 1e-1, 21, 21), (1e-5, 1e-1, 0, 10, 0)])
def test_one_cycle_lr(min_lr, max_lr, decay_rate, cycle_step_size, decay_step_size):
    """test_lr_schedulers.py TestOneCycle::test_lr: up from the minimum to the
    peak at cycle_first_step_size, down over as many steps, then decaying."""
    lrs = run_schedule("OneCycle", {"cycle_min_lr": min_lr, "cycle_max_lr": max_lr,
                                    "decay_lr_rate": decay_rate,
                                    "cycle_first_step_size": cycle_step_size,
                                    "decay_step_size": decay_step_size},
                       max(50, 3 * cycle_step_size), before=True)
    assert lrs[0] == min_lr
    assert lrs[cycle_step_size] == max_lr
    assert strictly_increasing(lrs[:cycle_step_size])
    assert strictly_decreasing(lrs[cycle_step_size:2 * cycle_step_size])
    if decay_rate > 0:
        assert strictly_decreasing(lrs[2 * cycle_step_size:])


@pytest.mark.parametrize("decay_rate,step_size", [(1e-3, 10), (0, 21)])
def test_one_cycle_momentum(decay_rate, step_size):
    """test_lr_schedulers.py TestOneCycle::test_mom, read through the config
    scheduler's get_mom() as DeepSpeed's test does: momentum starts at
    cycle_max_mom, is at cycle_min_mom at the peak, then rises again. Also
    engine.get_mom(), the betas each step runs with (DeepSpeed's engine reads
    them from the optimizer): cycle_min_mom for the first step (DeepSpeed's
    OneCycle puts them there when it is built), then the scheduler's."""
    min_mom, max_mom = 0.08, 0.09
    engine, _, _, lr_scheduler = deepspeed.initialize(
        config=config(("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                    "cycle_min_mom": min_mom, "cycle_max_mom": max_mom,
                                    "decay_mom_rate": decay_rate,
                                    "cycle_first_step_size": step_size,
                                    "decay_step_size": step_size})),
        model=SimpleModel())
    moms, used = [], []
    for x, y in batches(max(50, 3 * step_size)):
        moms.append(lr_scheduler.get_mom()[0][0])
        used.append(engine.get_mom()[0])
        engine.backward(engine(x, y))
        engine.step()
    engine.destroy()
    assert moms[0] == max_mom
    assert moms[step_size] == min_mom
    assert strictly_decreasing(moms[:step_size])
    assert strictly_increasing(moms[step_size:2 * step_size])
    if decay_rate > 0:
        assert strictly_increasing(moms[2 * step_size:])
    assert used[0] == (min_mom, 0.99)
    assert [b1 for b1, _ in used[1:]] == moms[1:]


def test_one_cycle_momentum_is_what_the_step_uses():
    """The betas engine.get_mom() reports are those the step runs with: an
    engine with OneCycle's momentum cycling ends where plain Adam steps with
    those betas, step by step, end (DeepSpeed's optimizer takes its betas from
    the param groups the scheduler sets)."""
    sched = ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_min_mom": 0.5,
                          "cycle_max_mom": 0.95, "cycle_first_step_size": 3})
    torch.manual_seed(5)
    model = SimpleModel()
    ref = copy.deepcopy(model)
    engine, _, _, lr_scheduler = deepspeed.initialize(config=config(sched), model=model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for x, y in batches(8):
        (b1, b2), lr = engine.get_mom()[0], engine.get_lr()[0]
        for g in opt.param_groups:
            g["betas"], g["lr"] = (b1, b2), lr
        opt.zero_grad()
        ref(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # the config's clipping
        opt.step()
        engine.backward(engine(x, y))
        engine.step()
    got = engine.state_dict()
    engine.destroy()
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name].float(), p.detach(), atol=1e-6), name


# ---- checkpoint/test_latest_checkpoint.py, test_tag_validation.py, test_lr_scheduler.py --


def check_same_model_states(saved, loaded):
    """checkpoint/common.py compare_model_states: the counters and every
    parameter (gathered, as DeepSpeed does for ZeRO-3 parameters)."""
    assert saved.skipped_steps == loaded.skipped_steps
    assert saved.global_steps == loaded.global_steps
    assert saved.global_samples == loaded.global_samples
    to_fetch = [p for p in list(saved.module.parameters()) + list(loaded.module.parameters())
                if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with deepspeed.zero.GatheredParameters(to_fetch, enabled=bool(to_fetch)):
        for (n0, p0), (n1, p1) in zip(saved.module.named_parameters(),
                                      loaded.module.named_parameters()):
            assert n0 == n1 and p0 is not p1
            assert torch.allclose(p0, p1, atol=1e-7), n0


def test_existing_and_missing_latest(tmp_path):
    """test_latest_checkpoint.py TestLatestCheckpoint::test_existing_latest and
    test_missing_latest: saved with tag None (so `latest` names it), loaded with
    tag None; the optimizer states come back too (the next steps agree), and
    where no `latest` exists load_checkpoint is a no-op."""
    torch.manual_seed(0)
    saved, _, _, _ = deepspeed.initialize(config=config(), model=SimpleModel(),
                                          model_parameters=None)
    train(saved, 25)
    saved.save_checkpoint(tmp_path / "saved_checkpoint", tag=None)
    assert (tmp_path / "saved_checkpoint" / "latest").read_text() == "global_step25"
    torch.manual_seed(1)
    loaded, _, _, _ = deepspeed.initialize(config=config(), model=SimpleModel())
    path, client = loaded.load_checkpoint(tmp_path / "saved_checkpoint", tag=None,
                                          load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
    assert "global_step25" in path and client == {}
    check_same_model_states(saved, loaded)
    # The Adam moments came back: both engines take the same next steps.
    assert train(saved, 3, seed=7) == train(loaded, 3, seed=7)
    check_same_model_states(saved, loaded)
    saved.destroy()
    loaded.destroy()

    fresh, _, _, _ = deepspeed.initialize(config=config(), model=SimpleModel())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    assert fresh.load_checkpoint(tmp_path / "empty") == (None, None)
    assert fresh.global_steps == 0
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    fresh.destroy()


@pytest.mark.parametrize("valid_mode", ["FAIL", "WARN", "IGNORE"])
def test_checkpoint_unique_tag(tmp_path, capfd, valid_mode):
    """test_tag_validation.py TestCheckpointValidationTag::test_checkpoint_unique_tag,
    on one rank. DeepSpeed's FAIL case needs two ranks saving different tags; on
    one rank the tag is the same everywhere and every mode saves. Strata does
    not implement checkpoint.tag_validation: its config reports the key as a
    DeepSpeed key it does not use (ignored), as it does for steps_per_print."""
    engine, _, _, _ = deepspeed.initialize(
        config=config(checkpoint={"tag_validation": valid_mode}), model=SimpleModel())
    assert "DeepSpeed key checkpoint is not used by Strata (ignored)" in capfd.readouterr().err
    train(engine, 1)
    engine.save_checkpoint(save_dir=tmp_path, tag="tag-0")
    assert (tmp_path / "latest").read_text() == "tag-0" and (tmp_path / "tag-0").is_dir()
    engine.destroy()


def test_checkpoint_unknown_tag_validation(capfd):
    """test_tag_validation.py TestCheckpointValidationTag::
    test_checkpoint_unknown_tag_validation. DeepSpeed refuses an unknown mode
    with DeepSpeedConfigError; Strata reads nothing under "checkpoint" (a
    deliberately unused DeepSpeed key) and says the whole key is ignored."""
    engine, _, _, _ = deepspeed.initialize(
        config=config(checkpoint={"tag_validation": "foo"}), model=SimpleModel())
    assert "DeepSpeed key checkpoint is not used by Strata (ignored)" in capfd.readouterr().err
    engine.destroy()


def test_tags_that_leave_the_directory_are_refused(tmp_path):
    """test_tag_validation.py, Strata's own tag rule in its place: a tag is one
    directory name under save_dir."""
    engine, _, _, _ = deepspeed.initialize(config=config(), model=SimpleModel())
    train(engine, 1)
    for tag in ("", "..", "a/b"):
        with pytest.raises(deepspeed.InvalidArgumentError, match="checkpoint tag"):
            engine.save_checkpoint(tmp_path, tag=tag)
    engine.destroy()


WARMUP = ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000})


def models_for(stage):
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config(stage=3)):
            return [SimpleModel() for _ in range(2)]
    return [SimpleModel() for _ in range(2)]


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (2, True),
                                           (3, False), (3, True)])
def test_checkpoint_lr_scheduler(tmp_path, stage, offload):
    """test_lr_scheduler.py TestLRSchedulerCheckpoint::test_checkpoint_lr_scheduler
    (with a client_state round trip): the WarmupLR state is restored with the
    checkpoint. DeepSpeed loads it with load_optimizer_states=False; Strata
    refuses that without load_module_only (docs/python.md: the optimizer states are
    restored with the step counters), so it loads them too."""
    cfg = config(WARMUP, stage=stage)
    cfg["optimizer"]["params"].update(betas=[0.8, 0.999], eps=1e-8, weight_decay=3e-7)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    models = models_for(stage)
    saved, _, _, _ = deepspeed.initialize(config=cfg, model=models[0])
    train(saved, 6)
    saved.empty_partition_cache()
    saved.save_checkpoint(tmp_path / "saved_checkpoint", tag="1",
                          client_state={"epoch": 4, "note": "x"})
    loaded, _, _, _ = deepspeed.initialize(config=cfg, model=models[1])
    assert (list(saved.parameters())[0].dtype == list(loaded.parameters())[0].dtype)
    with pytest.raises(deepspeed.NotSupportedError, match="load_module_only"):
        loaded.load_checkpoint(tmp_path / "saved_checkpoint", tag="1",
                               load_optimizer_states=False, load_lr_scheduler_states=True)
    assert loaded.lr_scheduler.state_dict() == {"last_batch_iteration": -1}
    _, client = loaded.load_checkpoint(tmp_path / "saved_checkpoint", tag="1",
                                       load_lr_scheduler_states=True)
    assert client == {"epoch": 4, "note": "x"}
    check_same_model_states(saved, loaded)
    assert saved.lr_scheduler.state_dict() == loaded.lr_scheduler.state_dict()
    assert loaded.lr_scheduler.state_dict() == {"last_batch_iteration": 5}
    assert loaded.get_lr() == saved.get_lr()
    saved.destroy()
    loaded.destroy()


def test_checkpoint_no_lr_scheduler(tmp_path):
    """test_lr_scheduler.py TestLRSchedulerCheckpoint::test_checkpoint_no_lr_scheduler:
    with load_lr_scheduler_states=False the model states are restored."""
    cfg = config(WARMUP, stage=2)
    models = models_for(2)
    saved, _, _, _ = deepspeed.initialize(config=cfg, model=models[0])
    train(saved, 4)
    saved.save_checkpoint(tmp_path, tag="1")
    loaded, _, _, _ = deepspeed.initialize(config=cfg, model=models[1])
    loaded.load_checkpoint(tmp_path, tag="1", load_lr_scheduler_states=False)
    check_same_model_states(saved, loaded)
    # (DeepSpeed's test checks no more. A config schedule on Strata is a function of
    # the engine's step, which the checkpoint restores, so it continues from there
    # whatever load_lr_scheduler_states says; DeepSpeed's would start afresh.)
    assert loaded.lr_scheduler.state_dict() == saved.lr_scheduler.state_dict()
    saved.destroy()
    loaded.destroy()


# ---- checkpoint/test_shared_weights.py (zero_to_fp32) ---------------------------------------


class SharedWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer0 = torch.nn.Linear(10, 10)
        self.layer1 = torch.nn.Linear(20, 20)
        self.layer2 = torch.nn.Linear(20, 20)
        self.layer1.weight = self.layer2.weight  # tied

    def forward(self, x):
        h = self.layer0(x).repeat(1, 2)
        return (self.layer2(self.layer1(h)) ** 2).mean()


def test_checkpoint_shared_weights(tmp_path):
    """test_shared_weights.py TestCheckpointSharedWeights: a model with tied
    weights, a client Adam, stage 2; get_fp32_state_dict_from_zero_checkpoint
    with tag= loads strictly into a fresh model, and (beyond DeepSpeed's test)
    equals the trained weights."""
    model = SharedWeights()
    optimizer = torch.optim.Adam(model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        config={"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 2}, "strata": dict(HOST)},
        model=model, optimizer=optimizer)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 10, generator=g)))
        engine.step()
    trained = {k: v.clone() for k, v in engine.state_dict().items()}
    ckpt = tmp_path / "checkpoint.pt"
    engine.save_checkpoint(ckpt, tag="checkpoint")
    engine.destroy()

    fresh = SharedWeights()
    state_dict = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="checkpoint")
    fresh.load_state_dict(state_dict, strict=True)
    assert fresh.layer1.weight is fresh.layer2.weight
    for k, v in trained.items():
        assert torch.equal(state_dict[k], v.float()), k


# ---- runtime/zero/test_zero_context.py, test_zero.py ---------------------------------------


class ConvX(torch.nn.Conv1d):
    """A subclass of a torch module adding a parameter of its own."""

    def __init__(self, *args):
        super().__init__(*args)
        self.param_in = torch.nn.Parameter(torch.rand(5))

    def forward(self, x):
        return super().forward(x).sum() + self.param_in.sum()


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvX(1, 3, 4)
        self.param = torch.nn.Parameter(torch.rand(5))

    def forward(self, x):
        return self.conv1(x) + self.param.sum()


ZERO3 = {"train_batch_size": 1, "zero_optimization": {"stage": 3},
         "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "strata": HOST}


def test_subclass_param_under_init():
    """test_zero_context.py TestSerialContext::test_subclass_param: right after
    zero.Init every parameter, a subclass's own one included, is partitioned
    (Strata: spilled, with DeepSpeed's attributes; their shape stays)."""
    with deepspeed.zero.Init(config=ZERO3):
        model = ConvNet()
    assert model.param.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert model.conv1.param_in.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert model.param.ds_shape == (5,) and model.conv1.param_in.ds_numel == 5
    ids = [p.ds_id for p in model.parameters()]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) for i in ids)
    # Reading the values reads them back: an ordinary parameter again.
    model.param.sum()
    assert not hasattr(model.param, "ds_status")


def test_subclass_param_partitioned_by_the_engine():
    """test_zero_context.py TestSerialContext::test_subclass_param, once the
    engine holds the model built under zero.Init: no parameter of a module
    subclass is missed, and the model trains."""
    with deepspeed.zero.Init(config=ZERO3):
        model = ConvNet()
    engine, _, _, _ = deepspeed.initialize(config=ZERO3, model=model)
    for name, p in model.named_parameters():
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
    assert model.param.ds_shape == (5,) and model.conv1.param_in.ds_numel == 5
    before = engine.state_dict()["conv1.param_in"].clone()
    engine.backward(engine(torch.randn(1, 1, 8)))
    engine.step()
    assert engine.global_steps == 1
    assert not torch.equal(engine.state_dict()["conv1.param_in"], before)
    engine.destroy()


def test_gathered_parameters_free():
    """test_zero_context.py TestZeroGatheredParametersFree: inside
    GatheredParameters a parameter has its full size, outside it is 0-sized
    again. (Strata's parameters become placeholders once the engine holds them:
    under zero.Init alone they keep their shape.)"""
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(config=ZERO3, model=model)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert model.linears[0].weight.numel() != 0
    assert model.linears[0].weight.numel() == 0
    engine.destroy()


def test_gathered_parameters_modifier_rank():
    """test_zero_context.py (GatheredParameters with modifier_rank) and
    test_zero.py's modifier_rank=0 initialisation: reads give the full values,
    writes by the modifier rank become the parameters, before and after
    initialize."""
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = SimpleModel()
    with deepspeed.zero.GatheredParameters(model.linears[0].bias, modifier_rank=0):
        model.linears[0].bias.data.fill_(0.5)
    engine, _, _, _ = deepspeed.initialize(config=ZERO3, model=model)
    assert torch.all(engine.state_dict()["linears.0.bias"] == 0.5)
    want = engine.state_dict()["linears.0.weight"].clone()
    with deepspeed.zero.GatheredParameters(model.linears[0].weight, modifier_rank=0):
        assert model.linears[0].weight.ds_status == ZeroParamStatus.AVAILABLE
        assert torch.equal(model.linears[0].weight.data, want)
        model.linears[0].weight.data.mul_(2)
    assert torch.equal(engine.state_dict()["linears.0.weight"], 2 * want)
    # Without modifier_rank, changes are not kept (DeepSpeed's read-only gather).
    with deepspeed.zero.GatheredParameters(model.linears[0].weight):
        model.linears[0].weight.data.zero_()
    assert torch.equal(engine.state_dict()["linears.0.weight"], 2 * want)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_no_optim_under_init(stage):
    """test_ds_initialize.py TestNoOptim: a model built under zero.Init (enabled
    at stage 3 only) with no optimizer anywhere runs forward passes. (fp32 here:
    the host device has no fp16, and bf16 would change nothing checked.)"""
    cfg = {"train_batch_size": 1,
           "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}},
           "strata": dict(HOST)}
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=cfg):
        model = SimpleModel(4, nlayers=8)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
    for x, y in batches(5, micro=1, hidden=4):
        assert torch.isfinite(engine(x, y))
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_adam_optimizer_step_count(stage):
    """test_zero.py TestZeroAdamOptimizerStepCount: global_steps starts at 0 and
    counts optimizer steps, which happen at the gradient-accumulation boundary
    (every 2nd micro-step here); global_samples and micro_steps as DeepSpeed
    counts them."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "sub_group_size": 4},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "strata": dict(HOST)}
    model = SimpleModel(4, nlayers=12)
    engine, _, _, _ = deepspeed.initialize(config=cfg, model=model,
                                           model_parameters=model.parameters())
    assert engine.global_steps == 0 and engine.micro_steps == 0
    boundaries, steps = [], []
    for k, (x, y) in enumerate(batches(8, micro=2, hidden=4)):
        engine.backward(engine(x, y))
        boundary = engine.is_gradient_accumulation_boundary()
        boundaries.append(boundary)
        engine.step()
        assert engine.was_step_applied() == boundary
        assert engine.micro_steps == k + 1
        if boundary:
            steps.append(engine.global_steps)
            assert engine.global_samples == engine.global_steps * engine.train_batch_size()
    assert boundaries == [False, True] * 4
    assert steps == [1, 2, 3, 4] and engine.global_steps == 4 and engine.global_samples == 16
    engine.destroy()
