"""deepspeed.utils.zero_to_fp32 on Strata, for checkpoints that
strata.deepspeed's engine saved (checkpoint_dir/<tag>, `latest` naming the
newest tag): the fp32 parameters in the model's shapes under every name,
which a fresh model loads strictly (strata.zero_to_fp32 says the rules)."""

import os

from ... import zero_to_fp32 as _z


def _root(checkpoint_dir, tag):
    from .. import read_latest
    checkpoint_dir = os.fspath(checkpoint_dir)
    if tag is None:
        tag = read_latest(checkpoint_dir)
        if tag is None:
            raise FileNotFoundError(f"no 'latest' file in {checkpoint_dir}: pass tag=")
    return os.path.join(checkpoint_dir, str(tag))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters=False):
    return _z.get_fp32_state_dict_from_zero_checkpoint(_root(checkpoint_dir, tag))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None,
                                               exclude_frozen_parameters=False):
    return _z.convert_zero_checkpoint_to_fp32_state_dict(_root(checkpoint_dir, tag), output_file)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    return _z.load_state_dict_from_zero_checkpoint(model, _root(checkpoint_dir, tag))
