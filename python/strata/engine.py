"""Train a torch.nn.Module through Strata, configured with a DeepSpeed JSON.

    engine = strata.initialize(model, config="ds_config.json")  # or a dict
    for batch in data:
        loss = engine(batch)      # forward through the model
        engine.backward(loss)
        engine.step()             # the optimizer every gradient_accumulation_steps
    engine.synchronize()

How it works (as ZeRO-3 does it; docs/design.md, "The PyTorch frontend"):

* Grouping. Every module that owns trainable parameters directly becomes an
  engine module, in ``named_modules()`` order (a leaf module, below, with
  its whole subtree's). Modules that share a parameter
  (tied embeddings) are merged into one engine module. Each parameter is
  registered with its fp32 value as the initial master (one built under
  strata.init with a callable that reads it from its spill store when the
  engine initializes its states: strata.init_context); then its storage is
  released (``param.data`` becomes an empty placeholder) and the engine owns
  it: fp32 master and Adam moments where ``offload_optimizer`` says, the
  working copy (bf16/fp16/fp32 from the config) where ``offload_param`` says.
* Forward. A forward pre-hook calls ``BeforeForward`` and points each
  ``param.data`` at the engine's view (a DLPack tensor over the engine's
  device memory: CUDA memory on a GPU, host memory on the host device); the
  forward hook calls ``AfterForward`` and restores the placeholder. Nested
  and repeated calls of a module (or of modules sharing parameters) hold the
  engine module once.
* Backward. The forward hook wraps the module's outputs in an autograd
  function whose backward runs before the module's own backward, and the
  pre-hook wraps its inputs in one whose backward runs after it (torch 1.13
  has no module backward hooks): in between, the parameters are fetched
  again (``BeforeForward``) and ``param.data`` points at the views. A hook on
  each parameter's gradient accumulator takes the finished gradient and
  drops ``param.grad``; once every parameter of an engine module has its
  gradient (after their last use in backward), they are handed over:
  ``BeforeBackward``, a copy into the engine's buffers, ``AfterBackward``
  (copied off the device while backward goes on). ``backward()`` ends by
  handing over zeros for parameters that got none.
* Saved tensors. Views of parameters that autograd saves in forward (e.g.
  ``weight.t()``) would point into engine memory that is reused before
  backward; a saved-tensor hook stores them as (parameter, offset, size,
  stride) and rebuilds them from the parameter's view at backward.
* Parameters used outside their module's forward. A parameter is mapped
  only while a module holding its engine module runs; elsewhere its ``data``
  is an empty placeholder. Two ways to hold it where it is used (as
  DeepSpeed ZeRO-3 does):
  - Leaf modules: a leaf's whole subtree (its own and its descendants'
    trainable parameters) is one engine module, hooked on the leaf only, so
    a forward that reads its children's parameters directly finds them
    mapped. torch's MultiheadAttention (it reads ``out_proj.weight``) and
    TransformerEncoderLayer (its inference fast path reads every
    sublayer's) are leaves by default; ``set_leaf_modules(model, [Class])``
    or a module's ``_strata_leaf = True`` makes others leaves, before
    initialize (``_strata_leaf = False`` turns a built-in one off).
  - ``register_external_parameter(module, param)``: ``module``'s hooks
    also hold the engine module of ``param`` (owned elsewhere) for its
    forward and backward, next to its own. Recorded on the module before
    initialize, or added to a running engine between micro-batches.
  A forward that raises on an unmapped parameter (torch's "mat2 must be a
  matrix, got 1-D tensor") is re-raised as FailedPreconditionError naming
  the parameter and these fixes: the frames of the traceback are searched
  for registered parameters that were not mapped, as locals or as attribute
  paths (``self.embed.weight``) on the failing statement. An op that
  accepts an empty tensor (``w.sum()``) cannot be caught this way.
* ``model.load_state_dict()`` while the engine owns the parameters: a
  pre-hook per module takes each owned key out of the state_dict and
  writes it into the engine (WriteParameter), and a post-hook takes those
  keys out of missing_keys again; shape errors are torch's messages.

One engine drives one model, from one thread.
"""

import contextlib
import json
import linecache
import os
import tempfile
import re
import weakref

import torch
import torch.utils.dlpack as _dlpack

from . import _strata
from . import init_context as _init_context
from ._errors import FailedPreconditionError, InvalidArgumentError, StrataError

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

if hasattr(torch.Tensor, "untyped_storage"):

    def _storage_ptr(t):
        return t.untyped_storage().data_ptr()

elif hasattr(torch.Tensor, "_storage"):  # torch 1.13: without building a TypedStorage

    def _storage_ptr(t):
        return t._storage().data_ptr()

else:  # torch 1.x

    def _storage_ptr(t):
        return t.storage().data_ptr()


def _config_text(config):
    """(JSON text, source name) of a config given as a path or a dict."""
    if isinstance(config, dict):
        return json.dumps(config), "<dict>"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    raise TypeError(
        f"config must be a path to a DeepSpeed JSON file or a dict, not {type(config).__name__}")


def parse_config(config, auto_values=None):
    """The effective config (every key, defaults filled in) as a dict; raises
    InvalidArgumentError naming the key path on a bad one."""
    text, source = _config_text(config)
    return json.loads(_strata.parse_config(text, source, dict(auto_values or {})))


# ---- parameters used outside their module's forward ---------------------------

# torch.nn modules whose forward reads their children's parameters directly
# (not through the children's forward): MultiheadAttention passes
# out_proj.weight/bias to F.multi_head_attention_forward (and its inference
# fast path); TransformerEncoderLayer's inference fast path passes every
# sublayer's parameters to one fused op. They are leaves by default.
_BUILTIN_LEAVES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)


def _is_leaf(mod):
    marked = mod.__dict__.get("_strata_leaf")
    if marked is not None:
        return bool(marked)
    return isinstance(mod, _BUILTIN_LEAVES)


# The Engines alive, for the calls that are given a module or a parameter
# (register_external_parameter, set_leaf_modules after initialize). An open
# engine keeps its parameters alive, so an id in its _param_id is one of them.
_ENGINES = weakref.WeakSet()


def _engine_of(params):
    """The open Engine that owns any of `params`, or None."""
    ids = {id(p) for p in params}
    for engine in list(_ENGINES):
        if not engine._state["closed"] and not ids.isdisjoint(engine._param_id):
            return engine
    return None


def register_external_parameter(module, param):
    """Declares that `module`'s forward uses `param`, a parameter owned by
    another module (a tied head's ``F.linear(x, self.embed.weight)``): the
    engine module holding `param` is fetched and held for `module`'s forward
    and backward too, as DeepSpeed's
    ``deepspeed.zero.register_external_parameter``. Call it before
    :func:`initialize` (it is recorded on the module), or after it between
    micro-batches. A frozen parameter needs none (torch keeps its data)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, not {type(module).__name__}")
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"param must be a torch.nn.Parameter, not {type(param).__name__}")
    registered = module.__dict__.setdefault("_strata_external_params", [])
    if not any(q is param for q in registered):
        registered.append(param)
    engine = _engine_of([param])
    if engine is not None:
        engine._add_external(module, param)


def set_leaf_modules(model, leaves):
    """Makes modules of `model` leaves: a leaf's whole subtree (its own and
    its descendants' trainable parameters) is one engine module, fetched for
    the leaf's forward and backward; its descendants get no hooks of their
    own. For modules whose forward uses their children's parameters directly
    (DeepSpeed's ``set_z3_leaf_modules``). `leaves`: module classes (every
    instance in `model`, subclasses included), class names, or module
    instances. Returns the modules marked. Call before :func:`initialize`
    (the grouping is fixed there). torch's MultiheadAttention and
    TransformerEncoderLayer are leaves without it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if isinstance(leaves, (type, str, torch.nn.Module)):
        leaves = [leaves]
    if _engine_of(model.parameters()) is not None:
        raise FailedPreconditionError(
            "set_leaf_modules: the model is trained by a Strata engine, whose engine modules "
            "were fixed at initialize; call it before initialize (or close() the engine, mark "
            "the leaves and initialize again)", "FailedPrecondition")
    marked = []
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            found = [m for m in model.modules() if m is leaf]
        elif isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            found = [m for m in model.modules() if isinstance(m, leaf)]
        elif isinstance(leaf, str):
            found = [m for m in model.modules() if type(m).__name__ == leaf]
        else:
            raise TypeError("set_leaf_modules: leaves must be module classes, class names or "
                            f"module instances, not {type(leaf).__name__}")
        if not found:
            what = leaf if isinstance(leaf, str) else getattr(leaf, "__name__", type(leaf).__name__)
            raise InvalidArgumentError(
                f"set_leaf_modules: no module of the model matches {what}", "InvalidArgument")
        for m in found:
            m._strata_leaf = True
            marked.append(m)
    return marked


def _all_named_parameters(module, prefix):
    """(qualified name, parameter) of `module`'s subtree, shared ones under
    every name (torch 1.13's named_parameters has no remove_duplicate)."""
    for mname, mod in module.named_modules(prefix=prefix, remove_duplicate=False):
        for n, p in mod._parameters.items():
            if p is not None:
                yield (f"{mname}.{n}" if mname else n), p


def _statement_text(tb):
    """The source of the statement a traceback entry failed in (its whole
    extent where the interpreter records it), or ""."""
    code, first = tb.tb_frame.f_code, tb.tb_lineno
    last = first
    if hasattr(code, "co_positions"):  # Python 3.11+
        for i, pos in enumerate(code.co_positions()):
            if i == tb.tb_lasti // 2:
                if pos[0] is not None and pos[1] is not None:
                    first, last = pos[0], pos[1]
                break
    return "".join(linecache.getline(code.co_filename, n) for n in range(first, last + 1))


class _Group:
    """One engine module: the parameters of one or more torch modules."""

    def __init__(self, index):
        self.index = index
        self.params = []  # torch Parameters, registration order
        self.names = []  # their first qualified names
        self.fwd_depth = 0  # forwards of its modules in progress
        self.bwd_depth = 0  # backwards of its modules in progress
        self.in_backward = False  # gradients due in this backward pass
        self.held = False  # BeforeForward without AfterForward: views mapped
        self.pending = {}  # param index -> finished gradient, until all are there
        self.recompute = []  # the views replaced by copies, per recomputation in progress


class _SavedView:
    """A tensor autograd saved that lives in a parameter's engine memory."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param, offset, size, stride):
        self.param = param
        self.offset = offset
        self.size = size
        self.stride = stride


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors; its backward calls `callback` before passing
    their gradients on. Around a module's outputs it runs before the module's
    backward; around its inputs, after."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def _collect(output, out):
    """Tensors in a module's output that need a gradient (tensor, tuple, list, dict)."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad and output.is_floating_point():
            out.append(output)
    elif isinstance(output, (tuple, list)):
        for o in output:
            _collect(o, out)
    elif isinstance(output, dict):
        for o in output.values():
            _collect(o, out)


def _replace(output, mapping):
    if isinstance(output, torch.Tensor):
        return mapping.get(id(output), output)
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # namedtuple
        return type(output)(*(_replace(o, mapping) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(_replace(o, mapping) for o in output)
    if isinstance(output, dict):
        return type(output)((k, _replace(v, mapping)) for k, v in output.items())
    return output


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


def _param_groups(model, model_parameters):
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


def _share_rendezvous_dir():
    """Data parallelism under torchrun: the engine's ranks meet through a
    directory (its Gloo store on the host device). When torch.distributed's
    default process group is up and STRATA_GLOO_DIR is unset, rank 0 makes a
    fresh one and the default group hands its name to every rank; the engine
    then does its collectives itself. Without a process group the engine
    uses /tmp/strata-gloo-<MASTER_ADDR>-<MASTER_PORT> (one machine)."""
    import torch.distributed as dist
    if os.environ.get("STRATA_GLOO_DIR") or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size() < 2:
        return
    name = [tempfile.mkdtemp(prefix="strata-gloo-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    os.environ["STRATA_GLOO_DIR"] = name[0]


class Engine:
    """A model trained through Strata. Create it with :func:`strata.initialize`."""

    def __init__(self, model, config, auto_values=None, model_parameters=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        owner = getattr(model, "_strata_engine_state", None)
        if owner is not None and not owner["closed"]:
            raise FailedPreconditionError(
                "initialize: this model is already trained by a Strata engine (its parameters "
                "live in that engine); close() that engine first (it gives the model its weights "
                "back)", "FailedPrecondition")
        text, source = _config_text(config)
        host_only = not torch.cuda.is_available()
        _share_rendezvous_dir()
        self._engine = _strata.Engine(text, source, dict(auto_values or {}), host_only)
        # A script that ends without close() still removes the swap files: the
        # engine is destroyed at interpreter exit at the latest.
        self._finalizer = weakref.finalize(self, self._engine.close)
        self.config = json.loads(self._engine.config_json())
        self.module = model
        if self.config["bf16"]["enabled"]:
            self.dtype = torch.bfloat16
        elif self.config["fp16"]["enabled"]:
            self.dtype = torch.float16
        else:
            self.dtype = torch.float32
        if self._engine.device_is_host():
            self.device = torch.device("cpu")
            self._stream = None
        else:
            self.device = torch.device("cuda", int(self.config["strata"]["device_id"]))
            self._stream = torch.cuda.ExternalStream(self._engine.compute_stream(),
                                                     device=self.device)
        self.last_stats = None
        self._groups = []
        self._groups_of_module = {}  # torch module -> [_Group]: its own, then external ones
        self._name_of_param = {}  # id(param) -> its first qualified name
        self._loaded = (None, set())  # model.load_state_dict: (its missing_keys, keys written)
        self._group_of_param = {}  # id(param) -> _Group
        self._param_id = {}  # id(param) -> engine parameter id
        self._shape_of_id = []  # engine parameter id -> shape
        self._owner = {}  # storage pointer of a live view -> param
        self._accumulators = []  # strong references: keeps the hooks alive
        self._handles = []
        self._state = {"closed": False}
        self._in_backward = False  # inside backward(): a forward now is a recomputation
        self._origin = {}  # id(param) -> (dtype, device) before the engine took it
        self._call_depth = 0  # engine calls in progress (a model may call the engine)
        self._in_engine_state_dict = False
        self._param_groups = _param_groups(model, model_parameters)
        self._add_param_groups()
        self._build_groups()
        # Parameters built under strata.init: (param, spill record), read by
        # the engine from the spill store in plan(); their files go after it.
        self._spilled = []
        try:
            self._register()
            self._engine.plan()
        except BaseException:
            # This engine is dead: its gradient hooks stand aside (a retry
            # registers new ones on the same accumulators), its files go.
            self._state["closed"] = True
            self._accumulators = []
            self._finalizer()
            for p, rec in self._spilled:  # the model keeps its spilled values
                _init_context.put_back(p, rec)
            raise
        for _, rec in self._spilled:
            rec.discard()
        self._spilled = []
        self._install_hooks()
        # requires_grad of every parameter as at initialize: the engine owns the
        # trainable ones (weights and optimizer states), the set is fixed.
        self._requires_grad = [(name, p, p.requires_grad)
                               for name, p in self.module.named_parameters()
                               if p.numel() > 0 or id(p) in self._param_id]
        self.optimizer = _Optimizer(self, self._param_groups)
        self._lr_pushed = [g["lr"] for g in self.optimizer.param_groups]
        model._strata_engine_state = self._state

    # ---- setup ---------------------------------------------------------------

    def _add_param_groups(self):
        """The model_parameters groups' hyperparameters into the engine."""
        self._engine_group_of = {}  # id(param) -> engine group id
        for i, g in enumerate(self._param_groups):
            if g.engine_id == 0:
                continue
            o = g.options
            betas = o.get("betas", (None, None))
            gid = self._engine.add_param_group(o.get("name", f"model_parameters[{i}]"),
                                               o.get("lr"), o.get("weight_decay"), betas[0],
                                               betas[1], o.get("eps"))
            if gid != g.engine_id:
                raise RuntimeError(f"engine group {gid}, expected {g.engine_id}")
        for g in self._param_groups:
            for p in g.params:
                self._engine_group_of[id(p)] = g.engine_id

    def _build_groups(self):
        """Engine modules from the torch modules owning trainable parameters;
        a leaf module (module docstring, "Leaf modules") owns its whole
        subtree's; external parameters add their groups to their user's."""
        trainable = {id(p) for p in self.module.parameters()
                     if p.requires_grad and p.numel() > 0}
        owners = []  # (module, [(qualified name, param)]), named_modules() order
        seen = set()

        def walk(mod, prefix):
            if id(mod) in seen:
                return
            seen.add(id(mod))
            if _is_leaf(mod):
                direct = [(n, p) for n, p in _all_named_parameters(mod, prefix)
                          if id(p) in trainable]
                if direct:
                    owners.append((mod, direct))
                for sub in mod.modules():  # hooks on the leaf only
                    seen.add(id(sub))
                return
            direct = [(f"{prefix}.{n}" if prefix else n, p) for n, p in mod._parameters.items()
                      if p is not None and id(p) in trainable]
            if direct:
                owners.append((mod, direct))
            for n, child in mod._modules.items():
                if child is not None:
                    walk(child, f"{prefix}.{n}" if prefix else n)

        walk(self.module, "")
        # Union-find over parameters: a module's parameters go together, and a
        # parameter shared by modules joins them.
        parent = {}

        def find(k):
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        first = {}  # id(param) -> (order, name, param)
        for mod, direct in owners:
            for name, p in direct:
                if id(p) not in first:
                    first[id(p)] = (len(first), name, p)
                    parent[id(p)] = id(p)
            root = find(id(direct[0][1]))
            for _, p in direct[1:]:
                r = find(id(p))
                if r != root:
                    parent[r] = root
        by_root = {}
        for key, (_, name, p) in sorted(first.items(), key=lambda kv: kv[1][0]):
            root = find(key)
            if root not in by_root:
                by_root[root] = _Group(len(by_root))
                self._groups.append(by_root[root])
            g = by_root[root]
            g.params.append(p)
            g.names.append(name)
            self._name_of_param[key] = name
        for mod, direct in owners:
            self._groups_of_module[mod] = [by_root[find(id(direct[0][1]))]]
        for g in self._groups:
            for p in g.params:
                self._group_of_param[id(p)] = g
        # External parameters: registered on a module, or on a module inside a
        # leaf (whose forward runs inside the leaf's).
        leaf_of = {}
        for mod in self.module.modules():
            if _is_leaf(mod):
                for sub in mod.modules():
                    leaf_of.setdefault(id(sub), mod)
        for mname, mod in self.module.named_modules():
            for p in mod.__dict__.get("_strata_external_params", ()):
                self._attach_external(leaf_of.get(id(mod), mod), p, mname)

    def _attach_external(self, mod, p, mname):
        """`mod`'s forward and backward also hold the group of `p`. A frozen
        parameter needs nothing (torch keeps its data); one not in the model is
        an error."""
        g = self._group_of_param.get(id(p))
        if g is None:
            if any(q is p for q in self.module.parameters()):
                return  # frozen: not the engine's
            raise InvalidArgumentError(
                f"register_external_parameter: the parameter of shape {tuple(p.shape)} "
                f"registered on module {mname or '<root>'} ({type(mod).__name__}) is not a "
                "parameter of the model given to initialize; register parameters the model "
                "owns", "InvalidArgument")
        groups = self._groups_of_module.setdefault(mod, [])
        if g not in groups:
            groups.append(g)

    def _register(self):
        dtype_name = _DTYPE_NAMES[self.dtype]
        for g in self._groups:
            for name, p in zip(g.names, g.params):
                self._origin[id(p)] = (p.dtype, p.device)
                group = self._engine_group_of.get(id(p), 0)
                spilled = _init_context.take(p, name)
                if spilled is not None:
                    # Built under strata.init: the engine reads the values from
                    # the spill store when it initializes the states (plan).
                    self._spilled.append((p, spilled))
                    pid = self._engine.register_parameter_fn(name, list(p.shape), dtype_name,
                                                             g.index, spilled.fill, group)
                else:
                    init = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
                    pid = self._engine.register_parameter(name, list(p.shape), dtype_name,
                                                          g.index, _dlpack.to_dlpack(init), group)
                self._param_id[id(p)] = pid
                self._shape_of_id.append(tuple(p.shape))
        # What the engine does not own follows the model to the device and dtype
        # (buffers, frozen parameters), as DeepSpeed's bf16/fp16 modes cast the model.
        for mod in self.module.modules():
            for k, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[k] = b.to(self.device,
                                           self.dtype if b.is_floating_point() else None)
            for p in mod._parameters.values():
                if p is not None and id(p) not in self._param_id:
                    _init_context.materialize_param(p)  # frozen, built under strata.init
                    p.data = p.data.to(self.device, self.dtype if p.is_floating_point() else None)
        # Each registered parameter: its gradient accumulator (made while the
        # parameter has its full shape, dtype and device: autograd checks
        # gradients against them), then an empty placeholder as its data.
        with self._on_stream(), torch.enable_grad():
            for g in self._groups:
                for i, p in enumerate(g.params):
                    p.data = torch.empty(1, dtype=self.dtype, device=self.device).expand(p.shape)
                    acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    acc.register_hook(self._make_grad_hook(g, i))
                    self._accumulators.append(acc)
                    p.data = self._placeholder()
                    p.grad = None

    def _placeholder(self):
        # One empty tensor for every released parameter (p.data = it shares
        # nothing a parameter could write: it has no elements).
        if getattr(self, "_empty", None) is None:
            self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        return self._empty

    def _install_hooks(self):
        for mod, groups in self._groups_of_module.items():
            self._hook_module(mod, groups)
        for mod in self.module.modules():
            owned = [(n, p) for n, p in mod._parameters.items()
                     if p is not None and id(p) in self._param_id]
            if owned:
                hook = self._make_state_dict_hook(owned)
                self._handles.append(mod._register_state_dict_hook(hook))
                self._handles.append(mod._register_load_state_dict_pre_hook(
                    self._make_load_state_dict_hook(owned)))
                self._handles.append(mod.register_load_state_dict_post_hook(
                    self._drop_loaded_from_missing))
        _ENGINES.add(self)

    def _hook_module(self, mod, groups):
        handle = mod.register_forward_pre_hook(self._make_pre_forward(groups))
        # First: the module's own pre-hooks (weight_norm's, which computes the
        # weight from weight_g and weight_v) run with the parameters mapped.
        mod._forward_pre_hooks.move_to_end(handle.id, last=False)
        self._handles.append(handle)
        self._handles.append(mod.register_forward_hook(self._make_post_forward(groups)))

    def _add_external(self, mod, p):
        """register_external_parameter after initialize."""
        self._check_open()
        if self._call_depth or self._in_backward or any(g.fwd_depth for g in self._groups):
            raise FailedPreconditionError(
                "register_external_parameter: called during a forward or backward; call it "
                "between micro-batches (or before initialize)", "FailedPrecondition")
        mname = next((n for n, m in self.module.named_modules() if m is mod), None)
        if mname is None:
            raise InvalidArgumentError(
                f"register_external_parameter: the module ({type(mod).__name__}) is not part of "
                "the model this engine trains", "InvalidArgument")
        leaf = next((m for m in self.module.modules()
                     if _is_leaf(m) and any(s is mod for s in m.modules())), mod)
        hooked = leaf in self._groups_of_module
        self._attach_external(leaf, p, mname)
        if not hooked and leaf in self._groups_of_module:
            self._hook_module(leaf, self._groups_of_module[leaf])

    def _make_load_state_dict_hook(self, owned):
        """model.load_state_dict() (or a submodule's) while the engine owns the
        parameters: each owned value goes into the engine (WriteParameter:
        master and working copy, moments kept), as engine.load_state_dict
        does, instead of into the empty placeholder. The key is taken out of
        the state_dict so that torch does not copy it; the post-hook takes it
        out of missing_keys again."""

        def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs):
            if self._state["closed"]:
                return
            for name, p in owned:
                key = prefix + name
                if key not in state_dict:
                    continue
                value = state_dict.pop(key)
                if self._loaded[0] is not missing_keys:  # a new load_state_dict call
                    self._loaded = (missing_keys, set())
                self._loaded[1].add(key)
                pid = self._param_id[id(p)]
                shape = self._shape_of_id[pid]
                if not torch.is_tensor(value) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {got} from "
                        f"checkpoint, the shape in current model is {shape}.")
                    continue
                v = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
                self._engine.write_parameter(pid, _dlpack.to_dlpack(v))

        return hook

    def _drop_loaded_from_missing(self, module, incompatible_keys):
        missing, loaded = self._loaded
        if missing is incompatible_keys.missing_keys and loaded:
            missing[:] = [k for k in missing if k not in loaded]

    def _make_state_dict_hook(self, owned):
        """model.state_dict() while the engine owns the parameters: each one's
        fp32 master in the parameter's original dtype and device (what close()
        gives back), instead of the empty placeholder."""

        def hook(module, state_dict, prefix, local_metadata):
            if self._in_engine_state_dict or self._state["closed"]:
                return
            self._engine.synchronize()
            for name, p in owned:
                key = prefix + name
                if key not in state_dict:
                    continue
                pid = self._param_id[id(p)]
                value = _dlpack.from_dlpack(self._engine.read_parameter(pid))
                dtype, device = self._origin[id(p)]
                state_dict[key] = value.view(self._shape_of_id[pid]).to(device=device,
                                                                        dtype=dtype)

        return hook

    def _on_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    @contextlib.contextmanager
    def _caller_ordered(self):
        """Runs the block on the engine's compute stream, ordered after the
        caller's stream's work (its inputs) and before its later work (the
        outputs it reads); on the host device, just runs it."""
        if self._stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            caller.wait_stream(self._stream)

    def _saved_tensor_hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ---- views ---------------------------------------------------------------

    def _map(self, g, capsules):
        for p, cap in zip(g.params, capsules):
            v = _dlpack.from_dlpack(cap)
            p.data = v
            if v.numel():
                self._owner[_storage_ptr(v)] = p

    def _unmap(self, g):
        for p in g.params:
            if p.data.numel():
                self._owner.pop(_storage_ptr(p.data), None)
            p.data = self._placeholder()

    def _pack(self, t):
        if not self._owner or t.numel() == 0:
            return t
        try:
            p = self._owner.get(_storage_ptr(t))
        except (RuntimeError, NotImplementedError):  # no storage (sparse, ...)
            return t
        if p is None:
            return t
        return _SavedView(p, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, x):
        if not isinstance(x, _SavedView):
            return x
        if x.param.data.numel() == 0:
            # Used in backward after its module's backward ended (an op on the
            # parameter alone): fetched again, held to the end of backward.
            self._enter_backward(self._group_of_param[id(x.param)])
        return x.param.data.as_strided(x.size, x.stride, x.offset)

    # ---- the group state machine ----------------------------------------------
    # A group's parameter views are held with BeforeForward..AfterForward
    # while a forward of one of its modules runs (fwd_depth) or a backward of
    # one does (bwd_depth: from the backward of the module's outputs to that
    # of its inputs; to the end of backward when its inputs need no
    # gradient). A module called twice is fetched again for its second
    # backward rather than held in between.
    #
    # Gradients are handed over when all of the group's are finished (after
    # their last use in backward): AfterForward if held, BeforeBackward, a
    # copy into the engine's buffers, AfterBackward. So no gradient buffer is
    # held while other modules' backward runs (a group used until the end of
    # backward: the top module's own parameters, tied weights); at most one
    # is being written.

    def _hold(self, g):
        if not g.held:
            self._map(g, self._engine.before_forward(g.index))
            g.held = True

    def _release(self, g):
        if g.held:
            self._engine.after_forward(g.index)
            g.held = False
            self._unmap(g)

    def _maybe_release(self, g):
        if g.fwd_depth == 0 and g.bwd_depth == 0:
            self._release(g)

    def _enter_forward(self, g):
        g.fwd_depth += 1
        self._hold(g)

    def _exit_forward(self, g):
        g.fwd_depth -= 1
        self._maybe_release(g)

    def _enter_backward(self, g):
        g.bwd_depth += 1
        g.in_backward = True
        self._hold(g)

    def _exit_backward(self, g):
        g.bwd_depth = max(0, g.bwd_depth - 1)
        self._maybe_release(g)

    def _hand_over(self, g):
        """Gives the group's finished gradients (zeros where none came) to the engine."""
        self._release(g)
        grads = self._engine.before_backward_grads(g.index)
        with self._on_stream():
            for i, cap in enumerate(grads):
                view = _dlpack.from_dlpack(cap)
                grad = g.pending.get(i)
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
        self._engine.after_backward(g.index)
        g.pending = {}
        g.in_backward = False
        if g.fwd_depth > 0:  # a forward of the group in progress
            self._hold(g)
        # Inside the group's backward (bwd_depth > 0) nothing needs the views
        # again: every node that used a parameter with a gradient ran before
        # its gradient was finished, and a saved view unpacked later (an op on
        # a detached parameter) fetches the group anew (_unpack).

    @staticmethod
    def _wrap(structure, callback):
        """structure with its tensors that need a gradient passed through
        _OnBackward(callback)."""
        tensors = []
        _collect(structure, tensors)
        if not tensors:
            return structure
        wrapped = _OnBackward.apply(callback, *tensors)
        return _replace(structure, {id(t): w for t, w in zip(tensors, wrapped)})

    # A forward during backward() is activation checkpointing recomputing it.
    # Non-reentrant checkpointing stores what the recomputation saves with
    # its own saved-tensor hooks (they replace the frontend's), so a saved
    # view of a parameter would point into engine memory that is reused once
    # the module is released. The recomputation therefore runs on copies of
    # the parameters (one module at a time; autograd keeps the saved ones
    # until their use in backward), and the views come back afterwards.

    def _make_pre_forward(self, groups):
        """`groups`: the module's own group, then those of its external
        parameters (the list grows when one is registered after initialize)."""

        def hook(module, inputs):
            gs = tuple(groups)
            for g in gs:
                self._enter_forward(g)
            if self._in_backward and torch.is_grad_enabled():
                with self._on_stream():
                    for g in gs:
                        g.recompute.append([p.data for p in g.params])
                        for p in g.params:
                            p.data = p.data.clone()
            if torch.is_grad_enabled():
                return self._wrap(inputs, lambda: self._each(self._exit_backward, gs))
            return None

        return hook

    def _make_post_forward(self, groups):
        def hook(module, inputs, output):
            gs = tuple(groups)
            if torch.is_grad_enabled():
                output = self._wrap(output, lambda: self._each(self._enter_backward, gs))
            if self._in_backward and torch.is_grad_enabled():
                for g in gs:
                    if g.recompute:
                        for p, v in zip(g.params, g.recompute.pop()):
                            p.data = v
            for g in gs:
                self._exit_forward(g)
            return output

        return hook

    @staticmethod
    def _each(fn, groups):
        for g in groups:
            fn(g)

    def _make_grad_hook(self, g, i):
        def hook(grad_inputs, grad_outputs):
            p = g.params[i]
            if p.grad is None or self._state["closed"]:
                return
            # The accumulator runs once per backward graph: twice for a
            # parameter used both inside and outside a reentrant checkpoint.
            g.pending[i] = p.grad if i not in g.pending else g.pending[i] + p.grad
            p.grad = None
            if len(g.pending) == len(g.params):
                self._hand_over(g)

        return hook

    # ---- a parameter used where it is not mapped ------------------------------

    def _unmapped(self, p):
        return id(p) in self._param_id and p.data.numel() == 0

    def _unmapped_used(self, tb):
        """[(name, frame description)] of the registered parameters that are
        not mapped now and that the frames of traceback `tb` refer to: as
        locals (F.multi_head_attention_forward's out_proj_weight), or as an
        attribute path from a module local on the failing statement
        (``self.embed.weight``). For the error of a forward that raised."""
        found = {}
        while tb is not None:
            frame = tb.tb_frame
            code = frame.f_code
            owner = frame.f_locals.get("self")
            func = (f"{type(owner).__name__}.{code.co_name}"
                    if isinstance(owner, torch.nn.Module) else code.co_name)
            where = f"{func} ({os.path.basename(code.co_filename)}:{tb.tb_lineno})"
            text = _statement_text(tb)
            for var, value in list(frame.f_locals.items()):
                if isinstance(value, torch.nn.Parameter):
                    if self._unmapped(value):
                        found.setdefault(id(value), (self._name_of_param[id(value)], where))
                elif isinstance(value, torch.nn.Module) and text and var in text:
                    for q, p in _all_named_parameters(value, ""):
                        if self._unmapped(p) and re.search(
                                rf"\b{re.escape(var)}\.{re.escape(q)}\b", text):
                            found.setdefault(id(p), (self._name_of_param[id(p)], where))
            tb = tb.tb_next
        return list(found.values())

    def _unmapped_error(self, error):
        """The error to raise for `error` from a forward: a
        FailedPreconditionError naming the parameters used where they are not
        mapped and the fix, when any is found; else None."""
        if isinstance(error, StrataError) or not isinstance(error, RuntimeError):
            return None
        try:
            used = self._unmapped_used(error.__traceback__)
        except Exception:  # the diagnosis must never hide the error itself
            return None
        if not used:
            return None
        names = ", ".join(name for name, _ in used)
        it = "it" if len(used) == 1 else "them"
        return FailedPreconditionError(
            f"{names}: used in {used[-1][1]} outside the forward of the module that owns {it}, "
            f"where the engine has not fetched {it} (an empty placeholder there). Declare "
            "the use before strata.initialize: strata.register_external_parameter(module, "
            "param) for the module whose forward uses it, or strata.set_leaf_modules(model, "
            f"[ModuleClass]) to fetch a module's whole subtree for its forward "
            f"(torch's error: {type(error).__name__}: {error})", "FailedPrecondition")

    # ---- training ------------------------------------------------------------

    def _check_open(self):
        if self._state["closed"]:
            raise FailedPreconditionError(
                "the engine was closed (engine closed); the model has its weights back and runs "
                "without it", "FailedPrecondition")

    def _check_requires_grad(self):
        for name, p, at_initialize in self._requires_grad:
            if p.requires_grad != at_initialize:
                raise FailedPreconditionError(
                    f"{name}: requires_grad is {p.requires_grad}, at initialize it was "
                    f"{at_initialize}; the engine's set of trainable parameters is fixed at "
                    "initialize (it owns their weights and optimizer states): set it back, or "
                    "close() the engine and initialize a new one for the new set",
                    "FailedPrecondition")

    def _end_failed_forward(self):
        """After a forward that raised: the modules it entered and did not
        leave (their forward hooks never ran) are left now, so their
        parameters are not held into the next micro-batch. Runs when an
        engine call raises, and at the start of each engine call and of
        backward() (for an exception the model caught itself)."""
        for g in self._groups:
            if g.fwd_depth > 0:
                g.fwd_depth = 0
                g.recompute = []
                self._maybe_release(g)

    def __call__(self, *args, **kwargs):
        """Runs the model's forward (its parameters fetched module by module)."""
        self._check_open()
        self._check_requires_grad()
        outermost = self._call_depth == 0 and not self._in_backward
        if outermost:
            self._end_failed_forward()
        self._call_depth += 1
        try:
            with self._caller_ordered(), self._saved_tensor_hooks():
                return self.module(*args, **kwargs)
        except BaseException as e:
            if outermost:
                better = self._unmapped_error(e)  # before the release unmaps the others
                self._end_failed_forward()
                if better is not None:
                    raise better from e
            raise
        finally:
            self._call_depth -= 1

    forward = __call__

    def backward(self, loss):
        """loss.backward() of loss × the engine's loss scale (fp16) ÷
        gradient_accumulation_steps (as DeepSpeed's engine.backward does, so a
        window's gradient is the mean of its micro-batches'); gradients go to
        the engine as each module's backward finishes."""
        self._check_open()
        factor = self._engine.loss_scale() / self.gradient_accumulation_steps
        self._end_failed_forward()
        self._in_backward = True
        try:
            with self._caller_ordered(), self._saved_tensor_hooks():
                (loss * factor if factor != 1.0 else loss).backward()
        finally:
            self._in_backward = False
        for g in self._groups:
            g.bwd_depth = 0  # modules whose inputs need no gradient end here
            if g.in_backward or g.pending:  # parameters that got no gradient: zeros
                self._hand_over(g)
            self._maybe_release(g)

    def step(self):
        """Ends a micro-batch; applies the optimizer at the end of each window of
        gradient_accumulation_steps. Returns the step's statistics (dict), whose
        ``lr`` is the step's learning rate. Raises FailedPreconditionError when
        no backward() handed gradients over since the last optimizer step.

        Goes through ``engine.optimizer.step()``, so torch lr schedulers see the
        optimizer step."""
        return self.optimizer.step()

    def _step(self):
        self._check_open()
        self._check_requires_grad()
        for i, (group, pg) in enumerate(zip(self.optimizer.param_groups, self._param_groups)):
            lr = float(group["lr"])
            if lr != self._lr_pushed[i]:
                # Set from outside (a torch lr_scheduler, or by hand); refused by
                # the engine when the config has a scheduler section.
                self._engine.set_learning_rate(lr, pg.engine_id)
                self._lr_pushed[i] = lr
        self.last_stats = json.loads(self._engine.step())
        self._show_scheduled_lr()
        return self.last_stats

    def _show_scheduled_lr(self):
        """With a config schedule: its lr of the next step, for get_lr() and
        param_groups (the step count moved)."""
        if self.config.get("scheduler") is not None:
            for i, pg in enumerate(self._param_groups):
                self._lr_pushed[i] = self._engine.learning_rate(pg.engine_id)
                dict.__setitem__(self.optimizer.param_groups[i], "lr", self._lr_pushed[i])

    def get_lr(self):
        """The learning rate of the next optimizer step, one per param group (as
        DeepSpeed's engine.get_lr())."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def zero_grad(self):
        """Discards the accumulated gradients of the current window."""
        self._engine.zero_grad()

    def synchronize(self):
        """Waits for the optimizer step in flight; raises its error, if any."""
        self._engine.synchronize()

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def loss_scale(self):
        return self._engine.loss_scale()

    @property
    def device_name(self):
        return self._engine.device_name()

    @property
    def gradient_accumulation_steps(self):
        return int(self.config["gradient_accumulation_steps"])

    def budgets(self):
        """Needed vs available bytes per tier (hbm, pinned, nvme)."""
        return self._engine.budgets()

    def stats_json(self):
        return self._engine.stats_json()

    def write_timeline(self):
        self._engine.write_timeline()

    # ---- weights and checkpoints -----------------------------------------------

    def _registered_names(self):
        """Every qualified name of every registered parameter -> parameter id."""
        names = {}
        for mname, mod in self.module.named_modules(remove_duplicate=False):
            for n, p in mod._parameters.items():
                if p is not None and id(p) in self._param_id:
                    names[f"{mname}.{n}" if mname else n] = self._param_id[id(p)]
        return names

    def state_dict(self):
        """The model's state_dict with full-precision (fp32, CPU) values of the
        parameters the engine owns (the masters), and the model's other entries."""
        self._engine.synchronize()
        names = self._registered_names()
        values = {}
        self._in_engine_state_dict = True
        try:
            out = self.module.state_dict()
        finally:
            self._in_engine_state_dict = False
        for key in out:
            if key in names:
                pid = names[key]
                if pid not in values:
                    shape = self._shape_of_id[pid]
                    values[pid] = _dlpack.from_dlpack(self._engine.read_parameter(pid)).view(shape)
                out[key] = values[pid]
        return out

    def load_state_dict(self, state_dict, strict=True):
        """Loads parameters (into the engine's masters and working copies; the
        optimizer's moments are kept) and the model's other entries."""
        names = self._registered_names()
        written = set()
        rest = {}
        for key, value in state_dict.items():
            if key not in names:
                rest[key] = value
                continue
            pid = names[key]
            shape = self._shape_of_id[pid]
            if tuple(value.shape) != shape:
                raise InvalidArgumentError(
                    f"load_state_dict: {key} has shape {tuple(value.shape)}, the parameter "
                    f"{shape}", "InvalidArgument")
            if pid in written:
                continue
            v = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
            self._engine.write_parameter(pid, _dlpack.to_dlpack(v))
            written.add(pid)
        missing = [k for k, pid in names.items() if pid not in written]
        result = self.module.load_state_dict(rest, strict=False)
        if strict:
            missing += [k for k in result.missing_keys if k not in names]
            if missing or result.unexpected_keys:
                raise InvalidArgumentError(
                    f"load_state_dict: missing keys {missing}, unexpected keys "
                    f"{list(result.unexpected_keys)}", "InvalidArgument")

    def save_checkpoint(self, directory, data_position=0, note=""):
        """Writes a checkpoint (parameters, fp32 masters and moments, step count,
        loss scaler) under `directory`; call after the step() ending a window."""
        self._engine.save_checkpoint(os.fspath(directory), data_position, note)

    def load_checkpoint(self, directory):
        """Restores the newest checkpoint under `directory`; returns a dict with
        data_position, note, optimizer_step and path."""
        info = self._engine.load_checkpoint(os.fspath(directory))
        self._show_scheduled_lr()
        return info

    def save_16bit_model(self, path):
        """Writes the model's state_dict with the engine's parameters in the
        training dtype (the masters rounded to nearest even, which is what the
        working copies hold after a step) to `path`: safetensors when it ends
        in ".safetensors" (parameters and floating-point buffers only, shapes
        kept), else torch.save of the whole state_dict. Tied parameters appear
        under every name in torch.save's file and under the first one in
        safetensors."""
        sd = self.state_dict()
        names = self._registered_names()
        out = {}
        seen = set()
        for key, value in sd.items():
            if key in names:
                if os.fspath(path).endswith(".safetensors"):
                    if names[key] in seen:
                        continue
                    seen.add(names[key])
                value = value.to(self.dtype)
            out[key] = value
        if os.fspath(path).endswith(".safetensors"):
            write_safetensors({k: v for k, v in out.items() if torch.is_tensor(v)}, path)
        else:
            torch.save(out, os.fspath(path))

    def close(self):
        """Gives the model its weights back (each parameter's fp32 master, in
        the parameter's original dtype and device), removes the hooks and
        destroys the engine (its swap files go). The model then trains or
        evaluates without Strata, or can be handed to a new engine; calls on
        this engine raise FailedPreconditionError. Idempotent."""
        if self._state["closed"]:
            return
        self._engine.synchronize()
        for g in self._groups:
            self._release(g)
        with torch.no_grad():
            for g in self._groups:
                for p in g.params:
                    pid = self._param_id[id(p)]
                    value = _dlpack.from_dlpack(self._engine.read_parameter(pid))
                    dtype, device = self._origin[id(p)]
                    p.data = value.view(self._shape_of_id[pid]).to(device=device, dtype=dtype)
                    p.grad = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self._accumulators = []
        self._owner = {}
        self._state["closed"] = True
        self._finalizer()  # destroys the engine


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL"}


def write_safetensors(tensors, path, metadata=None):
    """Writes {name: tensor} (CPU copies, contiguous) in the safetensors format:
    8-byte little-endian header length, a JSON header padded with spaces to a
    multiple of 8, the tensors' bytes in order."""
    header = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise InvalidArgumentError(f"write_safetensors: {name} has dtype {t.dtype}",
                                       "InvalidArgument")
        data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.fspath(path))


def export(checkpoint_dir, path, dtype="fp32"):
    """Writes the parameters of the checkpoint under `checkpoint_dir` (a root:
    its newest checkpoint that verifies; or one ckpt-<N> directory) to `path`
    as safetensors keyed by the registered names, each of shape [numel]:
    dtype "fp32" the fp32 masters, "train" the training-dtype copies. Every
    file's size and CRC-32C are verified first. Needs no engine (the same C++
    as `strata checkpoint export`). Returns a dict: checkpoint, optimizer_step,
    tensors, bytes."""
    return _strata.export_checkpoint(os.fspath(checkpoint_dir), os.fspath(path), dtype)


def initialize(model, config, *, model_parameters=None, auto_values=None):
    """Hands `model`'s trainable parameters to a Strata engine configured by
    `config` (a DeepSpeed JSON file's path, or a dict) and returns the Engine.

    model_parameters: as deepspeed.initialize's, the optimizer's parameter
    groups: an iterable of parameters, or of dicts {"params": [...], "lr":
    ..., "weight_decay": ..., "betas": (b1, b2), "eps": ..., "name": ...} like
    torch.optim's param groups; keys left out take the config's
    optimizer.params. Every parameter that requires grad must be in exactly
    one group (frozen ones listed are skipped, as torch.optim skips them).
    A group's lr is refused with a config `scheduler` that sets every
    group's lr (all but WarmupCosineLR, which scales each group's own). The
    groups are part of a checkpoint's identity. None: one group, every
    trainable parameter, the config's hyperparameters.

    auto_values: values for the config's "auto" keys (train_batch_size,
    train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    gradient_clipping, lr, beta1, beta2, eps, weight_decay, fp16_enabled,
    bf16_enabled).
    """
    return Engine(model, config, auto_values, model_parameters)
