"""The optimizer's parameter groups and ``engine.optimizer``.

Promises: ``param_groups(model, model_parameters)`` checks and reads
initialize's model_parameters (as torch.optim and DeepSpeed take them) into
[_ParamGroup], with InvalidArgumentError naming what is wrong;
``add_param_groups`` gives their hyperparameters to the engine (engine
group ids 1.. for dict groups, 0 for the config's); ``_Optimizer`` is the
torch.optim.Optimizer that torch's lr schedulers drive: each group's lr goes
to the engine at the next step, and with a config ``scheduler`` section
setting an lr from Python is a FailedPreconditionError (``_LrGroup``).
"""

import torch

from ._errors import FailedPreconditionError, InvalidArgumentError


class _LrGroup(dict):
    """One of the optimizer's param groups. With a config `scheduler` section,
    setting its lr (or the initial_lr a torch scheduler records) is an error:
    the config's schedule sets the lr, and two sources would silently race."""

    def __init__(self, group, scheduled, index):
        super().__init__(group)
        self._scheduled = scheduled  # the config's schedule type, or None
        self._index = index

    def _refuse(self, key):
        if self._scheduled is not None and key in ("lr", "initial_lr"):
            raise FailedPreconditionError(
                f"param_groups[{self._index}][{key!r}]: the config's scheduler section "
                f"({self._scheduled}) sets the learning rate at every step; use either it or a "
                "torch lr_scheduler (or your own lr), not both: remove the config's scheduler "
                "section to drive the lr from Python", "FailedPrecondition")

    def __setitem__(self, key, value):
        self._refuse(key)
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self._refuse(key)
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        for key in dict(*args, **kwargs):
            self._refuse(key)
        super().update(*args, **kwargs)


class _Optimizer(torch.optim.Optimizer):
    """``engine.optimizer``: what torch's lr schedulers drive. Its param groups
    are the engine's (the ``model_parameters`` groups given to initialize, or
    one group of every parameter the engine owns); each group's ``lr`` is read
    at each step and becomes that group's learning rate in the engine
    (Engine::SetLearningRate); ``betas``, ``eps`` and ``weight_decay`` are the
    group's (or the config's), for reading only. step() is ``engine.step()``;
    zero_grad() is ``engine.zero_grad()``. The optimizer states live in the
    engine: state_dict() holds the param groups only."""

    def __init__(self, engine, groups):
        opt = engine.config["optimizer"]["params"]
        defaults = {"lr": engine._engine.learning_rate(0),
                    "weight_decay": opt.get("weight_decay", 0.0)}
        if "betas" in opt:
            defaults["betas"] = tuple(opt["betas"])
        if "eps" in opt:
            defaults["eps"] = opt["eps"]
        param_groups = []
        for g in groups:
            group = {k: v for k, v in g.options.items() if k != "name"}
            group["params"] = g.params
            group["lr"] = engine._engine.learning_rate(g.engine_id)
            param_groups.append(group)
        super().__init__(param_groups, defaults)
        self._strata = engine
        sched = engine.config.get("scheduler", {}).get("type")
        self.param_groups = [_LrGroup(pg, sched, i) for i, pg in enumerate(self.param_groups)]

    def step(self, closure=None):
        if closure is not None:
            raise InvalidArgumentError(
                "engine.optimizer.step(closure): closures are not supported (run forward and "
                "engine.backward(loss) before step())", "InvalidArgument")
        return self._strata._step()

    def zero_grad(self, set_to_none=True):
        self._strata.zero_grad()


class _ParamGroup:
    """One optimizer parameter group as given to initialize: its trainable
    parameters, the hyperparameters it overrides, and its engine group id."""

    def __init__(self, params, options, engine_id):
        self.params = params
        self.options = options  # lr, weight_decay, betas, eps, name (those given)
        self.engine_id = engine_id


_GROUP_KEYS = ("params", "lr", "weight_decay", "betas", "eps", "name")
# torch.optim.AdamW's flags that do not change the arithmetic Strata computes
# when left at their defaults.
_GROUP_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": None}


def param_groups(model, model_parameters):
    """[_ParamGroup] from initialize's model_parameters: None (every trainable
    parameter, the config's hyperparameters), an iterable of parameters, or
    of dicts {"params": ..., "lr": ..., "weight_decay": ..., "betas": ...,
    "eps": ...} as torch.optim and DeepSpeed take them."""
    trainable = [p for p in model.parameters() if p.requires_grad and p.numel() > 0]
    if model_parameters is None:
        return [_ParamGroup(trainable, {}, 0)]
    if isinstance(model_parameters, (torch.Tensor, dict)):
        model_parameters = [model_parameters]
    items = list(model_parameters)
    if not items:
        raise InvalidArgumentError("model_parameters: empty (give the model's parameters, or "
                                   "omit model_parameters)", "InvalidArgument")
    names = {id(p): n for n, p in model.named_parameters()}
    if all(isinstance(x, dict) for x in items):
        raw = items
        dicts = True
    elif all(isinstance(x, torch.Tensor) for x in items):
        raw = [{"params": items}]
        dicts = False
    else:
        raise InvalidArgumentError(
            "model_parameters: an iterable of parameters or of dicts {'params': [...], ...}, "
            "not a mix", "InvalidArgument")
    groups = []
    where = {}  # id(param) -> group index
    for i, d in enumerate(raw):
        what = f"model_parameters[{i}]" if dicts else "model_parameters"
        if "params" not in d:
            raise InvalidArgumentError(f"{what}: no 'params' key", "InvalidArgument")
        for key, value in d.items():
            if key in _GROUP_KEYS:
                continue
            if key in _GROUP_FLAGS and value == _GROUP_FLAGS[key]:
                continue
            raise InvalidArgumentError(
                f"{what}[{key!r}]: not supported (a group may set "
                f"{', '.join(k for k in _GROUP_KEYS if k != 'params')}; torch's "
                f"{', '.join(_GROUP_FLAGS)} only at their defaults)", "InvalidArgument")
        params = d["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        mine = []
        for p in params:
            if not isinstance(p, torch.nn.Parameter) or id(p) not in names:
                raise InvalidArgumentError(
                    f"{what}: holds a {type(p).__name__} of shape {tuple(p.shape)} that is not "
                    "a parameter of the model", "InvalidArgument")
            if id(p) in where:
                other = where[id(p)]
                raise InvalidArgumentError(
                    f"{what}: parameter {names[id(p)]} is also in model_parameters[{other}]; "
                    "a parameter belongs to one group", "InvalidArgument")
            where[id(p)] = i
            if p.requires_grad and p.numel() > 0:
                mine.append(p)  # frozen ones stay with torch, as torch.optim skips them
        options = {}
        for key in ("lr", "weight_decay", "eps"):
            if key in d:
                options[key] = float(d[key])
        if "betas" in d:
            b = tuple(float(x) for x in d["betas"])
            if len(b) != 2:
                raise InvalidArgumentError(f"{what}['betas']: two values, not {len(b)}",
                                           "InvalidArgument")
            options["betas"] = b
        if "name" in d:
            options["name"] = str(d["name"])
        groups.append(_ParamGroup(mine, options, i + 1 if dicts else 0))
    missing = [names[id(p)] for p in trainable if id(p) not in where]
    if missing:
        raise InvalidArgumentError(
            f"model_parameters: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} parameter{'s' if len(missing) != 1 else ''}) require grad but are "
            "in no group; add them to a group, or set requires_grad False to keep them frozen",
            "InvalidArgument")
    return groups



def add_param_groups(engine, groups):
    """The model_parameters groups' hyperparameters into `engine` (the
    _strata engine). Returns id(param) -> engine group id."""
    group_of = {}
    for i, g in enumerate(groups):
        if g.engine_id == 0:
            continue
        o = g.options
        betas = o.get("betas", (None, None))
        gid = engine.add_param_group(o.get("name", f"model_parameters[{i}]"),
                                     o.get("lr"), o.get("weight_decay"), betas[0],
                                     betas[1], o.get("eps"))
        if gid != g.engine_id:
            raise RuntimeError(f"engine group {gid}, expected {g.engine_id}")
    for g in groups:
        for p in g.params:
            group_of[id(p)] = g.engine_id
    return group_of
