"""deepspeed.utils.zero_to_fp32 on Strata, for checkpoints that
strata.deepspeed's engine saved (checkpoint_dir/<tag>, `latest` naming the
newest tag): the fp32 parameters in the model's shapes under every name,
which a fresh model loads strictly (strata.zero_to_fp32 says the rules)."""

import os

from ... import zero_to_fp32 as _z
from ..._checkpoint_tags import read_latest, tag_dir
from ..._errors import NotFoundError


def _root(checkpoint_dir, tag):
    # The tag's directory, by the rules load_checkpoint follows
    # (strata._checkpoint_tags): one directory under checkpoint_dir, and a
    # `latest` that is there must be usable. Reading weights runs no code
    # from the checkpoint, so another user's may be read.
    checkpoint_dir = os.fspath(checkpoint_dir)
    if tag is None:
        tag = read_latest(checkpoint_dir)
        if tag is None:
            raise NotFoundError(f"no 'latest' file in {checkpoint_dir}: pass tag=", "NotFound")
    return tag_dir(checkpoint_dir, tag)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters=False):
    return _z.get_fp32_state_dict_from_zero_checkpoint(_root(checkpoint_dir, tag))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None,
                                               exclude_frozen_parameters=False):
    return _z.convert_zero_checkpoint_to_fp32_state_dict(_root(checkpoint_dir, tag), output_file)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    return _z.load_state_dict_from_zero_checkpoint(model, _root(checkpoint_dir, tag))
