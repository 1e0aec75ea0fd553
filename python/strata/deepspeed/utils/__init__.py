"""deepspeed.utils on Strata: zero_to_fp32, RepeatingLoader."""

from . import zero_to_fp32  # noqa: F401


class RepeatingLoader:
    """DeepSpeed's RepeatingLoader: iterates `loader` again from its start
    each time it is exhausted, so that ``next()`` never stops."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
