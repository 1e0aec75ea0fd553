"""deepspeed.checkpointing on Strata: activation checkpointing as DeepSpeed
scripts call it. checkpoint(function, *args) is torch's reentrant
checkpoint (DeepSpeed's CheckpointFunction is reentrant too): the
function's activations are recomputed in backward, with the engine's
parameters fetched for the recomputation. configure() takes DeepSpeed's
arguments; its memory options (partition_activations, checkpoint_in_cpu,
contiguous_memory_optimization) change where DeepSpeed keeps the saved
inputs, not the result, and have no effect here."""

import torch
import torch.utils.checkpoint

from ._refuse import refuse

_configured = False


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None):
    """DeepSpeed's configure; an `mpu_` (model parallelism) is refused."""
    global _configured
    if mpu_ is not None:
        refuse("checkpointing.configure(mpu_=...)", "tensor and pipeline parallelism are not "
               "supported; Strata is data parallel (ZeRO) only")
    _configured = True


def is_configured():
    return _configured


def checkpoint(function, *args):
    """function(*args) with its activations recomputed in backward."""
    if torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)
    return function(*args)


def reset():
    """DeepSpeed clears its saved-input buffers between iterations; none here."""
