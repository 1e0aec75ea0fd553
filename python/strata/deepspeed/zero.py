"""deepspeed.zero on Strata: Init (strata.init: parameters spilled while
the model is built), GatheredParameters (an engine's parameters readable,
and writable with modifier_rank, inside the context) and
register_external_parameter (strata's: a module's forward using another
module's parameter)."""

import contextlib

import torch

from .. import engine as _engine_mod
from .._group import ParamStatus as ZeroParamStatus  # noqa: F401
from .._grouping import register_external_parameter  # noqa: F401
from ..init_context import init as _strata_init


class Init(_strata_init):
    """deepspeed.zero.Init(module=None, data_parallel_group=None,
    mem_efficient_linear=True, remote_device=None, pin_memory=False,
    config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None):
    strata.init with the config given (parameters spilled module by module
    while the model is built). enabled=False builds the model as usual."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **kwargs):
        super().__init__(config_dict_or_path if config_dict_or_path is not None else config)
        self._enabled = enabled

    def __enter__(self):
        return super().__enter__() if self._enabled else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self._enabled else False


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """Inside the context each parameter's .data is its full value (the
    engine's fp32 master in the parameter's dtype); with modifier_rank set,
    what that rank writes into it is the parameter's new value on every rank
    (broadcast from it when torch.distributed is up) when the context ends.
    Parameters no Strata engine trains are left as they are."""
    if not enabled:
        yield
        return
    if isinstance(params, torch.nn.Parameter) or torch.is_tensor(params):
        params = [params]
    params = [p for p in params if p is not None]
    owned = []  # (engine, engine id, param, its data before)
    for p in params:
        found = _engine_mod.engine_of_parameter(p)
        if found is None:
            continue
        engine, pid = found
        before = p.data, getattr(p, "ds_status", None)
        value = engine.read_full_parameter(pid).to(p.dtype)
        p.data = value
        p.ds_status = ZeroParamStatus.AVAILABLE
        owned.append((engine, pid, p, before))
    try:
        yield
        if modifier_rank is not None:
            dist = torch.distributed
            for engine, pid, p, _ in owned:
                value = p.data.detach().float().contiguous()
                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast(value, src=modifier_rank)
                engine.write_full_parameter(pid, value)
    finally:
        for _, _, p, (data, status) in owned:
            p.data = data
            p.ds_status = status
