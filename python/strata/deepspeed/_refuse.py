"""The one error of strata.deepspeed for what Strata does not do."""

from .._errors import StrataError


class NotSupportedError(StrataError):
    """A DeepSpeed feature Strata does not provide."""

    def __init__(self, message):
        super().__init__(message, "NotSupported")


def refuse(what, why):
    raise NotSupportedError(f"strata.deepspeed: {what}: {why}")
