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
import contextlib
import importlib.util
import json
import os
import pickle
import sys
import warnings

import torch

from .. import _config as _config_mod
from .. import engine as _engine_mod
from .._checkpoint_tags import check_tag, read_latest, tag_dir, write_latest
from .._errors import FailedPreconditionError, InvalidArgumentError, StrataError
from .._private_fs import (check_replaceable, make_dirs, make_private_dir, open_regular_file,
                           write_file_replacing)
from . import _client_optimizer
from . import accelerator, checkpointing, comm, moe, ops, pipe, runtime, utils, zero  # noqa: F401
from ._refuse import NotSupportedError
from ._refuse import refuse as _refuse
from .comm import init_distributed
from .runtime.config import DeepSpeedConfigError

__version__ = "0.0.0+strata"

__all__ = ["DeepSpeedEngine", "NotSupportedError", "add_config_arguments", "init_distributed",
           "initialize", "read_latest", "DeepSpeedConfigError", "accelerator", "checkpointing",
           "comm", "moe", "ops", "pipe", "runtime", "utils", "zero"]

# The file beside a tag's Strata checkpoint that holds client_state; the
# key of the lr scheduler's state in it, and the key under which values
# are kept as JSON text (_client_state_for_file).
CLIENT_STATE = "client_state.pt"
_SCHEDULER_KEY = "_strata_lr_scheduler"
_JSON_KEY = "_strata_json"

# Set to 1: load_checkpoint unpickles client_state.pt whole (any object,
# which runs whatever code the file names), as DeepSpeed does.
TRUST_CLIENT_STATE_ENV = "STRATA_TRUST_CLIENT_STATE"


class DeepSpeedEngine(_engine_mod.Engine):
    """strata.Engine with DeepSpeed's engine methods. Differences from
    strata.Engine: gradient_accumulation_steps() is a method (as in
    DeepSpeed), the checkpoint methods take DeepSpeed's arguments, step()
    returns None (the statistics are in ``last_stats``) and backward()
    returns the loss."""

    def __init__(self, model, config, model_parameters=None):
        super().__init__(model, config, None, model_parameters)
        self.global_steps = 0  # optimizer steps applied
        self.global_samples = 0  # samples of the windows ended (train_batch_size each)
        self.micro_steps = 0
        self.skipped_steps = 0  # windows whose step an overflow skipped (fp16)
        self._step_applied = False
        self._boundary_override = None  # set_gradient_accumulation_boundary
        self._last_grad_norm = None
        self.lr_scheduler = None
        self.training_dataloader = None
        self.client_optimizer = None  # the optimizer given to initialize, if any

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

    @property
    def dp_world_size(self):
        return self.world_size

    def gradient_accumulation_steps(self):
        return int(self.config["gradient_accumulation_steps"])

    def gradient_clipping(self):
        return float(self.config["gradient_clipping"])

    def get_lr(self):
        """The learning rate of the next optimizer step, one per param group:
        with the script's own optimizer, its groups' (where its scheduler
        writes them; the engine takes them at the step)."""
        client = self.client_optimizer
        if client is not None:
            return [g["lr"] for g in _client_optimizer.nonempty_groups(client)]
        return super().get_lr()

    def get_mom(self):
        """Each param group's betas (DeepSpeed's momentum for Adam): those of
        the next optimizer step, as the config's OneCycle schedule sets them
        when it cycles momentum (every group's then), else the group's."""
        section = self.config.get("scheduler") or {}
        params = section.get("params") or {}
        if section.get("type") == "OneCycle" and params.get("cycle_momentum", True):
            from .. import _strata
            v = _strata.schedule_at(json.dumps(self.config), self.global_steps, "scheduler")
            return [(v["beta1"], v["beta2"])] * len(self.optimizer.param_groups)
        return [tuple(g["betas"]) if "betas" in g else None for g in self.optimizer.param_groups]

    def was_step_applied(self):
        """Whether the last step() applied the optimizer (False within a
        window, or when an overflow skipped the step)."""
        return self._step_applied

    # The model's parameters and modules, as DeepSpeed's engine (a Module
    # wrapping the model) gives them.
    def parameters(self, recurse=True):
        return self.module.parameters(recurse)

    def named_parameters(self, prefix="", recurse=True):
        return self.module.named_parameters(prefix, recurse)

    def buffers(self, recurse=True):
        return self.module.buffers(recurse)

    def named_buffers(self, prefix="", recurse=True):
        return self.module.named_buffers(prefix, recurse)

    def modules(self):
        return self.module.modules()

    def named_modules(self, *args, **kwargs):
        return self.module.named_modules(*args, **kwargs)

    def to(self, *args, **kwargs):
        """The engine's own device and dtype only (it owns the parameters):
        returns the engine; another is refused naming both."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        same_device = device is None or torch.device(device).type == self.device.type and (
            torch.device(device).index in (None, self.device.index))
        if not same_device or (dtype is not None and dtype != self.dtype):
            _refuse(f"engine.to({', '.join(map(str, args))})",
                    f"the engine keeps the parameters on {self.device} in {self.dtype}; set the "
                    "device and dtype in the config (strata.device, bf16/fp16)")
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's context for micro-batches whose gradients are not
        reduced yet. Strata reduces a window's gradients once, at its end,
        whatever the context: the same result, so this does nothing."""
        yield

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Declares whether the next step() ends the window. Strata's window
        is gradient_accumulation_steps micro-batches: a declaration that
        disagrees is refused at that step."""
        self._boundary_override = bool(is_boundary)

    def empty_partition_cache(self):
        """Releases the parameters the engine holds fetched between calls."""
        self._check_open()
        if self._call_depth or self._in_backward:
            return
        for g in self._groups:
            if not g.fwd_depth:
                g.release()

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
        if self._boundary_override is not None:
            return self._boundary_override
        return self._engine_boundary()

    def _engine_boundary(self):
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """engine.backward as DeepSpeed's: returns the loss."""
        if not scale_wrt_gas:
            _refuse("backward(scale_wrt_gas=False)", "the engine divides each micro-batch's "
                    "loss by gradient_accumulation_steps, as DeepSpeed does by default")
        super().backward(loss, retain_graph=retain_graph)
        return loss

    def get_global_grad_norm(self):
        """The global L2 norm of the last applied window's gradients (None
        before the first)."""
        return self._last_grad_norm

    # ---- the loop --------------------------------------------------------------

    def _link_client_optimizer(self, client):
        """The optimizer given to initialize (strata.deepspeed._client_optimizer)."""
        self.client_optimizer = client
        self._client_lrs = _client_optimizer.link(client, self)

    def step(self, lr_kwargs=None):
        """Ends a micro-batch; at the end of a window applies the optimizer
        and steps the lr scheduler. Returns None, as DeepSpeed's (the
        step's statistics: ``last_stats``)."""
        if self._boundary_override is not None:
            declared, self._boundary_override = self._boundary_override, None
            if declared != self._engine_boundary():
                raise FailedPreconditionError(
                    f"step: set_gradient_accumulation_boundary({declared}), but this is "
                    f"micro-batch {self.micro_steps % self.gradient_accumulation_steps() + 1} of "
                    f"a window of gradient_accumulation_steps "
                    f"{self.gradient_accumulation_steps()}: Strata's windows are the config's "
                    "(the step did not run)", "FailedPrecondition")
        client = self.client_optimizer
        if client is not None:
            _client_optimizer.sync_lrs(client, self.optimizer.param_groups, self._client_lrs)
        stats = super().step()
        self.micro_steps += 1
        self._step_applied = bool(stats.get("applied"))
        if stats.get("applied") or stats.get("overflow"):  # the window ended
            self.global_samples += self.train_batch_size()
        if stats.get("overflow"):
            self.skipped_steps += 1
        if stats.get("applied"):
            self.global_steps += 1
            self._last_grad_norm = stats.get("grad_norm")
            if client is not None:
                _client_optimizer.on_engine_step(client, self.optimizer.param_groups,
                                                 self._client_lrs,
                                                 self.config.get("scheduler") is not None)
            # (The config's schedule is the engine's: it moved with the step.)
            if self.lr_scheduler is not None and not isinstance(self.lr_scheduler,
                                                                ConfigLRScheduler):
                self.lr_scheduler.step(**(lr_kwargs or {}))

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin"):
        """DeepSpeed's older name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def destroy(self):
        """Ends the engine (strata.Engine.close: the model gets its weights back)."""
        self.close()

    # ---- checkpoints -----------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Saves under save_dir/tag (default tag: global_step<N>), with
        `client_state` (a dict, torch.save'd beside it as client_state.pt)
        and, with save_latest, the tag in save_dir/latest. Every rank calls
        it. Returns True.

        The tag directory is made with mode 0700; one already there must be
        a directory (not a symlink) of this user's, not writable by group or
        others, or the save is refused naming it (whoever can write into it
        could replace client_state.pt before it is loaded). client_state.pt
        and latest are new files of mode 0600 renamed into place; a symlink,
        FIFO or directory there is refused and left alone. Values of
        client_state that are JSON's (numbers, strings, lists, str-keyed
        dicts) are kept as JSON text, tensors as torch.save keeps them: both
        load without unpickling code. Other objects (an argparse.Namespace,
        a custom class) are saved, but load only with
        STRATA_TRUST_CLIENT_STATE=1 (load_checkpoint)."""
        if tag is None:
            tag = f"global_step{self.global_steps}"
        tag = str(tag)
        check_tag(tag)
        save_dir = os.fspath(save_dir)
        path = os.path.join(save_dir, tag)
        # Before anything is written, on every rank: the tag directory is
        # this user's alone, and the files rank 0 will replace are regular
        # ones (or none).
        make_dirs(save_dir, "checkpoint directory")
        make_private_dir(path, "checkpoint tag directory")
        check_replaceable(os.path.join(path, CLIENT_STATE), "checkpoint client_state file")
        if save_latest:
            check_replaceable(os.path.join(save_dir, "latest"), "checkpoint latest file")
        super().save_checkpoint(path, data_position=self.global_samples,
                                note=json.dumps({"global_steps": self.global_steps,
                                                 "micro_steps": self.micro_steps}))
        if self.global_rank == 0:
            state = dict(client_state or {})
            if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
                state.setdefault(_SCHEDULER_KEY, self.lr_scheduler.state_dict())
            state = _client_state_for_file(state)
            write_file_replacing(os.path.join(path, CLIENT_STATE), lambda f: torch.save(state, f),
                                 "checkpoint client_state file")
            if save_latest:
                write_latest(save_dir, tag)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Loads load_dir/tag (tag None: the one load_dir/latest names).
        Returns (load_path, client_state), or (None, None) when there is no
        `latest` to follow, as DeepSpeed does; a `latest` that is there but
        unusable (a symlink, directory or FIFO, empty, or not naming one
        directory under load_dir) is refused naming it.

        load_module_only=True (fine-tuning) reads the weights alone (the
        fp32 masters, as zero_to_fp32 does) into this engine's parameters;
        its optimizer states, counters and schedule stay as they are.
        load_optimizer_states=False without it is refused (the states come
        with the counters and the schedule).

        What loading trusts: the tag directory, client_state.pt and latest
        must be this user's (owned by the effective uid, not writable by
        group or others; the tag directory not a symlink, the files regular
        ones), else the load is refused naming the path, before anything is
        read. client_state.pt is loaded with torch.load(weights_only=True):
        tensors, numbers, strings, None and plain containers, never code. A
        file holding other objects is refused (FailedPreconditionError) unless
        the environment has STRATA_TRUST_CLIENT_STATE=1, which unpickles it
        whole as DeepSpeed does: set it only when no one else could have
        written the checkpoint. (On torch 1.x the same goes for a Python
        float inside a value that also holds tensors.)"""
        if custom_load_fn is not None:
            _refuse("load_checkpoint(custom_load_fn=...)", "not supported")
        if not load_optimizer_states and not load_module_only:
            _refuse("load_checkpoint(load_optimizer_states=False) without load_module_only",
                    "a Strata checkpoint restores the optimizer states with the step counters "
                    "and the schedule; pass load_module_only=True for the weights alone (the "
                    "engine's counters, optimizer states and schedule then start afresh)")
        load_dir = os.fspath(load_dir)
        if tag is None:
            tag = read_latest(load_dir, private=True)
            if tag is None:
                return None, None
        path = tag_dir(load_dir, tag, private=True)
        # client_state first: a refused one leaves the engine as it was.
        client_state = _load_client_state(os.path.join(path, CLIENT_STATE))
        if load_module_only:
            # Fine-tuning: the weights (the fp32 masters, every file
            # verified) into this engine's parameters; its optimizer states,
            # counters and schedule stay as they are.
            state = utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(load_dir, tag)
            self.load_state_dict(state, strict=load_module_strict)
            client_state.pop(_SCHEDULER_KEY, None)
            return path, client_state
        info = super().load_checkpoint(path)
        try:
            saved = json.loads(info.get("note") or "{}")
        except ValueError:
            saved = {}
        self.global_steps = int(saved.get("global_steps", info.get("optimizer_step", 0)))
        self.micro_steps = int(saved.get("micro_steps",
                                         self.global_steps * self.gradient_accumulation_steps()))
        self.global_samples = int(info.get("data_position", 0))
        sched = client_state.pop(_SCHEDULER_KEY, None)
        if (sched is not None and load_lr_scheduler_states and self.lr_scheduler is not None
                and hasattr(self.lr_scheduler, "load_state_dict")):
            self.lr_scheduler.load_state_dict(sched)
        return info.get("path", path), client_state

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """Writes the model's state_dict in the training dtype to
        save_dir/save_filename (safetensors when the name ends so), a new
        file of mode 0600 renamed into place (strata.Engine's
        save_16bit_model). Missing directories are made with mode 0700.
        Every rank calls it (the state_dict is gathered from all), rank 0
        writes. Returns True."""
        make_dirs(save_dir, "save_16bit_model directory")
        path = os.path.join(os.fspath(save_dir), save_filename)
        state_dict = self._16bit_state_dict(path)
        if self.global_rank == 0:
            self._write_16bit_model(state_dict, path)
        return True


def _client_state_for_file(state):
    """client_state as saved: each value that JSON gives back exactly
    (numbers, strings, bools, None, lists and str-keyed dicts of them: the
    lr scheduler's state_dict, an epoch, a loss) as JSON text under
    _JSON_KEY, the rest (tensors, and what holds them) as it is. torch's
    weights-only loader reads JSON text on every torch, where torch 1.13's
    takes no Python float."""
    if _JSON_KEY in state:
        raise InvalidArgumentError(f"save_checkpoint: client_state key {_JSON_KEY!r} is "
                                   "reserved for Strata; rename it", "InvalidArgument")
    out, as_json = {}, {}
    for key, value in state.items():
        if type(key) in (str, int) and _is_json(value):
            as_json[key] = json.dumps(value)
        else:
            out[key] = value
    if as_json:
        out[_JSON_KEY] = as_json
    return out


def _is_json(value):
    """Whether json.loads(json.dumps(value)) gives back `value` with its
    types: plain numbers, strings, bools and None, in lists and dicts with
    str keys (not a tuple, an OrderedDict, an int subclass)."""
    t = type(value)
    if value is None or t in (str, int, float, bool):
        return True
    if t is list:
        return all(_is_json(v) for v in value)
    if t is dict:
        return all(type(k) is str and _is_json(v) for k, v in value.items())
    return False


def _client_state_from_file(state, path):
    """_client_state_for_file's inverse (a client_state saved before values
    were kept as JSON has no _JSON_KEY and is returned as it is)."""
    as_json = state.pop(_JSON_KEY, None)
    for key, text in (as_json or {}).items():
        try:
            state[key] = json.loads(text)
        except (TypeError, ValueError) as e:
            raise StrataError(f"checkpoint client_state file {path}: value {key!r} is not JSON "
                              f"({e})", "DataLoss") from None
    return state


def _trust_client_state():
    return os.environ.get(TRUST_CLIENT_STATE_ENV) == "1"


def _load_client_state(path):
    """client_state.pt's dict ({} when there is none): a regular file of this
    user's (open_regular_file, private), loaded with weights_only=True unless
    STRATA_TRUST_CLIENT_STATE=1."""
    what = "checkpoint client_state file"
    try:
        fd = open_regular_file(path, what, private=True)
    except FileNotFoundError:
        return {}
    trust = _trust_client_state()
    with os.fdopen(fd, "rb") as f:
        try:
            state = torch.load(f, weights_only=not trust)
        except pickle.UnpicklingError as e:
            if trust:
                raise StrataError(f"{what} {path}: cannot be read ({e})", "DataLoss") from None
            reason = _reason(e)
            raise FailedPreconditionError(
                f"{what} {path}: torch's weights-only loader refused it ({reason}"
                f"{_old_torch_note(reason)}): objects other than tensors, numbers, strings and "
                "plain containers are not unpickled, as that can run code the file names; if no "
                f"one else can write this checkpoint, set {TRUST_CLIENT_STATE_ENV}=1 to load it "
                "whole, as DeepSpeed does", "FailedPrecondition") from None
        except (RuntimeError, EOFError, ValueError) as e:
            raise StrataError(f"{what} {path}: cannot be read as torch.save's format: "
                              f"{_reason(e)}", "DataLoss") from None
    if not isinstance(state, dict):
        raise StrataError(f"{what} {path}: holds a {type(state).__name__}, not the client_state "
                          "dict", "DataLoss")
    return _client_state_from_file(state, path)


def _reason(error):
    """The part of torch's (several lines long) message that says what was
    refused, on one line."""
    text = str(error)
    mark = "WeightsUnpickler error: "
    if mark in text:
        text = text.split(mark, 1)[1]
    line = " ".join(text.split()).split(". ", 1)[0]
    return line if len(line) <= 200 else line[:200] + "..."


def _old_torch_note(reason):
    # Pickle's opcode 71 is BINFLOAT, which torch 1.x's weights-only
    # unpickler does not know.
    if "operand 71" in reason and int(torch.__version__.split(".", 1)[0]) < 2:
        return ": a Python float beside tensors, which torch 1.x's weights-only loader cannot read"
    return ""


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


def _with_optimizer(cfg, section):
    """The config with `section` as its "optimizer": the optimizer given to
    initialize takes precedence over the config's, as in DeepSpeed (a
    different section there is dropped with a warning)."""
    text, _ = _config_mod.config_text(cfg)
    try:
        parsed = json.loads(text)
    except ValueError:
        return cfg  # the engine's parser names what is wrong
    if not isinstance(parsed, dict):
        return cfg
    if "optimizer" in parsed and parsed["optimizer"] != section:
        warnings.warn("initialize: optimizer= is used and the config's \"optimizer\" section is "
                      "ignored, as DeepSpeed does when it is given an optimizer", stacklevel=3)
    parsed["optimizer"] = section
    return parsed


def _without_scheduler(cfg):
    """The config without its "scheduler" section, warning that it is
    ignored: a scheduler given to initialize takes precedence over the
    config's, as in DeepSpeed (0.10 and later). A config that is not a JSON
    object is left for the engine's parser to name what is wrong."""
    try:
        text, _ = _config_mod.config_text(cfg)
        parsed = json.loads(text)
    except (OSError, ValueError):
        return cfg
    if not isinstance(parsed, dict) or "scheduler" not in parsed:
        return cfg
    warnings.warn("initialize: lr_scheduler= is used and the config's \"scheduler\" section "
                  "is ignored, as DeepSpeed does when it is given a scheduler", stacklevel=3)
    del parsed["scheduler"]
    return parsed


class ConfigLRScheduler:
    """The config's "scheduler" section (WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle, LRRangeTest) as the object DeepSpeed's
    initialize returns for it and keeps as ``engine.lr_scheduler``. The
    schedule itself is the engine's, a function of the optimizer steps
    applied (an overflow-skipped step does not move it), which engine.step()
    advances and a checkpoint restores; this object reads it.

    ``last_batch_iteration`` is the applied steps less one (DeepSpeed's
    count: -1 before the first); ``get_lr()`` and ``get_last_lr()`` are the
    learning rate of the next optimizer step, one per param group (the lr
    DeepSpeed's scheduler has put into the param groups); ``state_dict()``
    is DeepSpeed's (``{"last_batch_iteration": N}``), and
    ``load_state_dict`` checks it against the engine's restored position.
    ``step()`` is refused: engine.step() steps the schedule, as DeepSpeed's
    engine steps a config scheduler, so a script's own call would step it
    twice."""

    def __init__(self, engine):
        self._engine = engine
        self.optimizer = engine.optimizer
        section = engine.config["scheduler"]
        self.type = section.get("type")
        self.params = dict(section.get("params") or {})

    @property
    def last_batch_iteration(self):
        return self._engine.global_steps - 1

    def get_lr(self):
        return self._engine.get_lr()

    def get_last_lr(self):
        return self._engine.get_lr()

    def get_mom(self):
        """OneCycle's: the momentum (beta1, beta2) per param group at
        last_batch_iteration, as DeepSpeed's OneCycle.get_mom() computes it
        (None when it does not cycle momentum). Before the first step that
        is (cycle_max_mom, 0.99), while the first step itself runs with
        (cycle_min_mom, 0.99), the betas DeepSpeed's OneCycle puts into the
        optimizer when it is built (engine.get_mom() gives those); from then
        on the two agree."""
        if self.type != "OneCycle":
            raise AttributeError(f"the config's {self.type} scheduler has no get_mom() (as "
                                 "DeepSpeed's: only OneCycle cycles momentum)")
        if not self.params.get("cycle_momentum", True):
            return None
        groups = len(self.optimizer.param_groups)
        if self.last_batch_iteration < 0:
            return [(float(self.params.get("cycle_max_mom", 0.9)), 0.99)] * groups
        return self._engine.get_mom()

    def step(self, last_batch_iteration=None, **kwargs):
        _refuse(f"lr_scheduler.step() of the config's {self.type} scheduler",
                "engine.step() steps the config's scheduler at each optimizer step, as "
                "DeepSpeed's engine does, so this call would step it a second time; remove it, "
                "or drop the config's \"scheduler\" section and pass your own scheduler as "
                "initialize(lr_scheduler=...)")

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict):
        saved = state_dict.get("last_batch_iteration") if isinstance(state_dict, dict) else None
        if not isinstance(saved, int):
            raise InvalidArgumentError(
                f"lr_scheduler.load_state_dict: the config's {self.type} scheduler takes "
                f"{{'last_batch_iteration': int}}, not {state_dict!r:.200}", "InvalidArgument")
        if saved != self.last_batch_iteration:
            raise FailedPreconditionError(
                f"lr_scheduler.load_state_dict: last_batch_iteration {saved}, but the engine's "
                f"schedule is at {self.last_batch_iteration} ({self._engine.global_steps} "
                "optimizer steps applied): the config's schedule follows the engine's step, "
                "which engine.load_checkpoint restores", "FailedPrecondition")

    def __repr__(self):
        return (f"ConfigLRScheduler(type={self.type!r}, "
                f"last_batch_iteration={self.last_batch_iteration})")


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training_dataloader,
    lr_scheduler). `optimizer` may be a torch.optim.Adam or AdamW object, a
    callable building one from the parameters, or DeepSpeedCPUAdam /
    FusedAdam (strata.deepspeed._client_optimizer: run as Strata's
    optimizer, its param groups' lr read at each step), taking precedence
    over a config "optimizer" section; `lr_scheduler` may be a callable
    taking the optimizer (a torch scheduler built on it), or a scheduler
    object bound to the optimizer given, and takes precedence over a config "scheduler"
    section (ignored then, with a warning, as in DeepSpeed); with a config
    "scheduler" section and no `lr_scheduler` the returned scheduler is a
    ConfigLRScheduler; `mpu` and `mesh_param` are refused (no tensor or
    pipeline parallelism)."""
    if model is None:
        raise InvalidArgumentError("initialize: model is required", "InvalidArgument")
    if mpu is not None or mesh_param is not None:
        _refuse("initialize(mpu=/mesh_param=)", "tensor and pipeline parallelism are not "
                "supported; Strata is data parallel (ZeRO) only")
    client = None
    if optimizer is not None:
        client = _client_optimizer.build(optimizer, model, model_parameters)
    # (A scheduler object: not callable, or bound to its optimizer, which may
    # be the one given.)
    if lr_scheduler is not None and (not callable(lr_scheduler) or hasattr(
            lr_scheduler, "optimizer")) and (client is None
                                             or getattr(lr_scheduler, "optimizer", None)
                                             is not client):
        _refuse(f"initialize(lr_scheduler={type(lr_scheduler).__name__})",
                "a scheduler object is bound to another optimizer than the one given to "
                "initialize; pass a callable that builds it from the engine's optimizer, or a "
                "config \"scheduler\" section")
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
    if lr_scheduler is not None:
        cfg = _without_scheduler(cfg)
    if client is not None:
        section, model_parameters = _client_optimizer.translate(client, model)
        cfg = _with_optimizer(cfg, section)
    try:
        _config_mod.parse_config(cfg)
    except InvalidArgumentError as e:
        # (What DeepSpeed raises for a bad config, and still a ValueError.)
        raise DeepSpeedConfigError(str(e), e.code) from e
    engine = DeepSpeedEngine(model, cfg, model_parameters)
    if client is not None:
        engine._link_client_optimizer(client)
    if engine.config.get("scheduler") is not None:
        scheduler = ConfigLRScheduler(engine)
    elif lr_scheduler is not None and (not callable(lr_scheduler)
                                       or hasattr(lr_scheduler, "optimizer")):
        scheduler = lr_scheduler  # bound to the optimizer given (checked above)
    else:
        # A callable: given the optimizer the script gave, else the engine's.
        scheduler = (lr_scheduler(client if client is not None else engine.optimizer)
                     if lr_scheduler is not None else None)
    engine.lr_scheduler = scheduler
    loader = None
    if training_data is not None:
        loader = _dataloader(engine, training_data, collate_fn)
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, scheduler


def _dataloader(engine, data, collate_fn):
    """DeepSpeed's training_data loader: micro-batches drawn by a
    DistributedSampler over the ranks (shuffled, at every world size, one
    included), exposed as ``loader.data_sampler``."""
    sampler = torch.utils.data.distributed.DistributedSampler(
        data, num_replicas=engine.world_size, rank=engine.global_rank)
    loader = torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                         sampler=sampler, collate_fn=collate_fn)
    loader.data_sampler = sampler
    return loader


def _register_as_deepspeed(alias=False):
    """This package and its submodules as `deepspeed` in sys.modules: only
    where no real DeepSpeed is installed (never shadowing it), or when the
    opt-in alias package (strata.deepspeed.alias) asks."""
    this = sys.modules[__name__]
    if not alias:
        if "deepspeed" in sys.modules and sys.modules["deepspeed"] is not this:
            return
        try:
            real = importlib.util.find_spec("deepspeed")
        except (ImportError, ValueError):
            real = None
        if real is not None:
            from .alias import is_alias_file
            if real.origin is None or not is_alias_file(real.origin):
                return
    sys.modules["deepspeed"] = this
    for sub in ("accelerator", "checkpointing", "comm", "moe", "moe.layer", "moe.utils", "ops",
                "ops.adam", "pipe", "runtime", "runtime.config", "runtime.lr_schedules",
                "runtime.utils", "utils", "utils.zero_to_fp32",
                "zero"):
        sys.modules[f"deepspeed.{sub}"] = sys.modules[f"{__name__}.{sub}"]


_register_as_deepspeed()
