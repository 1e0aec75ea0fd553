"""DeepSpeed's training API on Strata: a DeepSpeed script runs with one
changed import.

    import strata.deepspeed as deepspeed     # instead of: import deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data)

What it covers, with DeepSpeed's names, signatures, return values and
defaults: ``initialize`` (the 4-tuple; the config from ``config``,
``config_params`` or ``args.deepspeed_config``; ``training_data`` as a
DataLoader with a DistributedSampler across ranks), the engine's methods
scripts call (DeepSpeedEngine), checkpoints with tags, ``latest`` and
``client_state``, ``save_16bit_model(dir, filename)``,
``add_config_arguments``, ``init_distributed``, and the submodules
``deepspeed.zero`` (Init, GatheredParameters), ``deepspeed.comm``,
``deepspeed.accelerator`` (get_accelerator) and
``deepspeed.utils.zero_to_fp32``. What Strata does not do (pipeline, tensor
or expert parallelism; a client optimizer object) is refused at the call
with one line saying so.

``from deepspeed.accelerator import get_accelerator`` and the like keep
working: importing this module registers it, and its submodules, as
``deepspeed`` in sys.modules, unless a real DeepSpeed is installed (then
nothing is registered, and those imports get the real one: the script
should import them from strata.deepspeed).
"""

import argparse
import importlib.util
import json
import os
import sys

import torch

from .. import engine as _engine_mod
from .._errors import InvalidArgumentError
from . import accelerator, comm, moe, pipe, utils, zero  # noqa: F401
from ._refuse import NotSupportedError
from ._refuse import refuse as _refuse
from .comm import init_distributed

__version__ = "0.0.0+strata"

__all__ = ["DeepSpeedEngine", "NotSupportedError", "add_config_arguments", "init_distributed",
           "initialize", "accelerator", "comm", "moe", "pipe", "utils", "zero"]


class DeepSpeedEngine(_engine_mod.Engine):
    """strata.Engine with DeepSpeed's engine methods. Differences from
    strata.Engine: gradient_accumulation_steps() is a method (as in
    DeepSpeed), and the checkpoint methods take DeepSpeed's arguments."""

    def __init__(self, model, config, model_parameters=None):
        super().__init__(model, config, None, model_parameters)
        self.global_steps = 0  # optimizer steps applied
        self.global_samples = 0  # samples seen (micro-batches x batch x ranks)
        self.micro_steps = 0
        self._last_grad_norm = None
        self.lr_scheduler = None
        self.training_dataloader = None

    # ---- facts DeepSpeed scripts ask for --------------------------------------

    @property
    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self):
        return int(os.environ.get("RANK", "0"))

    @property
    def world_size(self):
        return int(os.environ.get("WORLD_SIZE", "1"))

    def gradient_accumulation_steps(self):
        return int(self.config["gradient_accumulation_steps"])

    def train_batch_size(self):
        return int(self.config["train_batch_size"])

    def train_micro_batch_size_per_gpu(self):
        return int(self.config["train_micro_batch_size_per_gpu"])

    def zero_optimization_stage(self):
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    def fp16_enabled(self):
        return bool(self.config.get("fp16", {}).get("enabled", False))

    def bfloat16_enabled(self):
        return bool(self.config.get("bf16", {}).get("enabled", False))

    def is_gradient_accumulation_boundary(self):
        """Whether the next step() ends an accumulation window (applies the
        optimizer), as in DeepSpeed."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_global_grad_norm(self):
        """The global L2 norm of the last applied window's gradients (None
        before the first)."""
        return self._last_grad_norm

    # ---- the loop --------------------------------------------------------------

    def step(self, lr_kwargs=None):
        stats = super().step()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.world_size
        if stats.get("applied"):
            self.global_steps += 1
            self._last_grad_norm = stats.get("grad_norm")
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        return stats

    def destroy(self):
        """Ends the engine (strata.Engine.close: the model gets its weights back)."""
        self.close()

    # ---- checkpoints -----------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Saves under save_dir/tag (default tag: global_step<N>), with
        `client_state` (any picklable dict, torch.save'd beside it, mode 0600)
        and, with save_latest, the tag in save_dir/latest. Every rank calls it.
        Returns True."""
        if tag is None:
            tag = f"global_step{self.global_steps}"
        tag = str(tag)
        _check_tag(tag)
        path = os.path.join(os.fspath(save_dir), tag)
        super().save_checkpoint(path, data_position=self.global_samples,
                                note=json.dumps({"global_steps": self.global_steps,
                                                 "micro_steps": self.micro_steps}))
        if self.global_rank == 0:
            state = dict(client_state or {})
            if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
                state.setdefault("_strata_lr_scheduler", self.lr_scheduler.state_dict())
            _write_private(os.path.join(path, "client_state.pt"),
                           lambda f: torch.save(state, f))
            if save_latest:
                _write_private(os.path.join(os.fspath(save_dir), "latest"),
                               lambda f: f.write(tag.encode()), mode=0o644)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Loads save_dir/tag (tag None: the one save_dir/latest names).
        Returns (load_path, client_state), or (None, None) when there is no
        `latest` to follow, as DeepSpeed does. Loading the module without
        the optimizer states is refused (a Strata checkpoint restores both)."""
        if not load_optimizer_states or load_module_only:
            _refuse("load_checkpoint(load_optimizer_states=False / load_module_only=True)",
                    "a Strata checkpoint restores the parameters with their optimizer states; "
                    "for the weights alone use deepspeed.utils.zero_to_fp32")
        if custom_load_fn is not None:
            _refuse("load_checkpoint(custom_load_fn=...)", "not supported")
        load_dir = os.fspath(load_dir)
        if tag is None:
            tag = read_latest(load_dir)
            if tag is None:
                return None, None
        tag = str(tag)
        _check_tag(tag)
        path = os.path.join(load_dir, tag)
        info = super().load_checkpoint(path)
        try:
            saved = json.loads(info.get("note") or "{}")
        except ValueError:
            saved = {}
        self.global_steps = int(saved.get("global_steps", info.get("optimizer_step", 0)))
        self.micro_steps = int(saved.get("micro_steps",
                                         self.global_steps * self.gradient_accumulation_steps()))
        self.global_samples = int(info.get("data_position", 0))
        client_state = {}
        cs = os.path.join(path, "client_state.pt")
        if os.path.exists(cs):
            # Any picklable dict, as DeepSpeed's client_state is: torch 2.6
            # and later load only tensors and plain containers by default.
            # The file is the one save_checkpoint wrote (mode 0600).
            client_state = torch.load(cs, weights_only=False)
        sched = client_state.pop("_strata_lr_scheduler", None)
        if (sched is not None and load_lr_scheduler_states and self.lr_scheduler is not None
                and hasattr(self.lr_scheduler, "load_state_dict")):
            self.lr_scheduler.load_state_dict(sched)
        return info.get("path", path), client_state

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """Writes the model's state_dict in the training dtype to
        save_dir/save_filename (safetensors when the name ends so; rank 0).
        Returns True."""
        os.makedirs(os.fspath(save_dir), exist_ok=True)
        if self.global_rank == 0:
            super().save_16bit_model(os.path.join(os.fspath(save_dir), save_filename))
        return True


def _check_tag(tag):
    if not tag or tag in (".", "..") or "/" in tag or "\0" in tag:
        raise InvalidArgumentError(f"checkpoint tag {tag!r}: must be one directory name",
                                   "InvalidArgument")


def _write_private(path, write, mode=0o600):
    """Writes a new file beside `path` (O_EXCL | O_NOFOLLOW) and renames it
    over `path`: a symlink at `path` is replaced, never followed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_latest(load_dir):
    """The tag save_dir/latest names, or None when there is none."""
    latest = os.path.join(os.fspath(load_dir), "latest")
    if not os.path.isfile(latest) or os.path.islink(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        return f.read().strip() or None


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments: --deepspeed, --deepspeed_config
    (and the deprecated --deepscale / --deepscale_config)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (Strata)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (accepted; Strata is always on)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_of(args, config, config_params):
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config",
                                                                        None)
    given = config if config is not None else config_params
    if config is not None and config_params is not None:
        raise InvalidArgumentError("initialize: config and config_params both given; pass one",
                                   "InvalidArgument")
    if given is not None and from_args is not None:
        raise InvalidArgumentError(
            "initialize: a config in args.deepspeed_config and one in the call; pass one",
            "InvalidArgument")
    cfg = given if given is not None else from_args
    if cfg is None:
        raise InvalidArgumentError(
            "initialize: no config: pass config=, config_params= or args with "
            "--deepspeed_config (add_config_arguments)", "InvalidArgument")
    return cfg


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training_dataloader,
    lr_scheduler). `optimizer` must be None (Strata runs the optimizer the
    config names); `lr_scheduler` may be a callable taking the engine's
    optimizer (a torch scheduler built on it), not a scheduler object bound
    to another optimizer; `mpu` and `mesh_param` are refused (no tensor or
    pipeline parallelism)."""
    if model is None:
        raise InvalidArgumentError("initialize: model is required", "InvalidArgument")
    if optimizer is not None:
        _refuse(f"initialize(optimizer={type(optimizer).__name__})",
                "Strata runs the optimizer the config's \"optimizer\" section names on its "
                "CPU or device Adam; remove the argument and describe it in the config "
                "(parameter groups: model_parameters)")
    if mpu is not None or mesh_param is not None:
        _refuse("initialize(mpu=/mesh_param=)", "tensor and pipeline parallelism are not "
                "supported; Strata is data parallel (ZeRO) only")
    # (A scheduler object: not callable, or bound to its optimizer.)
    if lr_scheduler is not None and (not callable(lr_scheduler)
                                     or hasattr(lr_scheduler, "optimizer")):
        _refuse(f"initialize(lr_scheduler={type(lr_scheduler).__name__})",
                "a scheduler object is bound to another optimizer; pass a callable that "
                "builds it from the engine's optimizer, or a config \"scheduler\" section")
    if dist_init_required:
        init_distributed()
    cfg = _config_of(args, config, config_params)
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        model_parameters = list(model_parameters)
    # (model.parameters(), as DeepSpeed examples pass it, is every parameter:
    # the default grouping.)
    if model_parameters is not None and all(isinstance(p, torch.nn.Parameter)
                                            for p in model_parameters):
        if {id(p) for p in model_parameters} == {id(p) for p in model.parameters()}:
            model_parameters = None
    engine = DeepSpeedEngine(model, cfg, model_parameters)
    scheduler = lr_scheduler(engine.optimizer) if lr_scheduler is not None else None
    engine.lr_scheduler = scheduler
    loader = None
    if training_data is not None:
        loader = _dataloader(engine, training_data, collate_fn)
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, scheduler


def _dataloader(engine, data, collate_fn):
    sampler = None
    if engine.world_size > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(
            data, num_replicas=engine.world_size, rank=engine.global_rank)
    return torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                       sampler=sampler, collate_fn=collate_fn)


def _register_as_deepspeed():
    # Only where no real DeepSpeed is installed: never shadow it.
    if "deepspeed" in sys.modules and sys.modules["deepspeed"] is not sys.modules[__name__]:
        return
    try:
        real = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        real = None
    if real is not None:
        return
    this = sys.modules[__name__]
    sys.modules["deepspeed"] = this
    for sub in ("accelerator", "comm", "moe", "moe.layer", "moe.utils", "pipe", "utils",
                "utils.zero_to_fp32", "zero"):
        sys.modules[f"deepspeed.{sub}"] = sys.modules[f"{__name__}.{sub}"]


_register_as_deepspeed()
