"""initialize(optimizer=...): the optimizer a DeepSpeed script builds (a
torch.optim object, a callable, DeepSpeed's DeepSpeedCPUAdam / FusedAdam)
runs as Strata's optimizer with torch's arithmetic, and the object the
script holds keeps working: an lr scheduler bound to it drives the engine,
its zero_grad() clears the engine's window, its step() is refused.
"""

import copy

import pytest
import torch

import strata
import strata.deepspeed as deepspeed

STEPS = 6
BATCH = 8


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(),
                                        torch.nn.Linear(24, 24), torch.nn.GELU())
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.head(self.body(x))


def batches(n=STEPS):
    g = torch.Generator().manual_seed(17)
    return [(torch.randn(BATCH, 12, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(n)]


def config(stage=2, offload="cpu"):
    cfg = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage},
           "strata": {"device": "host", "hbm_budget": "64M", "threads": 1}}
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = "."
    return cfg


def torch_losses(model, opt, sched=None):
    losses = []
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def strata_losses(engine):
    losses = []
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def max_difference(a, b):
    return max((x.detach() - y.detach()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def decay(step):
    return 1.0 / (1.0 + step)


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu"),
                                           (3, "nvme")])
def test_adamw_with_a_lambdalr_bound_to_it_trains_as_torch(stage, offload, tmp_path,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1)
    model = MLP()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    want = torch_losses(ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, decay))

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=opt,
                                                   lr_scheduler=sched,
                                                   config=config(stage, offload))
    assert scheduler is sched and engine.client_optimizer is opt
    got = strata_losses(engine)
    # The scheduler stepped with the engine, on the object the script holds.
    assert sched.last_epoch == STEPS and opt.param_groups[0]["lr"] == pytest.approx(
        3e-3 * decay(STEPS))
    engine.close()
    assert got == pytest.approx(want, abs=1e-6)
    assert max_difference(model, ref) < 1e-6


def test_adam_with_l2_decay_and_two_groups_trains_as_torch():
    torch.manual_seed(2)
    model = MLP()
    ref = copy.deepcopy(model)

    def groups(m):
        return [{"params": m.body.parameters(), "lr": 2e-3, "weight_decay": 0.05},
                {"params": m.head.parameters(), "lr": 5e-3, "betas": (0.8, 0.99)}]

    want = torch_losses(ref, torch.optim.Adam(groups(ref), eps=1e-7))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(groups(model), eps=1e-7), config=config())
    assert engine.config["optimizer"]["type"] == "Adam"
    assert engine.config["optimizer"]["params"]["adam_w_mode"] is False
    assert [g["lr"] for g in optimizer.param_groups] == [2e-3, 5e-3]
    got = strata_losses(engine)
    engine.close()
    assert got == pytest.approx(want, abs=1e-6)
    assert max_difference(model, ref) < 1e-6


@pytest.mark.parametrize("make", ["callable", "DeepSpeedCPUAdam", "FusedAdam",
                                  "DeepSpeedCPUAdam-l2"])
def test_a_callable_and_deepspeeds_classes(make):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # as DeepSpeed scripts import
    torch.manual_seed(3)
    model = MLP()
    ref = copy.deepcopy(model)
    l2 = make.endswith("-l2")
    ref_cls = torch.optim.Adam if l2 else torch.optim.AdamW
    want = torch_losses(ref, ref_cls(ref.parameters(), lr=4e-3, weight_decay=0.02))
    if make == "callable":
        optimizer = lambda params: torch.optim.AdamW(params, lr=4e-3, weight_decay=0.02)  # noqa
    elif make == "FusedAdam":
        optimizer = FusedAdam(model.parameters(), lr=4e-3, weight_decay=0.02)
    else:
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=4e-3, weight_decay=0.02,
                                     adamw_mode=not l2)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           optimizer=optimizer, config=config())
    got = strata_losses(engine)
    engine.close()
    assert got == pytest.approx(want, abs=1e-6)
    assert max_difference(model, ref) < 1e-6


def test_deepspeeds_classes_step_alone_as_torchs():
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    for adamw_mode, ref_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        torch.manual_seed(4)
        model = MLP()
        ref = copy.deepcopy(model)
        got = torch_losses(model, DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1,
                                                   adamw_mode=adamw_mode))
        want = torch_losses(ref, ref_cls(ref.parameters(), lr=1e-2, weight_decay=0.1))
        assert got == want


def test_the_object_the_script_holds():
    torch.manual_seed(5)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = config()
    cfg["optimizer"] = {"type": "Lion", "params": {"lr": 1e-4}}
    with pytest.warns(UserWarning, match="\"optimizer\" section is ignored"):
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert engine.config["optimizer"]["type"] == "AdamW"
    x, y = batches(1)[0]
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    with pytest.raises(deepspeed.NotSupportedError, match="call engine.step\\(\\)"):
        opt.step()
    # zero_grad() of the object clears the engine's window: a step without
    # a backward after it is refused, as an empty window is.
    opt.zero_grad()
    with pytest.raises(strata.FailedPreconditionError):
        engine.step()
    # An lr set by hand on the object reaches the next step.
    opt.param_groups[0]["lr"] = 7e-4
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()
    assert engine.last_stats["lr"] == pytest.approx(7e-4)
    engine.close()


def test_what_cannot_run_is_refused_naming_it():
    model = MLP()
    with pytest.raises(deepspeed.NotSupportedError, match="torch.optim.sgd.SGD"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=config())
    with pytest.raises(deepspeed.NotSupportedError,
                       match="param_groups\\[0\\]\\['amsgrad'\\] = True"):
        deepspeed.initialize(model=model, config=config(),
                             optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(deepspeed.NotSupportedError, match="MyAdam"):
        deepspeed.initialize(model=model, optimizer=MyAdam(model.parameters()), config=config())
    with pytest.raises(strata.InvalidArgumentError, match="returned a list"):
        deepspeed.initialize(model=model, optimizer=lambda params: list(params), config=config())
