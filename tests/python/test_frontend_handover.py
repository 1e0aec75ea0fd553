"""The frontend's gradient hand-over inside a module's backward.

Once every parameter of an engine module has its gradient, the gradients go
to the engine and the module's views are released, even while its backward
is still running: every autograd node that used a parameter with a gradient
ran before that gradient was finished. A saved view of a parameter used
without a gradient path (an op on `weight.detach()`) may still be unpacked
afterwards; the frontend then fetches the module again. Both must train as
plain PyTorch does.
"""

import copy

import pytest
import torch

import strata


class DetachedUse(torch.nn.Module):
    """x @ w.detach().t() first (autograd saves a view of w and runs this
    node last), then tanh(h) @ w.t() (whose backward finishes w's gradient)."""

    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        h = x @ self.w.detach().t()
        return torch.tanh(h) @ self.w.t()


class Model(torch.nn.Module):

    def __init__(self, d=8):
        super().__init__()
        self.a = DetachedUse(d)
        self.b = torch.nn.Linear(d, d)

    def forward(self, x, t):
        return ((self.b(self.a(x)) - t)**2).mean()


class _Recorder:
    """The engine binding with its calls recorded (name, module)."""

    def __init__(self, target, log):
        self._target = target
        self._log = log

    def __getattr__(self, name):
        f = getattr(self._target, name)
        if not callable(f):
            return f

        def call(*args):
            self._log.append((name,) + args)
            return f(*args)

        return call


@pytest.mark.parametrize("gas", [1, 2])
def test_parameter_needed_after_its_gradients_are_handed_over(gas):
    torch.manual_seed(3)
    model = Model()
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"},
                                 "stage3_max_reuse_distance": 0,
                                 "stage3_param_persistence_threshold": 0},
           "strata": {"device": "host", "threads": 2}}
    engine = strata.initialize(model, cfg)
    log = []
    engine._engine = _Recorder(engine._engine, log)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        for _ in range(gas):
            x = torch.randn(5, 8, generator=g, requires_grad=True)
            t = torch.randn(5, 8, generator=g)
            got = engine(x, t)
            engine.backward(got)
            engine.step()
            want = ref(x, t)
            (want / gas).backward()
            assert got.item() == pytest.approx(want.item(), rel=1e-6)
        opt.step()
        opt.zero_grad(set_to_none=True)
    # The path under test was taken: module 0 (DetachedUse) fetched again
    # after its gradients were handed over in the same backward.
    a = engine._group_of_param[id(model.a.w)].index
    calls = [c for c in log if c[0] != "loss_scale" and len(c) > 1 and c[1] == a]
    handed = calls.index(("before_backward_grads", a))
    assert ("before_forward", a) in calls[handed:]
    sd, ref_sd = engine.state_dict(), ref.state_dict()
    for k in sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-5, atol=1e-6, msg=k)
