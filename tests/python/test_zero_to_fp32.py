"""Weights out of a checkpoint that a fresh model loads strictly.

The GPT of test_torch_frontend.py (a head tied to the token embedding, 2-D
and 1-D parameters) trains a few steps in bf16 and saves checkpoints.
strata.export (fp32 and the training dtype) and
strata.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint give every key
of model.state_dict() in the model's shapes (head.weight as well as
wte.weight), the engine's fp32 masters bitwise, and a fresh GPT loads them
with strict=True; `tag` picks an older checkpoint; a checkpoint resumed with
another shape is refused naming it.
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import strata  # noqa: E402
from strata._safetensors import read_safetensors  # noqa: E402
from strata.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: E402
                                 get_fp32_state_dict_from_zero_checkpoint,
                                 load_state_dict_from_zero_checkpoint)
from test_torch_frontend import GPT, batches, config  # noqa: E402


def train(tmp_path, steps):
    torch.manual_seed(3)
    model = GPT()
    engine = strata.initialize(model, config(dtype="bf16"))
    masters = []
    for s, (idx, tgt) in enumerate(batches(steps)):
        engine.backward(engine(idx, tgt))
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt", data_position=s + 1)
        masters.append({k: v.clone() for k, v in engine.state_dict().items()})
    engine.close()
    return masters


def check_strict(sd, want):
    fresh = GPT()
    keys = set(fresh.state_dict())
    assert set(sd) == keys, (set(sd) ^ keys)
    for k, v in fresh.state_dict().items():
        assert sd[k].shape == v.shape, k
    fresh.load_state_dict(sd, strict=True)
    assert torch.equal(fresh.head.weight, fresh.wte.weight)
    for k, v in want.items():
        assert torch.equal(sd[k].float(), v.float()), k
    return fresh


def test_exports_load_strictly_into_a_fresh_model(tmp_path):
    masters = train(tmp_path, 2)
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert all(v.dtype == torch.float32 for v in sd.values())
    check_strict(sd, masters[-1])
    # The older checkpoint by its tag.
    tags = sorted(os.listdir(tmp_path / "ckpt"))
    tags = [t for t in tags if t.startswith("ckpt-")]
    assert len(tags) == 2
    check_strict(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag=tags[0]),
                 masters[0])
    # strata.export: fp32, and the training dtype (the masters rounded to bf16).
    info = strata.export(tmp_path / "ckpt", tmp_path / "w.safetensors")
    assert info["tensors"] == len(GPT().state_dict())
    check_strict(read_safetensors(tmp_path / "w.safetensors"), masters[-1])
    strata.export(tmp_path / "ckpt", tmp_path / "w16.safetensors", dtype="train")
    w16 = read_safetensors(tmp_path / "w16.safetensors")
    assert w16["head.weight"].dtype == torch.bfloat16
    check_strict(w16, {k: v.to(torch.bfloat16) for k, v in masters[-1].items()})
    # DeepSpeed's other two entry points.
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "fp32.pt")
    check_strict(torch.load(tmp_path / "fp32.pt"), masters[-1])
    model = load_state_dict_from_zero_checkpoint(GPT(), tmp_path / "ckpt")
    assert torch.equal(model.wpe.detach(), masters[-1]["wpe"])


def test_a_checkpoint_of_another_shape_is_refused_naming_it(tmp_path):
    train(tmp_path, 1)

    class Reshaped(GPT):
        def __init__(self):
            super().__init__()
            # The same number of elements in another shape.
            self.wpe = torch.nn.Parameter(self.wpe.detach().reshape(-1, 2 * self.wpe.shape[1]))

    engine = strata.initialize(Reshaped(), config(dtype="bf16"))
    with pytest.raises(Exception) as e:
        engine.load_checkpoint(tmp_path / "ckpt")
    assert "parameter wpe: shape" in str(e.value)
    engine.close()


def test_a_manifest_nested_too_deep_is_an_error_not_the_end_of_the_interpreter(tmp_path):
    # 100,000 levels of nesting (about 200 KB): read recursively, they would
    # overflow the stack of the process that reads them, this interpreter.
    train(tmp_path, 1)
    manifest = tmp_path / "ckpt" / "ckpt-00000001" / "MANIFEST.json"
    text = manifest.read_text()
    at = text.index('"note"')
    manifest.write_text(text[:at] + '"deep": ' + "[" * 100000 + "]" * 100000 + ", " + text[at:])
    with pytest.raises(strata.StrataError, match="nested deeper than"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt" / "ckpt-00000001")
    with pytest.raises(strata.StrataError, match="nested deeper than"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
