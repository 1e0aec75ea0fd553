"""Exceptions raised by the Strata engine.

Every engine call that fails raises a :class:`StrataError` carrying the
engine's Status message (which names what was wrong: the config key path and
allowed values, the file and errno, the bytes asked for and the budget left)
and its code (``"InvalidArgument"``, ``"ResourceExhausted"``, ...).
Subclasses also derive from the matching Python builtin, so
``except ValueError`` catches a bad config.
"""


class StrataError(RuntimeError):
    """An engine call failed; ``code`` is the Status code's name."""

    def __init__(self, message, code="Unknown"):
        super().__init__(message)
        self.code = code


class InvalidArgumentError(StrataError, ValueError):
    """A bad config or argument (the message names the key path)."""


class NotFoundError(StrataError, FileNotFoundError):
    """A file, checkpoint, parameter or module that does not exist."""


class ResourceExhaustedError(StrataError, MemoryError):
    """A budget (HBM, pinned memory, disk space) would be exceeded."""


class FailedPreconditionError(StrataError):
    """The call is not valid now (e.g. a checkpoint in the middle of a window)."""


_BY_CODE = {
    "InvalidArgument": InvalidArgumentError,
    "NotFound": NotFoundError,
    "ResourceExhausted": ResourceExhaustedError,
    "FailedPrecondition": FailedPreconditionError,
}


def error_class(code):
    """The exception class for a Status code name."""
    return _BY_CODE.get(code, StrataError)
