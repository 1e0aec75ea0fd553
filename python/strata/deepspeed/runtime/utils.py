"""deepspeed.runtime.utils on Strata: the helpers DeepSpeed scripts call
(see_memory_usage, set_random_seed)."""

import logging
import os
import random

_log = logging.getLogger("strata.deepspeed")


def set_random_seed(seed):
    """Seeds Python's, NumPy's (where installed) and torch's generators."""
    import torch
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def see_memory_usage(message, force=False):
    """Logs `message` with this process's resident memory and, where CUDA
    is in use, the device memory torch holds (only when `force`, as
    DeepSpeed's, which logs on rank 0 only)."""
    if not force:
        return
    import torch
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_rank() != 0:
        return
    rss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    parts = [message]
    if rss is not None:
        parts.append(f"CPU resident {rss / 2**30:.2f} GB")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(f"MA {torch.cuda.memory_allocated() / 2**30:.2f} GB "
                     f"Max_MA {torch.cuda.max_memory_allocated() / 2**30:.2f} GB "
                     f"CA {torch.cuda.memory_reserved() / 2**30:.2f} GB")
    _log.info(" | ".join(parts))
