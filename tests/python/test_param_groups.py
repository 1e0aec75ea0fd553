"""Optimizer parameter groups through strata.initialize(model_parameters=...)
against torch.optim.AdamW with the same groups, on the host device: the
Hugging Face-style no-decay groups, a group's own lr, betas and eps, torch
schedulers with one lambda per group, a config schedule that scales each
group's lr (WarmupCosineLR), the errors for malformed groups, and groups in
a checkpoint's identity."""

import copy

import pytest
import torch

import strata
from test_torch_frontend import GPT, PLACEMENTS, assert_close, batches, config


def no_decay_groups(model, lr=None):
    """As transformers' Trainer builds them: biases, norm weights and
    embeddings without weight decay (and, here, a lr of their own)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "ln" in name or "wte" in name or "wpe" in name
         else decay).append(p)
    nd = {"params": no_decay, "weight_decay": 0.0}
    if lr is not None:
        nd["lr"] = lr
    return [{"params": decay, "weight_decay": 0.1}, nd]


def torch_optimizer(groups, cfg):
    p = cfg["optimizer"]["params"]
    return torch.optim.AdamW(groups, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                             weight_decay=p["weight_decay"])


def train_both(model, engine, ref_opt, data, ref_sched=None, sched=None):
    for idx, tgt in data:
        want = model(idx, tgt)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        got = engine(idx, tgt)
        engine.backward(got)
        stats = engine.step()
        if ref_sched is not None:
            assert engine.get_lr() == pytest.approx(
                [g["lr"] for g in ref_opt.param_groups], rel=1e-15)
            ref_sched.step()
            sched.step()
        yield got.item(), want.item(), stats


def assert_params_close(engine, ref, rtol=1e-5, atol=1e-6):
    sd, ref_sd = engine.state_dict(), ref.state_dict()
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("opt,par", PLACEMENTS + [("nvme", "nvme")])
def test_no_decay_groups_match_torch(opt, par, tmp_path):
    torch.manual_seed(21)
    model = GPT()
    ref = copy.deepcopy(model)
    cfg = config(opt, par, tmp_path, lr=3e-3, wd=0.1)
    ref_opt = torch_optimizer(no_decay_groups(ref, lr=1e-3), cfg)
    engine = strata.initialize(model, cfg, model_parameters=no_decay_groups(model, lr=1e-3))
    assert [len(g["params"]) for g in engine.optimizer.param_groups] == \
        [len(g["params"]) for g in ref_opt.param_groups]
    assert engine.get_lr() == [3e-3, 1e-3]
    got, want = [], []
    for g, w, stats in train_both(ref, engine, ref_opt, batches(8)):
        got.append(g)
        want.append(w)
        assert stats["group_lrs"] == [3e-3, 1e-3]
    assert_close(got, want)
    assert_params_close(engine, ref)
    engine.close()


def test_group_betas_and_eps_match_torch():
    torch.manual_seed(22)
    model = GPT()
    ref = copy.deepcopy(model)
    cfg = config("cpu", "cpu", lr=3e-3, wd=0.01)

    def groups(m):
        blocks = [p for n, p in m.named_parameters() if n.startswith("blocks.")]
        rest = [p for n, p in m.named_parameters() if not n.startswith("blocks.")]
        return [{"params": blocks, "betas": (0.8, 0.9), "eps": 1e-3}, {"params": rest}]

    ref_opt = torch_optimizer(groups(ref), cfg)
    engine = strata.initialize(model, cfg, model_parameters=groups(model))
    got, want = zip(*[(g, w) for g, w, _ in train_both(ref, engine, ref_opt, batches(6))])
    assert_close(list(got), list(want))
    assert_params_close(engine, ref)


def test_torch_scheduler_with_one_lambda_per_group():
    torch.manual_seed(23)
    model = GPT()
    ref = copy.deepcopy(model)
    cfg = config("cpu", "none", lr=3e-3, wd=0.1)
    lambdas = [lambda s: 0.9**s, lambda s: min(1.0, (s + 1) / 4)]
    ref_opt = torch_optimizer(no_decay_groups(ref), cfg)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambdas)
    engine = strata.initialize(model, cfg, model_parameters=no_decay_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambdas)
    seen = []
    for g, w, stats in train_both(ref, engine, ref_opt, batches(6), ref_sched, sched):
        assert g == pytest.approx(w, rel=1e-5)
        seen.append(tuple(stats["group_lrs"]))
    assert len({s[0] for s in seen}) > 3 and len({s[1] for s in seen}) > 3
    assert all(a != b for a, b in seen)  # the groups' lrs differ
    assert_params_close(engine, ref)


def test_warmup_cosine_scales_each_groups_lr():
    """DeepSpeed's WarmupCosineLR multiplies each group's own lr by its ratio."""
    torch.manual_seed(24)
    model = GPT()
    cfg = config("cpu", "cpu", lr=2e-3)
    cfg["scheduler"] = {"type": "WarmupCosineLR",
                        "params": {"total_num_steps": 8, "warmup_num_steps": 3}}
    engine = strata.initialize(model, cfg, model_parameters=no_decay_groups(model, lr=5e-4))
    for idx, tgt in batches(5):
        engine.backward(engine(idx, tgt))
        stats = engine.step()
        lr0, lr1 = stats["group_lrs"]
        assert lr1 == pytest.approx(lr0 * 5e-4 / 2e-3, rel=1e-12)
    assert engine.get_lr()[0] > 0


def test_a_plain_parameter_list_is_one_group():
    torch.manual_seed(25)
    model = GPT()
    ref = copy.deepcopy(model)
    cfg = config("cpu", "cpu")
    ref_opt = torch_optimizer(ref.parameters(), cfg)
    engine = strata.initialize(model, cfg, model_parameters=model.parameters())
    assert len(engine.optimizer.param_groups) == 1
    got, want = zip(*[(g, w) for g, w, _ in train_both(ref, engine, ref_opt, batches(3))])
    assert_close(list(got), list(want))


def test_malformed_groups_are_refused():
    model = GPT()
    cfg = config("cpu", "cpu")
    params = list(model.parameters())
    with pytest.raises(strata.InvalidArgumentError, match="is also in model_parameters"):
        strata.initialize(model, cfg, model_parameters=[{"params": params},
                                                        {"params": params[:1]}])
    with pytest.raises(strata.InvalidArgumentError, match="require grad but are in no group"):
        strata.initialize(model, cfg, model_parameters=[{"params": params[1:]}])
    with pytest.raises(strata.InvalidArgumentError, match=r"\['momentum'\]: not supported"):
        strata.initialize(model, cfg, model_parameters=[{"params": params, "momentum": 0.9}])
    with pytest.raises(strata.InvalidArgumentError, match="not a parameter of the model"):
        strata.initialize(model, cfg, model_parameters=[{"params": params + [torch.zeros(3)]}])
    with pytest.raises(strata.InvalidArgumentError, match="not a mix"):
        strata.initialize(model, cfg, model_parameters=[params[0], {"params": params[1:]}])
    with pytest.raises(strata.InvalidArgumentError, match="weight_decay -1"):
        strata.initialize(model, cfg, model_parameters=[{"params": params, "weight_decay": -1}])
    sched = dict(cfg, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    with pytest.raises(strata.FailedPreconditionError, match="WarmupLR"):
        strata.initialize(model, sched, model_parameters=no_decay_groups(model, lr=1e-3))
    # Frozen parameters listed in a group stay with torch, as torch.optim skips them.
    model.wpe.requires_grad_(False)
    engine = strata.initialize(model, cfg, model_parameters=no_decay_groups(model))
    assert all(p is not model.wpe for g in engine.optimizer.param_groups for p in g["params"])
    engine.close()


def test_groups_are_part_of_the_checkpoint_identity(tmp_path):
    torch.manual_seed(26)
    model = GPT()
    twin = copy.deepcopy(model)
    cfg = config("cpu", "cpu")
    engine = strata.initialize(model, cfg, model_parameters=no_decay_groups(model))
    idx, tgt = batches(1)[0]
    engine.backward(engine(idx, tgt))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    other = strata.initialize(twin, cfg, model_parameters=no_decay_groups(twin, lr=1e-4))
    with pytest.raises(strata.FailedPreconditionError, match="optimizer parameter groups"):
        other.load_checkpoint(tmp_path / "ckpt")
    other.close()
    same = strata.initialize(twin, cfg, model_parameters=no_decay_groups(twin))
    info = same.load_checkpoint(tmp_path / "ckpt")
    assert info["optimizer_step"] == 1
    same.close()
