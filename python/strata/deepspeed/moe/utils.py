"""deepspeed.moe.utils on Strata: refused when called."""

from .._refuse import refuse


def split_params_into_different_moe_groups_for_optimizer(*args, **kwargs):
    refuse("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer",
           "mixture-of-experts parallelism is not supported")


def is_moe_param(param):
    return False
