"""deepspeed.moe on Strata: importable (scripts import it at the top, using
it only when asked for experts), refused at first use: mixture-of-experts
parallelism is not supported."""

from . import layer, utils  # noqa: F401
