"""deepspeed.runtime.config on Strata: DeepSpeedConfigError, what
initialize raises for a bad config (an InvalidArgumentError too, naming the
key path and the values allowed)."""

from ..._errors import InvalidArgumentError


class DeepSpeedConfigError(InvalidArgumentError):
    """A DeepSpeed config Strata refuses; the message names the key path."""
