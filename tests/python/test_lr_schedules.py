"""deepspeed.runtime.lr_schedules and deepspeed.runtime.utils on Strata:
the schedule objects a script builds on its own optimizer give DeepSpeed's
learning rates (checked against the formulas written out here), work with
plain torch, drive the engine through initialize(lr_scheduler=...) exactly
as the config's "scheduler" section does, refuse a bad value naming its
key, and refuse (never ignore) a momentum cycle the engine cannot follow.
"""

import copy
import logging
import math
import sys

import pytest
import torch

import strata
import strata.deepspeed as deepspeed
from strata.deepspeed.runtime import lr_schedules
from strata.deepspeed.runtime.lr_schedules import (LRRangeTest, OneCycle, WarmupCosineLR,
                                                   WarmupDecayLR, WarmupLR)


def optimizer(groups=1, lr=0.01):
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(groups)]
    return torch.optim.AdamW([{"params": [p]} for p in params], lr=lr)


def warmup_gamma(i, n, kind):
    n = max(2, n)
    if i >= n:
        return 1.0
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


def expect_lrs(sched, opt, want, steps=40):
    """Steps `sched` and compares every group's lr with want(i) (a list)."""
    for i in range(steps):
        sched.step()
        assert sched.last_batch_iteration == i
        got = [g["lr"] for g in opt.param_groups]
        assert got == pytest.approx(want(i), rel=1e-12, abs=1e-15), f"iteration {i}"
        assert sched.get_last_lr() == got


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_per_group(kind):
    opt = optimizer(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[1e-4, 0.0], warmup_max_lr=[1e-2, 5e-3], warmup_num_steps=10,
                     warmup_type=kind)
    # Built at iteration -1: the minimum is in the groups already.
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 0.0]
    expect_lrs(sched, opt, lambda i: [lo + (hi - lo) * warmup_gamma(i, 10, kind)
                                      for lo, hi in ((1e-4, 1e-2), (0.0, 5e-3))])


def test_warmup_decay_lr():
    opt = optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=30, warmup_min_lr=1e-4, warmup_max_lr=1e-2,
                          warmup_num_steps=8)

    def want(i):
        gamma = warmup_gamma(i, 8, "log") if i < 8 else max(0.0, (30 - i) / max(1.0, 30 - 8))
        return [1e-4 + (1e-2 - 1e-4) * gamma]
    expect_lrs(sched, opt, want)


def test_warmup_cosine_lr_scales_each_groups_own_lr():
    opt = optimizer(groups=2)
    opt.param_groups[1]["lr"] = 0.003
    sched = WarmupCosineLR(opt, total_num_steps=40, warmup_min_ratio=0.1, warmup_num_steps=5,
                           cos_min_ratio=0.01, warmup_type="linear")

    def ratio(i):
        if i < 5:
            return 0.1 + (i / 5) * 0.9
        return max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * (i - 5 + 1) / (40 - 5))) / 2)
    expect_lrs(sched, opt, lambda i: [0.01 * ratio(i), 0.003 * ratio(i)], steps=40)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = optimizer()
    sched = LRRangeTest(opt, lr_range_test_min_lr=1e-4, lr_range_test_step_size=3,
                        lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase)

    def want(i):
        interval = (i + 1) / 3
        return [1e-4 * (1 + 2.0 * (math.floor(interval) if staircase else interval))]
    expect_lrs(sched, opt, want)


def test_one_cycle_lr_and_momentum_then_decay():
    opt = optimizer()
    sched = OneCycle(opt, cycle_min_lr=1e-3, cycle_max_lr=1e-2, decay_lr_rate=0.5,
                     cycle_first_step_size=6, cycle_second_step_size=4, decay_step_size=3,
                     cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.01)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["betas"] == (0.85, 0.99)
    total = 10.0

    def scale(i):
        b = i + 1
        cycle = math.floor(1 + b / total)
        x = 1.0 + b / total - cycle
        ratio = 6 / total
        return x / ratio if x <= ratio else (x - 1) / (ratio - 1)

    for i in range(30):
        sched.step()
        g = opt.param_groups[0]
        if i < total:
            lr = 1e-3 + (1e-2 - 1e-3) * scale(i)
            mom = 0.95 - (0.95 - 0.85) * scale(i)
        else:
            interval = (i - total + 1) / 3
            lr = 1e-3 / (1 + 0.5 * interval)
            mom = 0.95 * (1 + 0.01 * interval)
        assert g["lr"] == pytest.approx(lr, rel=1e-12), i
        assert g["betas"][0] == pytest.approx(mom, rel=1e-12) and g["betas"][1] == 0.99, i


def test_state_dict_resumes_the_schedule():
    opt = optimizer()
    a = WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=5)
    for _ in range(7):
        a.step()
    sd = a.state_dict()
    assert sd == {"last_batch_iteration": 6}
    opt2 = optimizer()
    b = WarmupDecayLR(opt2, total_num_steps=20, warmup_num_steps=5)
    b.load_state_dict(sd)
    a.step()
    b.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_bad_values_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_num_steps"):
        WarmupLR(optimizer(), warmup_num_steps=-3)
    with pytest.raises(ValueError, match="expected 2 values for warmup_max_lr"):
        WarmupLR(optimizer(groups=2), warmup_max_lr=[0.1, 0.2, 0.3])
    with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
        WarmupLR(object())


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(10, 16)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batches(n=8):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


SCHEDULE = {"total_num_steps": 8, "warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3,
            "warmup_num_steps": 4, "warmup_type": "linear"}


def engine_run(engine):
    losses, lrs = [], []
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        lrs.append(engine.get_lr()[0])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses, lrs


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_scripts_schedule_trains_as_the_configs_and_as_torch(stage):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": stage},
           "strata": {"device": "host", "threads": 1}}
    torch.manual_seed(3)
    model = MLP()
    ref, by_config = copy.deepcopy(model), copy.deepcopy(model)

    # Plain torch with the schedule object.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-3, weight_decay=0.01)
    ref_sched = WarmupDecayLR(ref_opt, **SCHEDULE)
    want, want_lrs = [], []
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        want_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        want.append(loss.item())

    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = WarmupDecayLR(opt, **SCHEDULE)
    engine, _, _, got_sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                   config=dict(cfg))
    assert got_sched is sched
    got, got_lrs = engine_run(engine)

    config = dict(cfg, optimizer={"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
                  scheduler={"type": "WarmupDecayLR", "params": SCHEDULE})
    engine2, _, _, _ = deepspeed.initialize(model=by_config, model_parameters=by_config.parameters(),
                                            config=config)
    cfg_losses, cfg_lrs = engine_run(engine2)

    assert got_lrs == want_lrs == cfg_lrs
    assert got == cfg_losses  # the same lrs: the same bits
    assert got == pytest.approx(want, abs=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a.detach() - b.detach()).abs().max().item() < 1e-6


def test_a_momentum_cycle_the_engine_cannot_follow_is_refused():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = OneCycle(opt, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=4)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched,
        config={"train_batch_size": 8, "strata": {"device": "host", "threads": 1}})
    (x, y), = batches(1)
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()  # the scheduler moves betas after this step
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    with pytest.raises(strata.StrataError, match=r"betas.*changed.*cycle_momentum=False"):
        engine.step()
    engine.close()


def test_the_deepspeed_names_and_runtime_utils(caplog):
    assert sys.modules["deepspeed.runtime.lr_schedules"] is lr_schedules
    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR",
                                               "WarmupDecayLR", "WarmupCosineLR"]
    from deepspeed.runtime.utils import see_memory_usage, set_random_seed
    set_random_seed(11)
    a = torch.rand(3)
    set_random_seed(11)
    assert torch.equal(a, torch.rand(3))
    with caplog.at_level(logging.INFO, logger="strata.deepspeed"):
        see_memory_usage("after init")
        assert "after init" not in caplog.text  # only with force=True, as DeepSpeed
        see_memory_usage("after init", force=True)
    assert "after init" in caplog.text and "CPU resident" in caplog.text
