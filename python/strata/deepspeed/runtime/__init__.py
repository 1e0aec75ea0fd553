"""deepspeed.runtime on Strata: the names scripts import from it
(runtime.config.DeepSpeedConfigError, runtime.lr_schedules' schedules,
runtime.utils' helpers)."""

from . import config  # noqa: F401
from . import lr_schedules  # noqa: F401
from . import utils  # noqa: F401
