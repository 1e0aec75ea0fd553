"""Train a torch.nn.Module through Strata, configured with a DeepSpeed JSON.

    engine = strata.initialize(model, config="ds_config.json")  # or a dict
    for batch in data:
        loss = engine(batch)      # forward through the model
        engine.backward(loss)
        engine.step()             # the optimizer every gradient_accumulation_steps
    engine.synchronize()

How it works (as ZeRO-3 does it; docs/design.md, "The PyTorch frontend"):

* Grouping. Every module that owns trainable parameters directly becomes an
  engine module, in ``named_modules()`` order. Modules that share a parameter
  (tied embeddings) are merged into one engine module. Each parameter is
  registered with its fp32 value as the initial master; then its storage is
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

A parameter must be used inside the forward of a module that owns it (as in
DeepSpeed ZeRO-3): outside, its ``data`` is an empty placeholder. One engine
drives one model, from one thread.
"""

import contextlib
import json
import os
import weakref

import torch
import torch.utils.dlpack as _dlpack

from . import _strata
from ._errors import FailedPreconditionError, InvalidArgumentError

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
    """The optimizer's one param group. With a config `scheduler` section,
    setting its lr (or the initial_lr a torch scheduler records) is an error:
    the config's schedule sets the lr, and two sources would silently race."""

    def __init__(self, group, scheduled):
        super().__init__(group)
        self._scheduled = scheduled  # the config's schedule type, or None

    def _refuse(self, key):
        if self._scheduled is not None and key in ("lr", "initial_lr"):
            raise FailedPreconditionError(
                f"param_groups[0][{key!r}]: the config's scheduler section ({self._scheduled}) "
                "sets the learning rate at every step; use either it or a torch lr_scheduler "
                "(or your own lr), not both: remove the config's scheduler section to drive the "
                "lr from Python", "FailedPrecondition")

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
    """``engine.optimizer``: what torch's lr schedulers drive. One param group
    (every parameter the engine owns) whose ``lr`` is read at each step and
    becomes the engine's learning rate (Engine::SetLearningRate); ``betas``,
    ``eps`` and ``weight_decay`` are the config's, for reading only. step()
    is ``engine.step()``; zero_grad() is ``engine.zero_grad()``. The optimizer
    states live in the engine: state_dict() holds the param group only."""

    def __init__(self, engine, params):
        opt = engine.config["optimizer"]["params"]
        defaults = {"lr": engine._engine.learning_rate(),
                    "weight_decay": opt.get("weight_decay", 0.0)}
        if "betas" in opt:
            defaults["betas"] = tuple(opt["betas"])
        if "eps" in opt:
            defaults["eps"] = opt["eps"]
        super().__init__(params, defaults)
        self._strata = engine
        sched = engine.config.get("scheduler", {}).get("type")
        self.param_groups[0] = _LrGroup(self.param_groups[0], sched)

    def step(self, closure=None):
        if closure is not None:
            raise InvalidArgumentError(
                "engine.optimizer.step(closure): closures are not supported (run forward and "
                "engine.backward(loss) before step())", "InvalidArgument")
        return self._strata._step()

    def zero_grad(self, set_to_none=True):
        self._strata.zero_grad()


class Engine:
    """A model trained through Strata. Create it with :func:`strata.initialize`."""

    def __init__(self, model, config, auto_values=None):
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
        self._group_of_module = {}  # torch module -> _Group
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
        self._build_groups()
        self._register()
        self._engine.plan()
        self._install_hooks()
        # requires_grad of every parameter as at initialize: the engine owns the
        # trainable ones (weights and optimizer states), the set is fixed.
        self._requires_grad = [(name, p, p.requires_grad)
                               for name, p in self.module.named_parameters()
                               if p.numel() > 0 or id(p) in self._param_id]
        self._lr_pushed = self._engine.learning_rate()
        self.optimizer = _Optimizer(self, [p for g in self._groups for p in g.params])
        model._strata_engine_state = self._state

    # ---- setup ---------------------------------------------------------------

    def _build_groups(self):
        """Engine modules from the torch modules owning trainable parameters."""
        owners = []  # (module, [(qualified name, param)])
        for mname, mod in self.module.named_modules():
            direct = [(f"{mname}.{n}" if mname else n, p)
                      for n, p in mod._parameters.items()
                      if p is not None and p.requires_grad and p.numel() > 0]
            if direct:
                owners.append((mod, direct))
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
        for mod, direct in owners:
            self._group_of_module[mod] = by_root[find(id(direct[0][1]))]
        for g in self._groups:
            for p in g.params:
                self._group_of_param[id(p)] = g

    def _register(self):
        dtype_name = _DTYPE_NAMES[self.dtype]
        for g in self._groups:
            for name, p in zip(g.names, g.params):
                self._origin[id(p)] = (p.dtype, p.device)
                init = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
                pid = self._engine.register_parameter(name, list(p.shape), dtype_name, g.index,
                                                      _dlpack.to_dlpack(init))
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
        for mod, g in self._group_of_module.items():
            self._handles.append(mod.register_forward_pre_hook(self._make_pre_forward(g)))
            self._handles.append(mod.register_forward_hook(self._make_post_forward(g)))
        for mod in self.module.modules():
            owned = [(n, p) for n, p in mod._parameters.items()
                     if p is not None and id(p) in self._param_id]
            if owned:
                hook = self._make_state_dict_hook(owned)
                self._handles.append(mod._register_state_dict_hook(hook))

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

    def _make_pre_forward(self, g):
        def hook(module, inputs):
            self._enter_forward(g)
            if self._in_backward and torch.is_grad_enabled():
                g.recompute.append([p.data for p in g.params])
                with self._on_stream():
                    for p in g.params:
                        p.data = p.data.clone()
            if torch.is_grad_enabled():
                return self._wrap(inputs, lambda: self._exit_backward(g))
            return None

        return hook

    def _make_post_forward(self, g):
        def hook(module, inputs, output):
            if torch.is_grad_enabled():
                output = self._wrap(output, lambda: self._enter_backward(g))
            if self._in_backward and torch.is_grad_enabled() and g.recompute:
                for p, v in zip(g.params, g.recompute.pop()):
                    p.data = v
            self._exit_forward(g)
            return output

        return hook

    def _make_grad_hook(self, g, i):
        def hook(grad_inputs, grad_outputs):
            p = g.params[i]
            if p.grad is None or self._state["closed"]:
                return
            g.pending[i] = p.grad
            p.grad = None
            if len(g.pending) == len(g.params):
                self._hand_over(g)

        return hook

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
        except BaseException:
            if outermost:
                self._end_failed_forward()
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
        group = self.optimizer.param_groups[0]
        lr = float(group["lr"])
        if lr != self._lr_pushed:
            # Set from outside (a torch lr_scheduler, or by hand); refused by
            # the engine when the config has a scheduler section.
            self._engine.set_learning_rate(lr)
            self._lr_pushed = lr
        self.last_stats = json.loads(self._engine.step())
        self._show_scheduled_lr()
        return self.last_stats

    def _show_scheduled_lr(self):
        """With a config schedule: its lr of the next step, for get_lr() and
        param_groups (the step count moved)."""
        if self.config.get("scheduler") is not None:
            self._lr_pushed = self._engine.learning_rate()
            dict.__setitem__(self.optimizer.param_groups[0], "lr", self._lr_pushed)

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


def initialize(model, config, *, auto_values=None):
    """Hands `model`'s trainable parameters to a Strata engine configured by
    `config` (a DeepSpeed JSON file's path, or a dict) and returns the Engine.

    auto_values: values for the config's "auto" keys (train_batch_size,
    train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    gradient_clipping, lr, beta1, beta2, eps, weight_decay, fp16_enabled,
    bf16_enabled).
    """
    return Engine(model, config, auto_values)
