"""deepspeed.utils on Strata: zero_to_fp32."""

from . import zero_to_fp32  # noqa: F401
