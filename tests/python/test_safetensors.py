"""strata.write_safetensors (engine.save_16bit_model's ".safetensors" files)
through the C++ writer (src/scheduler/safetensors.h).

The bytes are those of the format as the Python writer produced them before
(compact JSON: "__metadata__", then the tensors in order with dtype, shape,
data_offsets; spaces to a multiple of 8; the data back to back), with names
written as UTF-8 rather than \\u-escaped. The file is mode 0600; a symlink
planted at the temporary path (<path>.tmp) or at the final path is never
followed; a bad dtype or metadata leaves nothing behind.
"""

import json
import os
import stat

import pytest
import torch

import strata


def reference_bytes(tensors, metadata=None):
    """The format written out by hand (as the Python writer did, with UTF-8 names)."""
    header = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        data = bytes(t.reshape(-1).view(torch.uint8).tolist())  # (no numpy)
        dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                 torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                 torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                 torch.bool: "BOOL"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def every_dtype():
    torch.manual_seed(3)
    base = torch.randn(4, 6)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16.t": base.to(torch.float16).t(),  # not contiguous
        "f64": base[1].double(),
        "i64": torch.arange(-3, 5, dtype=torch.int64).view(2, 4),
        "i32": torch.tensor(-7, dtype=torch.int32),  # a scalar
        "i16": torch.arange(5, dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "with \"quote\"\tand tab": torch.ones(1),
        "naïve ∑": torch.ones(2, dtype=torch.bfloat16),
        "w": torch.nn.Parameter(torch.ones(3)),  # requires grad
    }


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_bytes_as_the_format_with_mode_0600(tmp_path, umask_022):
    tensors = every_dtype()
    path = tmp_path / "m.safetensors"
    strata.write_safetensors(tensors, path)
    assert path.read_bytes() == reference_bytes(tensors)
    assert mode(path) == 0o600
    meta = {"format": "pt", "step": "7"}
    strata.write_safetensors(tensors, str(path), metadata=meta)  # replaces it
    assert path.read_bytes() == reference_bytes(tensors, meta)
    assert mode(path) == 0o600
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_symlink_at_the_temporary_path_is_not_followed(tmp_path, umask_022):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "m.safetensors"
    os.symlink(victim, tmp_path / "m.safetensors.tmp")
    tensors = {"x": torch.arange(6.0)}
    strata.write_safetensors(tensors, path)
    assert victim.read_bytes() == b"keep"
    assert os.path.islink(tmp_path / "m.safetensors.tmp")
    assert stat.S_ISREG(os.lstat(path).st_mode) and mode(path) == 0o600
    assert path.read_bytes() == reference_bytes(tensors)
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "m.safetensors.tmp", "victim"]


def test_symlink_or_directory_at_the_final_path_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "m.safetensors"
    os.symlink(victim, path)
    with pytest.raises(strata.FailedPreconditionError, match="symbolic link"):
        strata.write_safetensors({"x": torch.ones(2)}, path)
    assert victim.read_bytes() == b"keep" and os.path.islink(path)
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(strata.FailedPreconditionError, match="directory"):
        strata.write_safetensors({"x": torch.ones(2)}, tmp_path / "d.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["d.safetensors", "m.safetensors", "victim"]


def test_bad_dtype_or_metadata_writes_nothing(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(strata.InvalidArgumentError, match="complex"):
        strata.write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, path)
    with pytest.raises(strata.InvalidArgumentError, match="str"):
        strata.write_safetensors({"x": torch.ones(1)}, path, metadata={"step": 7})
    with pytest.raises(strata.InvalidArgumentError, match="reserved"):
        strata.write_safetensors({"__metadata__": torch.ones(1)}, path)
    assert os.listdir(tmp_path) == []
