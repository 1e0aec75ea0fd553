"""Parameters used outside the forward of the module that owns them.

torch's MultiheadAttention reads out_proj's parameters in its own forward,
TransformerEncoderLayer's inference fast path reads every sublayer's, and a
tied head written as ``F.linear(x, self.embed.weight)`` reads the
embedding's in the parent's forward. The frontend covers them with leaf
modules (built-in ones automatic, others by strata.set_leaf_modules) and
strata.register_external_parameter; each pattern is trained through Strata
and by plain torch.optim.AdamW from the same weights on the same fresh random
data, in fp32 with parameters forced out after each use (reuse distance 0, no
persistence), and the losses and final parameters must agree.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import strata
from test_torch_frontend import assert_close, config

D, HEADS, FF, T, B, V = 16, 2, 32, 5, 3, 23

PLACEMENTS = [("none", "none"), ("cpu", "cpu"), ("cpu", "nvme")]


def regression_data(n, seed, d_in=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, T, d_in, generator=g), torch.randn(B, T, 1, generator=g))
            for _ in range(n)]


def token_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, V, (B, T + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def train_both(model, cfg, data, prepare=None, ref=None):
    """(strata losses, torch losses, engine) of training `model` (whose
    forward takes a batch and returns the loss) on `data`, one optimizer
    step per batch; `prepare(model)` runs on the engine's copy before
    initialize. `ref`: torch's copy (default: a deep copy of `model`)."""
    ref = copy.deepcopy(model) if ref is None else ref
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"])
    want = []
    for batch in data:
        loss = ref(*batch)
        loss.backward()
        want.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    if prepare is not None:
        prepare(model)
    engine = strata.initialize(model, cfg)
    got = []
    for batch in data:
        loss = engine(*batch)
        engine.backward(loss)
        assert engine.step()["applied"]
        got.append(loss.item())
    engine.synchronize()
    sd, ref_sd = engine.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in sd:
        got_k, want_k = sd[k], ref_sd[k]
        if k.endswith("in_proj_bias"):
            # Attention's key bias has a zero gradient in exact arithmetic (a
            # softmax is shift invariant); Adam turns its rounding noise into
            # O(lr) steps that no two runs share. The query and value parts
            # are compared.
            keep = torch.cat([torch.arange(0, D), torch.arange(2 * D, 3 * D)])
            got_k, want_k = got_k[keep], want_k[keep]
        torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-5, msg=k)
    return got, want, engine


class Encoder(nn.Module):
    """Linear in, torch's TransformerEncoder (two TransformerEncoderLayers,
    each using MultiheadAttention), linear out, MSE."""

    def __init__(self, batch_first, norm_first):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(8, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=batch_first,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.out = nn.Linear(D, 1)

    def forward(self, x, y):
        h = self.inp(x if self.batch_first else x.transpose(0, 1))
        h = self.enc(h)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return F.mse_loss(self.out(h), y)


@pytest.mark.parametrize("opt,par", PLACEMENTS)
@pytest.mark.parametrize("batch_first,norm_first", [(True, False), (False, True)])
def test_transformer_encoder_layer_matches_torch(opt, par, batch_first, norm_first, tmp_path):
    torch.manual_seed(31)
    model = Encoder(batch_first, norm_first)
    got, want, engine = train_both(model, config(opt, par, tmp_path), regression_data(4, 41))
    assert_close(got, want)
    # Each encoder layer is one engine module (a leaf: its fast path reads
    # every sublayer's parameters).
    layer_groups = {id(engine._groups_of_module[m][0]) for m in model.enc.layers}
    assert len(layer_groups) == 2
    assert not any(m in engine._groups_of_module for m in model.enc.layers[0].modules()
                   if m is not model.enc.layers[0])
    # Evaluation under no_grad (batch_first: torch's fused inference path)
    # gives torch's result.
    model.eval()
    x, y = regression_data(1, 42)[0]
    with torch.no_grad():
        loss = engine(x, y).item()
    engine.close()  # the model has the trained weights back and runs on its own
    with torch.no_grad():
        assert loss == pytest.approx(model(x, y).item(), rel=1e-5)


class CheckpointedEncoder(Encoder):
    """Encoder whose layers (leaves) run under activation checkpointing."""

    def __init__(self, reentrant):
        super().__init__(batch_first=True, norm_first=False)
        self.reentrant = reentrant

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.enc.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.reentrant)
        return F.mse_loss(self.out(h), y)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_encoder_layers_match_torch(reentrant, tmp_path):
    torch.manual_seed(30)
    got, want, engine = train_both(CheckpointedEncoder(reentrant), config("cpu", "nvme", tmp_path),
                                   regression_data(4, 40))
    assert_close(got, want)
    engine.close()


class Attention(nn.Module):
    """MultiheadAttention on its own: self-attention with a causal mask, or
    cross-attention with kdim/vdim != embed_dim (separate q/k/v weights)."""

    def __init__(self, cross):
        super().__init__()
        self.cross = cross
        self.inp = nn.Linear(8, D)
        kv = 6 if cross else None
        self.attn = nn.MultiheadAttention(D, HEADS, kdim=kv, vdim=kv, add_bias_kv=cross)
        self.out = nn.Linear(D, 1)

    def forward(self, x, y):
        h = self.inp(x).transpose(0, 1)  # (T, B, D)
        if self.cross:
            mem = x[..., :6].transpose(0, 1).flip(0)
            a, _ = self.attn(h, mem, mem)
        else:
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            a, w = self.attn(h, h, h, attn_mask=mask)
            a = a + w.mean()
        return F.mse_loss(self.out(a.transpose(0, 1)), y)


@pytest.mark.parametrize("opt,par", PLACEMENTS)
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_attention_matches_torch(opt, par, cross, tmp_path):
    torch.manual_seed(32)
    got, want, engine = train_both(Attention(cross), config(opt, par, tmp_path),
                                   regression_data(4, 43))
    assert_close(got, want)
    engine.close()


class Seq2Seq(nn.Module):
    """torch's nn.Transformer (encoder and decoder layers)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.tf = nn.Transformer(D, HEADS, num_encoder_layers=1, num_decoder_layers=1,
                                 dim_feedforward=FF, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, 1)

    def forward(self, x, y):
        h = self.inp(x)
        mask = self.tf.generate_square_subsequent_mask(T)
        return F.mse_loss(self.out(self.tf(h, h.flip(1), tgt_mask=mask)), y)


def test_nn_transformer_matches_torch(tmp_path):
    torch.manual_seed(33)
    got, want, engine = train_both(Seq2Seq(), config("cpu", "cpu"), regression_data(3, 44))
    assert_close(got, want)
    engine.close()


class TiedLM(nn.Module):
    """An embedding, a body, and a head tied to the embedding written as
    F.linear(h, self.embed.weight) in this module's forward. `ckpt`: the body
    and head run under activation checkpointing ("reentrant" or
    "non_reentrant"), so the embedding's weight is used inside and outside
    the checkpointed segment."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.embed = nn.Embedding(V, D)
        self.body = nn.Sequential(nn.Linear(D, FF), nn.Tanh(), nn.Linear(FF, D))
        self.norm = nn.LayerNorm(D)

    def rest(self, h):
        h = self.norm(h + self.body(h))
        return F.linear(h, self.embed.weight)

    def forward(self, idx, tgt):
        h = self.embed(idx)
        if self.ckpt is None:
            logits = self.rest(h)
        else:
            logits = torch.utils.checkpoint.checkpoint(self.rest, h,
                                                       use_reentrant=self.ckpt == "reentrant")
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))


def tie(model):
    strata.register_external_parameter(model, model.embed.weight)


@pytest.mark.parametrize("opt,par", PLACEMENTS)
@pytest.mark.parametrize("ckpt", [None, "reentrant", "non_reentrant"])
def test_tied_head_with_register_external_parameter(opt, par, ckpt, tmp_path):
    torch.manual_seed(34)
    got, want, engine = train_both(TiedLM(ckpt), config(opt, par, tmp_path), token_data(4, 45),
                                   prepare=tie)
    assert_close(got, want)
    assert want[-1] < want[0]  # it trained
    engine.close()


def test_unregistered_external_use_names_the_parameter():
    torch.manual_seed(35)
    model = TiedLM()
    engine = strata.initialize(model, config("cpu", "cpu"))
    idx, tgt = token_data(1, 46)[0]
    with pytest.raises(strata.FailedPreconditionError,
                       match=r"embed\.weight: used in TiedLM\.rest .*"
                       r"register_external_parameter") as info:
        engine(idx, tgt)
    assert isinstance(info.value, RuntimeError) and "set_leaf_modules" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error, chained
    # Registered after initialize (between micro-batches), it trains as torch does.
    engine.close()
    ref = copy.deepcopy(model)
    engine = strata.initialize(model, config("cpu", "cpu"))
    with pytest.raises(strata.FailedPreconditionError, match="embed.weight"):
        engine(idx, tgt)
    tie(model)
    data = token_data(3, 47)
    p = config("cpu", "cpu")["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]),
                            eps=p["eps"], weight_decay=p["weight_decay"])
    got, want = [], []
    for batch in data:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
        loss = ref(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert_close(got, want)
    engine.close()


def test_multihead_attention_not_a_leaf_names_out_proj():
    """With the built-in leaf turned off, MultiheadAttention's use of
    out_proj's weight is the unmapped use the error names (instead of torch's
    "mat2 must be a matrix, got 1-D tensor")."""
    torch.manual_seed(36)
    model = Attention(cross=False)
    model.attn._strata_leaf = False
    engine = strata.initialize(model, config("cpu", "cpu"))
    x, y = regression_data(1, 48)[0]
    with pytest.raises(strata.FailedPreconditionError,
                       match=r"attn\.out_proj\.weight, attn\.out_proj\.bias: used in "
                       r"MultiheadAttention\.forward"):
        engine(x, y)
    engine.close()


class Gate(nn.Module):
    """Owns a gate vector and uses it in its own forward. In backward the
    gate's gradient is final before the shift's (reentrant checkpointing of
    the other user: the gate's accumulator runs twice before the group's
    gradients are all there)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.shift = nn.Parameter(torch.randn(D) * 0.1)
        self.gate = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return (self.lin(x) + self.shift) * torch.sigmoid(self.gate)


class GatedUser(nn.Module):
    """Uses another module's gate (held outside its module tree) in its own
    forward: an external parameter used in two modules."""

    def __init__(self, gate_owner):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self._owner = [gate_owner]  # not a submodule

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self._owner[0].gate


class TwoUsers(nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(8, D)
        self.gate = Gate()
        self.user = GatedUser(self.gate)
        self.out = nn.Linear(D, 1)

    def forward(self, x, y):
        h = self.gate(self.inp(x))
        if self.ckpt is None:
            h = self.user(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.user, h,
                                                  use_reentrant=self.ckpt == "reentrant")
        return F.mse_loss(self.out(h), y)


@pytest.mark.parametrize("opt,par", PLACEMENTS)
@pytest.mark.parametrize("ckpt", [None, "reentrant", "non_reentrant"])
def test_custom_module_with_register_external_parameter(opt, par, ckpt, tmp_path):
    torch.manual_seed(37)

    def prepare(model):
        strata.register_external_parameter(model.user, model.gate.gate)

    got, want, engine = train_both(TwoUsers(ckpt), config(opt, par, tmp_path),
                                   regression_data(4, 49), prepare=prepare)
    assert_close(got, want)
    engine.close()


class Fused(nn.Module):
    """Reads its child's parameters directly (never calls the child)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias) * self.scale


class FusedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(Fused() for _ in range(2))
        self.out = nn.Linear(D, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for blk in self.blocks:
            h = h + torch.tanh(blk(h))
        return F.mse_loss(self.out(h), y)


@pytest.mark.parametrize("opt,par", PLACEMENTS)
@pytest.mark.parametrize("how", ["class", "name", "instance"])
def test_set_leaf_modules_matches_torch(opt, par, how, tmp_path):
    torch.manual_seed(38)

    def prepare(model):
        leaves = {"class": [Fused], "name": ["Fused"], "instance": list(model.blocks)}[how]
        assert len(strata.set_leaf_modules(model, leaves)) == 2

    got, want, engine = train_both(FusedNet(), config(opt, par, tmp_path),
                                   regression_data(4, 50), prepare=prepare)
    assert_close(got, want)
    with pytest.raises(strata.FailedPreconditionError, match="before initialize"):
        strata.set_leaf_modules(engine.module, [Fused])
    engine.close()


def test_leaf_and_external_api_errors():
    model = FusedNet()
    with pytest.raises(strata.InvalidArgumentError, match="no module of the model matches Gate"):
        strata.set_leaf_modules(model, [Gate])
    with pytest.raises(TypeError, match="torch.nn.Parameter"):
        strata.register_external_parameter(model, torch.zeros(3))
    stranger = nn.Parameter(torch.randn(4))
    strata.register_external_parameter(model.blocks[0], stranger)
    with pytest.raises(strata.InvalidArgumentError,
                       match=r"shape \(4,\) registered on module blocks\.0 .*not a parameter"):
        strata.initialize(model, config("cpu", "cpu"))


@pytest.mark.parametrize("opt,par", PLACEMENTS)
def test_model_load_state_dict_goes_into_the_engine(opt, par, tmp_path):
    """model.load_state_dict() (and a submodule's) while the engine owns the
    parameters writes them into the engine (the Adam moments kept, as torch's
    optimizer keeps its state across an in-place load); training then goes on
    as torch's."""
    torch.manual_seed(39)
    model = TiedLM()
    ref = copy.deepcopy(model)
    cfg = config(opt, par, tmp_path)
    p = cfg["optimizer"]["params"]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]),
                                eps=p["eps"], weight_decay=p["weight_decay"])
    data = token_data(4, 51)
    tie(model)
    engine = strata.initialize(model, cfg)
    got, want = [], []

    def step(batch):
        loss = ref(*batch)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        want.append(loss.item())
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())

    step(data[0])
    other = TiedLM()  # fresh weights: everything loaded differs from what is trained
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    ref.load_state_dict(other.state_dict())
    for k, v in engine.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    step(data[1])
    # A submodule's, with its prefix.
    body = TiedLM().body.state_dict()
    model.body.load_state_dict(body)
    ref.body.load_state_dict(body)
    for k, v in engine.state_dict().items():
        if k.startswith("body."):
            assert torch.equal(v, body[k[5:]]), k
        else:  # trained one step since the first load
            torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-4, atol=1e-5, msg=k)
    step(data[2])
    # Strict errors name the keys; nothing else is loaded wrong.
    bad = other.state_dict()
    del bad["norm.bias"]
    bad["norm.weight"] = torch.randn(D + 1)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"norm\.bias\"") as e:
        model.load_state_dict(bad)
    assert f"size mismatch for norm.weight: copying a param with shape ({D + 1},)" in str(e.value)
    result = model.load_state_dict(other.state_dict(), strict=False)
    ref.load_state_dict(other.state_dict(), strict=False)
    assert not result.missing_keys
    step(data[3])
    assert_close(got, want)
    engine.close()


class WeightNormed(nn.Module):
    """torch.nn.utils.weight_norm: a forward pre-hook of the module computes
    its weight from weight_g and weight_v (so the engine's pre-hook must run
    before it)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.utils.weight_norm(nn.Linear(8, D))
        self.out = nn.Linear(D, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(torch.tanh(self.inp(x))), y)


def test_weight_norm_matches_torch(tmp_path):
    torch.manual_seed(40)
    model = WeightNormed()
    torch.manual_seed(40)
    ref = WeightNormed()  # weight_norm's modules cannot be deep-copied
    got, want, engine = train_both(model, config("cpu", "nvme", tmp_path),
                                   regression_data(4, 52), ref=ref)
    assert_close(got, want)
    engine.close()
