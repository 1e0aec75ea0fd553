"""Reading a config: what strata.initialize and strata.init take.

Promises: a config given as a DeepSpeed JSON path or a dict becomes its JSON
text and a source name for the engine's errors (config_text);
parse_config gives the effective config (every key, defaults filled in,
"auto" keys from ``auto_values``) or raises InvalidArgumentError naming the
key path; training_dtype reads the torch dtype the config trains in. Reads
files, imports nothing of the frontend, so both the engine and
strata.init_context can import it.
"""

import json
import os

import torch

from . import _strata


def config_text(config):
    """(JSON text, source name) of a config given as a path or a dict."""
    if isinstance(config, dict):
        return json.dumps(config), "<dict>"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    raise TypeError(
        f"config must be a path to a DeepSpeed JSON file or a dict, not {type(config).__name__}")


def parse_config(config, auto_values=None):
    """The effective config (every key, defaults filled in) as a dict; raises
    InvalidArgumentError naming the key path on a bad one."""
    text, source = config_text(config)
    return json.loads(_strata.parse_config(text, source, dict(auto_values or {})))


def training_dtype(config):
    """The dtype of the working copies of an effective config: bf16, fp16 or fp32."""
    if config["bf16"]["enabled"]:
        return torch.bfloat16
    if config["fp16"]["enabled"]:
        return torch.float16
    return torch.float32
