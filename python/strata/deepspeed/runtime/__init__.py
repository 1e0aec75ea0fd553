"""deepspeed.runtime on Strata: the names scripts import from it
(runtime.config.DeepSpeedConfigError)."""

from . import config  # noqa: F401
