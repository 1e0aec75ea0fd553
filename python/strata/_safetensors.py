"""The safetensors writer of the frontend: write_safetensors(tensors, path)
(engine.save_16bit_model's ".safetensors" files).

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

import os

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
