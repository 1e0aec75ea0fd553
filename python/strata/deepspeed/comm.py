"""deepspeed.comm on Strata: the basics scripts call, over
torch.distributed's default group when it is up (gloo on the host device,
NCCL on GPUs), else one process."""

import datetime
import os

import torch

ReduceOp = torch.distributed.ReduceOp if torch.distributed.is_available() else None


def _up():
    d = torch.distributed
    return d.is_available() and d.is_initialized()


def is_initialized():
    return _up()


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=datetime.timedelta(minutes=30), init_method=None,
                     dist_init_required=None, config=None, rank=-1, world_size=-1):
    """torch.distributed's default group from the launcher's environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: strata.launch or torchrun),
    with NCCL where CUDA is, else gloo. A process started without a launcher
    is a group of one, as DeepSpeed makes it (RANK=0, LOCAL_RANK=0,
    WORLD_SIZE=1, MASTER_ADDR=127.0.0.1, a free MASTER_PORT set when unset).
    Idempotent."""
    if _up():
        return
    if init_method is None and "MASTER_ADDR" not in os.environ and \
            int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from ..launch import free_port
        port = free_port()
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                     ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                     ("MASTER_PORT", str(port))):
            os.environ.setdefault(k, v)
    from .._torch_compat import rendezvous_env
    os.environ.update(rendezvous_env())  # USE_LIBUV=0 for a torch without libuv
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not (torch.cuda.is_available() and
                                  torch.distributed.is_nccl_available()):
        # A GPU script's default (`--backend nccl`) on a machine without
        # CUDA or NCCL: gloo, as DeepSpeed picks its accelerator's backend.
        import warnings
        warnings.warn("init_distributed: dist_backend 'nccl' asked for, but this torch has no "
                      "CUDA device or NCCL here: using 'gloo'", stacklevel=2)
        backend = "gloo"
    kwargs = {"backend": backend, "timeout": timeout}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    torch.distributed.init_process_group(**kwargs)


def get_rank(group=None):
    return torch.distributed.get_rank(group) if _up() else int(os.environ.get("RANK", "0"))


def get_world_size(group=None):
    return torch.distributed.get_world_size(group) if _up() else \
        int(os.environ.get("WORLD_SIZE", "1"))


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None, async_op=False, device_ids=None):
    """device_ids (NCCL: the GPUs the barrier runs on) only when given."""
    if _up():
        extra = {} if device_ids is None else {"device_ids": device_ids}
        return torch.distributed.barrier(group=group, async_op=async_op, **extra)
    return None


def all_reduce(tensor, op=None, group=None, async_op=False):
    """In place over the ranks (SUM by default); one process: unchanged."""
    if _up():
        return torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM,
                                            group=group, async_op=async_op)
    return None


def broadcast(tensor, src, group=None, async_op=False):
    if _up():
        return torch.distributed.broadcast(tensor, src, group=group, async_op=async_op)
    return None
