"""DeepSpeed's zero_to_fp32 recovery for Strata checkpoints.

    from strata.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpts"), strict=True)

A checkpoint holds every rank's fp32 masters; these functions consolidate
them into one state_dict of the model's parameters: the tensors in the
model's shapes, a tied weight under each of its names (what
strata.export writes, read back). A checkpoint written before shapes and
tied names were recorded gives flat tensors under the first names. Only the
parameters the engine trained are in it: buffers and frozen parameters stay
the model's.
"""

import os
import tempfile

import torch

from . import _strata
from ._checkpoint_tags import tag_dir
from ._private_fs import check_replaceable, write_file_replacing
from ._safetensors import read_safetensors


def _checkpoint_path(checkpoint_dir, tag):
    # tag: DeepSpeed's name of one checkpoint under the directory (Strata's
    # ckpt-<N>): one directory name, never a path out of it, and a directory
    # rather than a symlink (_checkpoint_tags); None: the newest that verifies.
    return os.fspath(checkpoint_dir) if tag is None else tag_dir(checkpoint_dir, tag)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None):
    """{name: fp32 CPU tensor} of the checkpoint `tag` under `checkpoint_dir`
    (None: the newest that verifies; every file's size and CRC-32C are
    checked)."""
    with tempfile.TemporaryDirectory(prefix="strata-zero-to-fp32-") as d:
        out = os.path.join(d, "fp32.safetensors")
        _strata.export_checkpoint(_checkpoint_path(checkpoint_dir, tag), out, "fp32")
        return read_safetensors(out)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None):
    """Writes get_fp32_state_dict_from_zero_checkpoint's state_dict to
    `output_file` with torch.save (a ".safetensors" name: strata.export's
    safetensors file instead). Either way the file is new, of mode 0600, and
    renamed over `output_file` only when that is nothing or a regular file:
    a symlink, FIFO or directory there is refused naming it and left
    alone."""
    output_file = os.fspath(output_file)
    if output_file.endswith(".safetensors"):
        return _strata.export_checkpoint(_checkpoint_path(checkpoint_dir, tag), output_file,
                                         "fp32")
    what = "zero_to_fp32 output file"
    check_replaceable(output_file, what)  # before the work
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    write_file_replacing(output_file, lambda f: torch.save(state_dict, f), what)
    return None


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Loads the checkpoint's fp32 parameters into `model` and returns it, as
    DeepSpeed's function of that name does (strict=False: the model's
    buffers and frozen parameters are not in a checkpoint)."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag),
                          strict=False)
    return model
