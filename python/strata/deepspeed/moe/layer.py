"""deepspeed.moe.layer on Strata: MoE is refused when built."""

from .._refuse import refuse


class MoE:
    def __init__(self, *args, **kwargs):
        refuse("deepspeed.moe.layer.MoE", "mixture-of-experts parallelism is not supported")
