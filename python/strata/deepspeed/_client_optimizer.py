"""initialize(optimizer=...): the optimizer a DeepSpeed script builds itself
(a torch.optim.Adam or AdamW object, a callable that builds one from the
parameters, or DeepSpeed's DeepSpeedCPUAdam / FusedAdam), run as Strata's
optimizer with the same arithmetic.

What is read from it: its type (Adam with L2 weight decay, AdamW with
decoupled weight decay), and each non-empty param group's parameters, lr,
betas, eps and weight_decay; they become the config's "optimizer" section
and initialize's model_parameters groups. Flags that change the arithmetic
(amsgrad, maximize) are refused naming the group, as is any optimizer
class Strata's optimizers do not run (a subclass included: its step may
differ).

What keeps working on the object the script holds (``link``): its
param_groups' lr is read at every engine step (so a torch lr scheduler
bound to it drives the engine), its zero_grad() is the engine's, and its
step() is refused (the engine applies the optimizer in engine.step()).
"""

import types

import torch

from .._errors import InvalidArgumentError
from ._refuse import refuse


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """deepspeed.ops.adam.DeepSpeedCPUAdam's constructor: Adam with
    decoupled weight decay (``adamw_mode=True``, the default) or L2 weight
    decay. Given to initialize, the engine runs it on Strata's CPU
    optimizer; used alone it steps as torch's AdamW (or Adam), which it
    holds and whose param_groups and state are its own."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if not bias_correction:
            refuse(f"{type(self).__name__}(bias_correction=False)",
                   "Strata's Adam always corrects the bias")
        params = list(model_params)
        self.adamw_mode = bool(adamw_mode)
        kind = torch.optim.AdamW if self.adamw_mode else torch.optim.Adam
        self._torch = kind(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           amsgrad=amsgrad)
        super().__init__(params, self._torch.defaults)
        self.param_groups = self._torch.param_groups
        self.state = self._torch.state

    def step(self, closure=None):
        return self._torch.step(closure)


class FusedAdam(DeepSpeedCPUAdam):
    """deepspeed.ops.adam.FusedAdam's constructor (``adam_w_mode``); the
    same arithmetic as DeepSpeedCPUAdam."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)


# Keys of a param group that are read; flags that must be at their defaults.
_ARITHMETIC_FLAGS = {"amsgrad": False, "maximize": False}


def build(optimizer, model, model_parameters):
    """The optimizer object: `optimizer` itself, or what the callable builds
    from model_parameters (the model's parameters when None), as DeepSpeed
    calls it."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(model_parameters if model_parameters is not None
                          else model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"initialize(optimizer=callable): it returned a {type(built).__name__}, not a "
                "torch.optim.Optimizer", "InvalidArgument")
        return built
    raise InvalidArgumentError(
        f"initialize(optimizer={type(optimizer).__name__}): a torch.optim.Optimizer or a "
        "callable that builds one from the parameters", "InvalidArgument")


def _kind(opt):
    """(config type, adam_w_mode) of `opt`, refused naming it when Strata
    does not run it."""
    cls = type(opt)
    if cls in (DeepSpeedCPUAdam, FusedAdam):
        return ("AdamW", True) if opt.adamw_mode else ("Adam", False)
    if cls is torch.optim.AdamW:
        return "AdamW", True
    if cls is torch.optim.Adam:
        # torch 2.x: Adam(decoupled_weight_decay=True) is AdamW.
        if any(g.get("decoupled_weight_decay", False) for g in opt.param_groups):
            return "AdamW", True
        return "Adam", False
    refuse(f"initialize(optimizer={cls.__module__}.{cls.__name__})",
           "Strata runs torch.optim.Adam and AdamW (and DeepSpeed's DeepSpeedCPUAdam and "
           "FusedAdam) on its own optimizers; use one of them, or a config \"optimizer\" section "
           "(Adam, AdamW, Adagrad, Lion)")
    return None


def translate(opt, model):
    """(the config's "optimizer" section, model_parameters groups) for `opt`:
    no groups (None) when its one group holds every trainable parameter of
    `model` (the section then holds that group's values)."""
    kind, adam_w_mode = _kind(opt)
    name = type(opt).__name__
    groups = []
    for i, g in enumerate(opt.param_groups):
        for flag, default in _ARITHMETIC_FLAGS.items():
            if g.get(flag, default) != default:
                refuse(f"initialize(optimizer={name}): param_groups[{i}][{flag!r}] = "
                       f"{g[flag]!r}", f"Strata's optimizers run {flag}={default} only")
        if not g["params"]:
            continue  # (DeepSpeed drops empty groups too)
        groups.append({"params": list(g["params"]), "lr": float(g["lr"]),
                       "betas": tuple(float(b) for b in g["betas"]), "eps": float(g["eps"]),
                       "weight_decay": float(g["weight_decay"])})
    if not groups:
        raise InvalidArgumentError(f"initialize(optimizer={name}): its param groups hold no "
                                   "parameters", "InvalidArgument")
    first = groups[0]
    params = {"lr": first["lr"], "betas": list(first["betas"]), "eps": first["eps"],
              "weight_decay": first["weight_decay"]}
    if kind == "Adam":
        params["adam_w_mode"] = adam_w_mode
    trainable = {id(p) for p in model.parameters() if p.requires_grad and p.numel() > 0}
    if len(groups) == 1 and {id(p) for p in groups[0]["params"]} == trainable:
        groups = None
    return {"type": kind, "params": params}, groups


def _refused_step(opt, closure=None):
    refuse(f"{type(opt).__name__}.step() of the optimizer given to initialize",
           "the engine applies it: call engine.step() (every micro-batch; it steps at the end "
           "of each accumulation window)")


# Marks torch's lr schedulers look for on optimizer.step (torch 1.13:
# _with_counter; 2.x: _wrapped_by_lr_sched): the engine counts the steps
# (on_engine_step), so a scheduler bound to the object does not warn that
# step() was replaced.
_refused_step._with_counter = True
_refused_step._wrapped_by_lr_sched = True


def link(opt, engine):
    """Binds `opt` (the object the script holds) to `engine`: zero_grad() is
    the engine's, step() is refused. Returns its param groups' lrs as
    pushed (for sync_lrs)."""
    opt.zero_grad = types.MethodType(lambda self, set_to_none=True: engine.zero_grad(), opt)
    opt.step = types.MethodType(_refused_step, opt)
    if not hasattr(opt, "_step_count"):
        opt._step_count = 0
    return [g["lr"] for g in _nonempty(opt)]


def nonempty_groups(opt):
    """`opt`'s param groups that hold parameters (the engine's groups, in order)."""
    return [g for g in opt.param_groups if g["params"]]


_nonempty = nonempty_groups


def sync_lrs(opt, engine_groups, pushed):
    """Before an engine step: each of `opt`'s groups whose lr changed since
    `pushed` into the engine's matching group (engine.optimizer's). Betas
    are the config's for the whole run: a group whose betas changed (a
    OneCycle schedule cycling the momentum) is refused, never ignored."""
    for i, (g, eg) in enumerate(zip(_nonempty(opt), engine_groups)):
        if "betas" in g and "betas" in eg and tuple(float(b) for b in g["betas"]) != tuple(
                float(b) for b in eg["betas"]):
            refuse(f"{type(opt).__name__}.param_groups[{i}]['betas'] changed to "
                   f"{tuple(g['betas'])} after initialize (the engine steps with "
                   f"{tuple(eg['betas'])}), as a OneCycle schedule with cycle_momentum does",
                   "give OneCycle cycle_momentum=False, or use the config's \"scheduler\" "
                   "section (type OneCycle), whose momentum cycle the engine applies")
        if g["lr"] != pushed[i]:
            eg["lr"] = g["lr"]
            pushed[i] = g["lr"]


def on_engine_step(opt, engine_groups, pushed, scheduled):
    """After an engine step: the step counted where torch's schedulers look
    for it; with the config's schedule (`scheduled`), its lrs shown in
    `opt`'s groups."""
    opt._step_count = getattr(opt, "_step_count", 0) + 1
    opt._opt_called = True
    if scheduled:
        for i, (g, eg) in enumerate(zip(_nonempty(opt), engine_groups)):
            g["lr"] = eg["lr"]
            pushed[i] = eg["lr"]
