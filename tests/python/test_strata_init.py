"""strata.init (python/strata/init_context.py): models built inside the
context have their parameters spilled module by module; strata.initialize
streams them into the engine. Against a plain build under the same seed:
the engine's initial parameters and the losses of 3 training steps are
bitwise equal, for several architectures and placements."""

import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import strata
from strata import init_context

VOCAB, D, SEQ, BATCH, STEPS = 37, 16, 6, 2, 3


# ---- architectures -------------------------------------------------------------


class Stack(torch.nn.Module):
    """Embedding, (Linear, LayerNorm) blocks, a head."""

    def __init__(self, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(),
                                torch.nn.Linear(2 * D, D), torch.nn.LayerNorm(D))
            for _ in range(layers))
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class Encoder(torch.nn.Module):
    """torch's nn.TransformerEncoder (it deep-copies the layer it is given)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        layer = torch.nn.TransformerEncoderLayer(D, 2, dim_feedforward=2 * D, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, idx):
        return self.head(self.encoder(self.embed(idx)))


class HFBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc = torch.nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class HFModel(torch.nn.Module):
    """The Hugging Face pattern: post_init() -> self.apply(self._init_weights)
    in the top module's __init__, writing through ``.data``."""

    seen = None  # test hook: called with the module _init_weights gets

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, D)
        self.h = torch.nn.ModuleList(HFBlock() for _ in range(3))
        self.ln_f = torch.nn.LayerNorm(D)
        self.lm_head = torch.nn.Linear(D, VOCAB, bias=False)
        self.post_init()

    def post_init(self):
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if HFModel.seen is not None:
            HFModel.seen(module)
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.05)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, torch.nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.05)
        elif isinstance(module, torch.nn.LayerNorm):
            module.bias.data.uniform_(-0.1, 0.1)  # not zero: a lost write shows
            module.weight.data.fill_(1.0)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class Tied(torch.nn.Module):
    """A head whose weight is the embedding's (tied in the parent's
    __init__), and direct nn.init calls on children's parameters there."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.mid = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        torch.nn.init.normal_(self.embed.weight, std=0.1)
        torch.nn.init.xavier_uniform_(self.mid.weight)
        torch.nn.init.uniform_(self.mid.bias, -0.2, 0.2)

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.embed(idx))))


class OwnParam(torch.nn.Module):
    """Parameters created directly in a parent's __init__, one of them
    scaled in place afterwards, next to a child re-initialized there."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, D) * 0.1)
        self.proj = torch.nn.Linear(D, D)
        self.scale = torch.nn.Parameter(torch.randn(D))
        with torch.no_grad():
            self.proj.weight.mul_(0.5)
            self.scale.add_(1.0)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        return self.head(self.proj(x) * self.scale)


ARCHS = [Stack, Encoder, HFModel, Tied, OwnParam]


# ---- training --------------------------------------------------------------------


def config(place, nvme_dir):
    zero = {"stage": 3, "offload_optimizer": {"device": place},
            "offload_param": {"device": place}, "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0, "sub_group_size": 4000}
    if place == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(nvme_dir)
        zero["offload_param"]["nvme_path"] = str(nvme_dir)
    return {"train_micro_batch_size_per_gpu": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "strata": {"device": "host", "hbm_budget": "16M", "threads": 2}}


def batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def build(cls, under_init, cfg=None, seed=3):
    torch.manual_seed(seed)
    if not under_init:
        return cls(), None
    with strata.init(config=cfg) as ctx:
        model = cls()
    return model, ctx


def train(model, cfg):
    """(initial parameters as the engine holds them, losses of STEPS steps)."""
    engine = strata.initialize(model, cfg)
    start = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = []
    for idx in batches():
        logits = engine(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.synchronize()
    engine.close()
    return start, losses


def spill_files(ctx):
    d = ctx.spill_dir
    return sorted(os.listdir(d)) if d is not None and os.path.isdir(d) else []


@pytest.mark.parametrize("place", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", ARCHS, ids=lambda c: c.__name__)
def test_same_start_and_losses_as_plain_build(cls, place, tmp_path):
    cfg = config(place, tmp_path)
    plain, _ = build(cls, False)
    want_start, want_losses = train(plain, cfg)
    model, ctx = build(cls, True, cfg)
    if place == "nvme":  # the spill files go under the config's nvme_path
        assert os.path.dirname(ctx.spill_dir) == str(tmp_path)
    params = list(model.parameters())
    assert params and all(init_context.is_spilled(p) for p in params)
    assert len(spill_files(ctx)) == len(params)
    # Metadata stays visible without reading the values back.
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert p.shape == q.shape and p.dtype == q.dtype and p.requires_grad, name
    assert all(init_context.is_spilled(p) for p in params)
    got_start, got_losses = train(model, cfg)
    assert got_start.keys() == want_start.keys()
    for k in want_start:
        assert torch.equal(got_start[k], want_start[k]), k
    assert got_losses == want_losses
    assert not os.path.exists(ctx.spill_dir)  # the files went at initialize
    assert os.listdir(tmp_path) == []  # and the engines' swap files at close()


@pytest.mark.parametrize("cls", [HFModel, Encoder], ids=lambda c: c.__name__)
def test_ram_spill_store(cls, tmp_path):
    cfg = config("cpu", tmp_path)
    want_start, want_losses = train(build(cls, False)[0], cfg)
    torch.manual_seed(3)
    with strata.init(cfg, spill="ram") as ctx:
        model = cls()
    assert ctx.spill_dir is None and all(init_context.is_spilled(p) for p in model.parameters())
    got_start, got_losses = train(model, cfg)
    assert all(torch.equal(got_start[k], want_start[k]) for k in want_start)
    assert got_losses == want_losses


def test_plain_and_init_builds_differ_under_another_seed(tmp_path):
    # The comparison above can fail: a different RNG stream gives other values.
    cfg = config("cpu", tmp_path)
    torch.manual_seed(4)
    with strata.init(cfg):
        other = Stack()
    want_start, _ = train(build(Stack, False)[0], cfg)
    got_start, _ = train(other, cfg)
    assert not torch.equal(got_start["head.weight"], want_start["head.weight"])


# ---- re-initialization by parents ---------------------------------------------


def test_apply_streams_one_module_at_a_time():
    # post_init's apply in HFModel.__init__: when _init_weights(module) starts,
    # every parameter of the modules it got before is spilled again (only
    # the one it works on is read back, while it runs).
    seen, in_ram = {}, []

    def visit(module):
        in_ram.append(sum(not init_context.is_spilled(p) for p in seen.values()))
        for p in module.parameters(recurse=False):
            seen[id(p)] = p

    HFModel.seen = visit
    torch.manual_seed(3)
    try:
        with strata.init():
            model = HFModel()
    finally:
        HFModel.seen = None
    assert len(in_ram) == len(list(model.modules()))
    assert len(seen) == len(list(model.parameters())) and max(in_ram) == 0
    assert all(init_context.is_spilled(p) for p in model.parameters())


def test_touching_a_spilled_parameter_outside_init_reads_it_back():
    torch.manual_seed(3)
    plain = Tied()
    torch.manual_seed(3)
    with strata.init() as ctx:
        model = Tied()
        # In the with block, outside any __init__: read back for good.
        torch.nn.init.constant_(model.mid.bias, 0.25)
    assert type(model.mid.bias) is torch.nn.Parameter
    assert torch.equal(model.mid.bias, torch.full((D,), 0.25))
    assert init_context.is_spilled(model.mid.weight)
    assert len(spill_files(ctx)) == 2  # embed.weight (tied: one) and mid.weight
    # A forward after the context reads back what it uses.
    idx = batches()[0][:, :-1]
    with torch.no_grad():
        plain.mid.bias.fill_(0.25)
        assert torch.equal(model(idx), plain(idx))
    assert not any(init_context.is_spilled(p) for p in model.parameters())
    assert not os.path.exists(ctx.spill_dir)


def test_materialize_gives_the_plain_values():
    torch.manual_seed(3)
    plain = OwnParam()
    torch.manual_seed(3)
    with strata.init(spill="ram"):
        model = OwnParam()
    assert all(init_context.is_spilled(p) for p in model.parameters())
    init_context.materialize(model)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert type(p) is torch.nn.Parameter and torch.equal(p, q), name


def test_spill_files_do_not_need_numpy(tmp_path):
    # torch 2's wheels do not require numpy: the spill files are written and
    # read back without it (here: an interpreter where `import numpy` fails).
    code = f"""
import sys
sys.modules["numpy"] = None
import torch
import strata
from strata import init_context
torch.manual_seed(5)
plain = [torch.nn.Linear(7, 5), torch.nn.Embedding(11, 3, dtype=torch.bfloat16)]
torch.manual_seed(5)
with strata.init(spill={str(tmp_path)!r}):
    spilled = [torch.nn.Linear(7, 5), torch.nn.Embedding(11, 3, dtype=torch.bfloat16)]
for a, b in zip(plain, spilled):
    assert all(init_context.is_spilled(p) for p in b.parameters())
    init_context.materialize(b)
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
print("spilled and read back")
"""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0 and "spilled and read back" in r.stdout, r.stdout


@pytest.mark.parametrize("spill", ["ram", "dir"])
def test_deepcopy_of_a_spilled_module_is_spilled(spill, tmp_path):
    torch.manual_seed(3)
    plain = torch.nn.Linear(D, 2 * D)
    torch.manual_seed(3)
    with strata.init(spill="ram" if spill == "ram" else tmp_path) as ctx:
        layer = torch.nn.Linear(D, 2 * D)
    clone = copy.deepcopy(layer)
    assert all(init_context.is_spilled(p) for p in (*layer.parameters(), *clone.parameters()))
    if spill == "dir":
        assert len(spill_files(ctx)) == 4
    with torch.no_grad():
        clone.weight.add_(1.0)  # read back for good; the original is untouched
    init_context.materialize(layer)
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    assert torch.equal(clone.weight, plain.weight + 1.0)
    assert torch.equal(init_context.materialize(clone).bias, plain.bias)
    assert not os.path.exists(ctx.spill_dir or "")


def test_frozen_and_resident_parameters_go_to_initialize(tmp_path):
    cfg = config("cpu", tmp_path)
    models = []
    for under_init in (False, True):
        model, _ = build(Stack, under_init, cfg)
        model.embed.weight.requires_grad_(False)  # frozen: torch keeps it
        models.append(model)
    with torch.no_grad():  # read back for good before initialize
        models[1].head.bias.add_(0.0)
    assert not init_context.is_spilled(models[1].head.bias)
    (want_start, want_losses), (got_start, got_losses) = (train(m, cfg) for m in models)
    for k in want_start:
        assert torch.equal(got_start[k], want_start[k]), k
    assert got_losses == want_losses
    assert torch.equal(models[0].embed.weight, models[1].embed.weight)


# ---- the context -------------------------------------------------------------------


def _module_patches():
    return (torch.nn.Linear.__init__, torch.nn.Module.apply,
            "__init_subclass__" in torch.nn.Module.__dict__)


def test_exception_inside_restores_everything():
    before = _module_patches()

    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(D, D)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with strata.init() as ctx:
            assert _module_patches() != before
            Boom()
    assert _module_patches() == before
    assert init_context._ACTIVE is None
    gc.collect()
    assert not os.path.exists(ctx.spill_dir)
    # Classes defined inside the context are not wrapped after it.
    with strata.init():
        class Later(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(3))
        assert init_context.is_spilled(Later().w)
    assert type(Later().w) is torch.nn.Parameter
    assert type(torch.nn.Linear(2, 2).weight) is torch.nn.Parameter


def test_nested_context_is_an_error():
    with strata.init():
        with pytest.raises(strata.FailedPreconditionError, match="nested"):
            with strata.init():
                pass
        model = Stack()  # the outer one still works
    assert all(init_context.is_spilled(p) for p in model.parameters())


def test_unused_model_leaves_no_files(tmp_path):
    with strata.init(spill=tmp_path) as ctx:
        model = Encoder()
    assert ctx.spill_dir.startswith(str(tmp_path))
    # The layer nn.TransformerEncoder copied is garbage: its files went.
    assert len(spill_files(ctx)) == len(list(model.parameters()))
    del model
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_bad_spill_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(strata.InvalidArgumentError, match="nope"):
        with strata.init(spill=missing):
            pass
    cfg = config("nvme", missing)
    with pytest.raises(strata.InvalidArgumentError,
                       match=r"zero_optimization\.offload_param\.nvme_path"):
        with strata.init(cfg):
            pass
    assert init_context._ACTIVE is None and _module_patches()[2] is False


def test_lost_spill_file_is_a_clear_error_and_the_model_stays_spilled(tmp_path):
    cfg = config("cpu", tmp_path)
    torch.manual_seed(3)
    with strata.init(spill=tmp_path) as ctx:
        model = Stack()
    victim = os.path.join(ctx.spill_dir, spill_files(ctx)[0])
    saved = open(victim, "rb").read()
    with open(victim, "wb") as f:
        f.write(saved[:8])
    with pytest.raises(strata.StrataError,
                       match=r"p1\.bin of parameter embed\.weight holds 8 bytes, 2368 expected"):
        strata.initialize(model, cfg)
    assert all(init_context.is_spilled(p) for p in model.parameters())
    with open(victim, "wb") as f:
        f.write(saved)
    # A second initialize trains as a plain build does (the failed engine's
    # gradient hooks take nothing).
    got_start, got_losses = train(model, cfg)
    want_start, want_losses = train(build(Stack, False)[0], cfg)
    assert all(torch.equal(got_start[k], want_start[k]) for k in want_start)
    assert got_losses == want_losses


def test_initialize_that_does_not_fit_leaves_the_model_spilled(tmp_path):
    # Plan() refuses before it reads any value: the engine drops its fill
    # callables unused; the model keeps its spill files for the next try.
    cfg = config("nvme", tmp_path)
    small = {**cfg, "strata": {**cfg["strata"], "hbm_budget": "1K"}}
    model, ctx = build(Stack, True, cfg)
    with pytest.raises(strata.ResourceExhaustedError, match="does not fit"):
        strata.initialize(model, small)
    assert all(init_context.is_spilled(p) for p in model.parameters())
    assert len(spill_files(ctx)) == len(list(model.parameters()))
    got_start, got_losses = train(model, cfg)
    want_start, want_losses = train(build(Stack, False)[0], cfg)
    assert all(torch.equal(got_start[k], want_start[k]) for k in want_start)
    assert got_losses == want_losses
    assert os.listdir(tmp_path) == []
