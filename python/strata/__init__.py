"""Strata: train a PyTorch model with its optimizer states and parameters
offloaded to CPU memory and NVMe, configured with a DeepSpeed JSON.

    import strata
    engine = strata.initialize(model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

A model bigger than host memory is built inside ``with strata.init(config):``
(strata.init_context): its parameters go to a spill store module by module.

See strata.engine for how parameters and gradients move, and docs/python.md
in the repository for what is supported.
"""

from ._errors import (FailedPreconditionError, InvalidArgumentError, NotFoundError,
                      ResourceExhaustedError, StrataError)
from .engine import (Engine, export, initialize, parse_config, register_external_parameter,
                     set_leaf_modules, write_safetensors)
from .init_context import init

__all__ = [
    "Engine",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "StrataError",
    "export",
    "init",
    "initialize",
    "parse_config",
    "register_external_parameter",
    "set_leaf_modules",
    "write_safetensors",
]
