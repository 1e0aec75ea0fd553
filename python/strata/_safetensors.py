"""The safetensors writer: write_safetensors(tensors, path) is the whole
module (engine.save_16bit_model's ".safetensors" files).

Promises: a file in the safetensors format (8-byte little-endian header
length, a JSON header padded with spaces to a multiple of 8, the tensors'
bytes in order), written to ``path + ".tmp"``, fsynced and renamed over
``path``; a dtype the format has no name for is an InvalidArgumentError.
Kept apart so that the C++ writer can replace it in one place.
"""

import json
import os

import torch

from ._errors import InvalidArgumentError

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL"}


def write_safetensors(tensors, path, metadata=None):
    """Writes {name: tensor} (CPU copies, contiguous) in the safetensors format:
    8-byte little-endian header length, a JSON header padded with spaces to a
    multiple of 8, the tensors' bytes in order."""
    header = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise InvalidArgumentError(f"write_safetensors: {name} has dtype {t.dtype}",
                                       "InvalidArgument")
        data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.fspath(path))
