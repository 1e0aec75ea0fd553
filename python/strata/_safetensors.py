"""The safetensors writer of the frontend: write_safetensors(tensors, path)
(engine.save_16bit_model's ".safetensors" files), and read_safetensors(path)
(strata.zero_to_fp32's reader of exported checkpoints).

Promises: the tensors' bytes and the header's parts go to the C++ writer
(src/scheduler/safetensors.h, the one checkpoint export uses, through
_strata.write_safetensors), so both write the same format: an 8-byte
little-endian header length, a compact JSON header ("__metadata__", then the
tensors in the order given; names as UTF-8) padded with spaces to a multiple
of 8, the tensors' bytes in order. The file is created beside ``path`` with
mode 0600 (O_EXCL | O_NOFOLLOW: a symlink there is never followed), fsynced
and renamed over ``path``; a symlink or anything but a regular file at
``path`` is refused (FailedPreconditionError). A dtype the format has no name
for, or a name or metadata entry that is not a str, is an
InvalidArgumentError.
"""

import json
import os
import struct

import torch
import torch.utils.dlpack as _dlpack

from . import _strata
from ._errors import InvalidArgumentError

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL"}


def write_safetensors(tensors, path, metadata=None):
    """Writes {name: tensor} (CPU copies, contiguous) in the safetensors format,
    with `metadata` ({str: str}; default {"format": "pt"}) as "__metadata__"."""
    meta = list(dict(metadata or {"format": "pt"}).items())
    for k, v in meta:
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(f"write_safetensors: metadata {k!r}: {v!r}: keys and "
                                       "values must be str", "InvalidArgument")
    entries = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"write_safetensors: tensor name {name!r} is not a str",
                                       "InvalidArgument")
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise InvalidArgumentError(f"write_safetensors: {name} has dtype {t.dtype}",
                                       "InvalidArgument")
        data = t.reshape(-1).view(torch.uint8)  # the bytes, without a copy
        entries.append((name, _SAFETENSORS_DTYPES[t.dtype], list(t.shape),
                        _dlpack.to_dlpack(data)))
    _strata.write_safetensors(os.fspath(path), meta, entries)


_TORCH_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def read_safetensors(path):
    """{name: tensor} of a safetensors file (CPU tensors of the header's
    dtypes and shapes, in the header's order; "__metadata__" left out). A
    header or an extent that does not fit the file is an InvalidArgumentError
    naming the file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    def bad(what):
        return InvalidArgumentError(f"read_safetensors {path}: {what}", "InvalidArgument")
    if len(data) < 8:
        raise bad(f"{len(data)} bytes: no header length")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise bad(f"header of {n} bytes past the file's end ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    body = memoryview(data)[8 + n:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise bad(f"{name}: dtype {entry.get('dtype')!r}")
        b, e = entry["data_offsets"]
        shape = entry["shape"]
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
        if not 0 <= b <= e <= len(body) or e - b != numel * itemsize:
            raise bad(f"{name}: bytes [{b}, {e}) do not hold {shape} of {entry['dtype']} "
                      f"in a body of {len(body)}")
        raw = torch.frombuffer(bytearray(body[b:e]), dtype=torch.uint8)
        out[name] = (raw.view(dtype).reshape(shape) if numel
                     else torch.empty(shape, dtype=dtype, device="cpu"))
    return out
