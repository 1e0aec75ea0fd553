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
* Clearing gradients. The window of gradients is the engine's, so what
  clears ``.grad`` in torch clears it: ``zero_grad()`` of the model (or of
  a module holding all of the engine's parameters), of
  ``engine.optimizer``, of the engine. A module holding only some may not
  while the window holds gradients (it is discarded as a whole). Gradients
  another engine's ``backward()`` sends through this engine's parameters
  (a GAN's generator loss through the discriminator) make ``step()``
  refuse the window until it is cleared: ``p.grad = None``, which clears
  them in torch, does not reach the engine.
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

One engine drives one model, from one thread at a time (on CUDA, autograd
runs the backward hooks on its device thread while the caller waits in
backward()).
"""

import atexit
import contextlib
import datetime
import json
import os
import types
import weakref

import torch
import torch.utils.checkpoint
import torch.utils.dlpack as _dlpack

from . import _hooks
from . import _strata
from . import init_context as _init_context
from ._config import config_text, parse_config, training_dtype
from ._diagnose import unmapped_error
from ._errors import FailedPreconditionError, InvalidArgumentError
from ._group import ParamStatus, Views, _Group
from ._grouping import (ENGINES, Grouping, _engine_of, register_external_parameter,
                        set_leaf_modules)
from ._optimizer import _Optimizer, add_param_groups, param_groups
from ._private_fs import check_replaceable, write_file_replacing
from ._safetensors import write_safetensors
from ._state_dict import StateDicts, registered_names

# What `from strata.engine import ...` has always offered (strata/__init__.py
# exports them); parse_config, the leaf and external-parameter calls and the
# safetensors writer live in the modules imported above.
__all__ = ["Engine", "export", "initialize", "parse_config", "register_external_parameter",
           "set_leaf_modules", "write_safetensors"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class _TorchStore:
    """torch.distributed's key-value store as the engine's rendezvous store
    (strata/rendezvous.h): set(key, bytes), get(key, timeout_s) -> bytes,
    remove(key)."""

    def __init__(self, store):
        self._store = store

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key, timeout_s):
        self._store.wait([key], datetime.timedelta(seconds=timeout_s))
        return self._store.get(key)

    def remove(self, key):
        try:
            self._store.delete_key(key)
        except (RuntimeError, NotImplementedError):
            pass  # a store without deletion (FileStore) keeps the entry


_OWN_STORES = {}  # (MASTER_ADDR, MASTER_PORT) -> the TCPStore this process opened


def _connect_timeout_s():
    for name in ("STRATA_COMM_CONNECT_TIMEOUT_S", "STRATA_COMM_TIMEOUT_S"):
        value = os.environ.get(name)
        if value:
            try:
                return float(value)
            except ValueError:
                raise InvalidArgumentError(
                    f"environment {name}={value!r} is not a number of seconds",
                    "InvalidArgument") from None
    return 300.0


def _rendezvous_store():
    """The store the engine's ranks meet through, or None (one rank, or
    STRATA_GLOO_DIR names a directory they share). The default process
    group's store when torch.distributed is up (deepspeed.init_distributed,
    a script's init_process_group); else, with several ranks, a TCPStore at
    MASTER_ADDR:MASTER_PORT as torch's env:// rendezvous opens it (rank 0
    serves it, or torchrun's agent does when it says so), kept for the
    process's life so that later engines meet there too. Nothing but the
    network is shared between the machines then."""
    if os.environ.get("STRATA_GLOO_DIR"):
        return None
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() < 2:
            return None
        from torch.distributed import distributed_c10d
        return _TorchStore(distributed_c10d._get_default_store())
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None  # the engine names the bad variable
    if world < 2 or not dist.is_available():
        return None
    addr = os.environ.get("MASTER_ADDR", "")
    port = os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        raise InvalidArgumentError(
            f"initialize: WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set: the ranks "
            "meet at MASTER_ADDR:MASTER_PORT (set by strata.launch and torchrun), or through a "
            "directory they all see (STRATA_GLOO_DIR)", "InvalidArgument")
    key = (addr, port)
    if key not in _OWN_STORES:
        from ._torch_compat import rendezvous_env, tcp_store
        os.environ.update(rendezvous_env())  # USE_LIBUV=0 for a torch without libuv
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        rank = int(os.environ.get("RANK", "0"))
        _OWN_STORES[key] = tcp_store(
            addr, int(port), world, is_master=(rank == 0 and not agent),
            timeout=datetime.timedelta(seconds=_connect_timeout_s()), wait_for_workers=False)
    return _TorchStore(_OWN_STORES[key])


def engine_of_parameter(p):
    """(engine, engine parameter id) of the open Engine that trains `p`, or
    None (deepspeed.zero.GatheredParameters finds parameters this way)."""
    engine = _engine_of([p])
    return None if engine is None else (engine, engine._param_id[id(p)])


def _whole_recomputation():
    """torch 2.1 and later end a non-reentrant checkpoint's recomputation as
    soon as it has rebuilt the tensors backward needs, by raising inside
    the recomputed forward. The modules it cuts short never run their
    forward hooks, so their parameters would stay fetched and their views
    stale. This turns that early stop off for the checkpoints made inside
    the forward (torch reads the setting when checkpoint() runs), so each
    recomputation runs to its end as on torch 1.13, which has no early stop."""
    early_stop = getattr(torch.utils.checkpoint, "set_checkpoint_early_stop", None)
    return early_stop(False) if early_stop is not None else contextlib.nullcontext()


class Engine:
    """A model trained through Strata. Create it with :func:`strata.initialize`."""

    # It owns the _strata engine (self._engine: looked up at each use, tests
    # and bench/frontend_overhead.py wrap it) and the parameter registry (id
    # -> engine parameter id, shape, original dtype and device). The grouping
    # (strata._grouping), the groups and their transitions (strata._group),
    # the hooks (strata._hooks), the state-dict hooks (strata._state_dict) and
    # the optimizer (strata._optimizer) are objects of their own it drives.

    def __init__(self, model, config, auto_values=None, model_parameters=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            # torch.compile's wrapper: the compiled graph would not run the
            # module hooks that fetch parameters and hand gradients over.
            raise InvalidArgumentError(
                "initialize: the model is wrapped by torch.compile (OptimizedModule); Strata "
                "moves parameters in module hooks, which a compiled graph does not run. Pass the "
                "module itself (model._orig_mod) to strata.initialize", "InvalidArgument")
        owner = getattr(model, "_strata_engine_state", None)
        if owner is not None and not owner["closed"]:
            raise FailedPreconditionError(
                "initialize: this model is already trained by a Strata engine (its parameters "
                "live in that engine); close() that engine first (it gives the model its weights "
                "back)", "FailedPrecondition")
        text, source = config_text(config)
        host_only = not torch.cuda.is_available()
        self._engine = _strata.Engine(text, source, dict(auto_values or {}), host_only,
                                      _rendezvous_store())
        # A script that ends without close() still removes the swap files: the
        # engine is destroyed at interpreter exit at the latest, by an exit
        # handler of its own registered now, so it runs before the handlers a
        # script registered earlier (last registered, first run).
        # weakref.finalize's own exit hook is registered once, at the first
        # finalize object of the process: torch 2.x creates one on import,
        # which would run it after every handler of the script.
        self._finalizer = weakref.finalize(self, self._engine.close)
        atexit.register(self._finalizer)
        self.config = json.loads(self._engine.config_json())
        self.module = model
        self.dtype = training_dtype(self.config)
        if self._engine.device_is_host():
            self.device = torch.device("cpu")
            self._stream = None
        else:
            self.device = torch.device("cuda", int(self.config["strata"]["device_id"]))
            self._stream = torch.cuda.ExternalStream(self._engine.compute_stream(),
                                                     device=self.device)
        self.last_stats = None
        self._views = Views(self.dtype, self.device)  # param.data: a view or the placeholder
        self._param_id = {}  # id(param) -> engine parameter id
        self._shape_of_id = []  # engine parameter id -> shape
        self._origin = {}  # id(param) -> (dtype, device) before the engine took it
        self._accumulators = []  # strong references: keeps the gradient hooks alive
        self._handles = []
        self._state = {"closed": False}
        self._in_backward = False  # inside backward(): a forward now is a recomputation
        self._call_depth = 0  # engine calls in progress (a model may call the engine)
        # Gradients in the window since the last zero_grad() or window end,
        # and the engine whose backward() sent some here, if another's
        # (_note_gradient; cleared as the window is).
        self._window_has_grads = False
        self._foreign_backward = None
        self._zero_grad_routes = {}  # id(module) -> (module, name, holds them all)
        self._state_dicts = StateDicts(self)
        self._param_groups = param_groups(model, model_parameters)
        engine_group_of = add_param_groups(self._engine, self._param_groups)
        self._grouping = Grouping(model, lambda index: _Group(index, self))
        self._groups = self._grouping.groups
        self._groups_of_module = self._grouping.of_module  # torch module -> [_Group]
        self._group_of_param = self._grouping.of_param  # id(param) -> _Group
        saved = _hooks.SavedTensors(self._views, self._group_of_param)
        self._pack, self._unpack = saved.pack, saved.unpack  # the saved-tensor hooks
        # Parameters built under strata.init: (param, spill record), read by
        # the engine from the spill store in plan(); their files go after it.
        self._spilled = []
        try:
            self._register(engine_group_of)
            self._engine.plan()
        except BaseException:
            # This engine is dead: its gradient hooks stand aside (a retry
            # registers new ones on the same accumulators), its files go.
            self._state["closed"] = True
            self._accumulators = []
            self._finalizer()
            atexit.unregister(self._finalizer)
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

    def _register(self, engine_group_of):
        """Each parameter of the groups into the engine (`engine_group_of`:
        id(param) -> engine group id); what the engine does not own to its
        device and dtype; the gradient hooks."""
        dtype_name = _DTYPE_NAMES[self.dtype]
        # Every name of each parameter (a tied one has several): the engine
        # records them in checkpoints, so exported weights load strictly.
        # (named_modules: torch 1.13's named_parameters cannot keep duplicates.)
        names_of = {}
        for mname, mod in self.module.named_modules(remove_duplicate=False):
            for n, p in mod._parameters.items():
                if p is not None:
                    names_of.setdefault(id(p), []).append(f"{mname}.{n}" if mname else n)
        for g in self._groups:
            for name, p in zip(g.names, g.params):
                aliases = [n for n in names_of.get(id(p), []) if n != name]
                self._origin[id(p)] = (p.dtype, p.device)
                group = engine_group_of.get(id(p), 0)
                spilled = _init_context.take(p, name)
                if spilled is not None:
                    # Built under strata.init: the engine reads the values from
                    # the spill store when it initializes the states (plan).
                    self._spilled.append((p, spilled))
                    pid = self._engine.register_parameter_fn(name, list(p.shape), dtype_name,
                                                             g.index, spilled.fill, group,
                                                             aliases)
                else:
                    init = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
                    pid = self._engine.register_parameter(name, list(p.shape), dtype_name,
                                                          g.index, _dlpack.to_dlpack(init), group,
                                                          aliases)
                self._param_id[id(p)] = pid
                self._shape_of_id.append(tuple(p.shape))
                # DeepSpeed's attributes of a ZeRO-3 parameter (its data is
                # the engine's view or an empty placeholder at every stage):
                # code that tests for them gathers it (GatheredParameters).
                p.ds_id, p.ds_shape, p.ds_numel = pid, p.shape, p.numel()
                p.ds_status = ParamStatus.NOT_AVAILABLE
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
        # Each registered parameter: its gradient accumulator hooked, then an
        # empty placeholder as its data.
        self._accumulators = _hooks.hook_gradients(self, self._groups, self._views)

    def _install_hooks(self):
        for mod, groups in self._groups_of_module.items():
            self._handles += _hooks.hook_module(self, mod, groups)
        self._handles += self._state_dicts.install(self.module)
        self._route_module_zero_grad()
        ENGINES.add(self)

    def _route_module_zero_grad(self):
        """``zero_grad()`` of the model, and of each of its modules that holds
        parameters the engine owns, clears what torch's would: the model's
        (or a module holding them all) discards the window's gradients
        (engine.zero_grad()); one holding some of them may not, while the
        window holds gradients, since the window is discarded as a whole
        (FailedPreconditionError). The module's own zero_grad runs after
        (for what the engine does not own). Bound as an instance attribute,
        removed by close(); a copy of the model (copy.deepcopy) has torch's."""
        owned = self._param_id
        for name, mod in self.module.named_modules():
            held = sum(1 for p in mod.parameters() if id(p) in owned)
            if held == 0:
                continue
            # Bound to the module, so that a copy of it (copy.deepcopy) is
            # bound to the copy, which no engine routes.
            mod.__dict__["zero_grad"] = types.MethodType(_routed_zero_grad, mod)
            self._zero_grad_routes[id(mod)] = (mod, name or type(mod).__name__,
                                               held == len(owned))

    def _note_gradient(self):
        """A parameter's gradient arrived (its accumulator's hook). Notes the
        window as holding gradients, and, when the backward running is
        another engine's (its backward went through this engine's
        parameters, as a GAN's generator loss goes through the
        discriminator), which engine's: step() refuses such a window until
        it is cleared (torch would add those gradients unless the script
        cleared them, and not every way a script clears them reaches the
        engine: ``p.grad = None`` does not)."""
        self._window_has_grads = True
        if self._in_backward or self._foreign_backward is not None:
            return
        for other in list(ENGINES):
            if other is not self and other._in_backward and not other._state["closed"]:
                self._foreign_backward = _model_name(other)
                return

    def _add_external(self, mod, p):
        """register_external_parameter after initialize."""
        self._check_open()
        if self._call_depth or self._in_backward or any(g.fwd_depth for g in self._groups):
            raise FailedPreconditionError(
                "register_external_parameter: called during a forward or backward; call it "
                "between micro-batches (or before initialize)", "FailedPrecondition")
        newly_hooked = self._grouping.add_external(mod, p)
        if newly_hooked is not None:
            self._handles += _hooks.hook_module(self, newly_hooked,
                                                self._groups_of_module[newly_hooked])

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
            g.abandon_forward()

    def __call__(self, *args, **kwargs):
        """Runs the model's forward (its parameters fetched module by module)."""
        self._check_open()
        self._check_requires_grad()
        outermost = self._call_depth == 0 and not self._in_backward
        if outermost:
            self._end_failed_forward()
        self._call_depth += 1
        try:
            with self._caller_ordered(), self._saved_tensor_hooks(), _whole_recomputation():
                return self.module(*args, **kwargs)
        except BaseException as e:
            if outermost:
                # Before the release unmaps the others.
                better = unmapped_error(e, self._param_id, self._grouping.name_of_param)
                self._end_failed_forward()
                if better is not None:
                    raise better from e
            raise
        finally:
            self._call_depth -= 1

    forward = __call__

    def backward(self, loss, retain_graph=False):
        """loss.backward() of loss × the engine's loss scale (fp16) ÷
        gradient_accumulation_steps (as DeepSpeed's engine.backward does, so a
        window's gradient is the mean of its micro-batches'); gradients go to
        the engine as each module's backward finishes."""
        self._check_open()
        factor = self._engine.loss_scale() / int(self.config["gradient_accumulation_steps"])
        self._end_failed_forward()
        self._in_backward = True
        try:
            with self._caller_ordered(), self._saved_tensor_hooks():
                (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self._in_backward = False
        for g in self._groups:
            g.end_backward()

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
        if self._foreign_backward is not None:
            mine = _model_name(self)
            raise FailedPreconditionError(
                f"step: the gradient window of the engine of {mine} holds gradients that another "
                f"engine's backward() sent through {mine}'s parameters (the engine of "
                f"{self._foreign_backward}), as a GAN generator's loss goes through the "
                f"discriminator. torch would add them to this step unless the script cleared "
                f"them, and Strata cannot see every way of clearing (p.grad = None): clear them "
                f"with {mine}.zero_grad(), engine.zero_grad() or engine.optimizer.zero_grad() "
                f"after the other backward and before this engine's own; the window is kept as "
                f"it is", "FailedPrecondition")
        for i, (group, pg) in enumerate(zip(self.optimizer.param_groups, self._param_groups)):
            lr = float(group["lr"])
            if lr != self._lr_pushed[i]:
                # Set from outside (a torch lr_scheduler, or by hand); refused by
                # the engine when the config has a scheduler section.
                self._engine.set_learning_rate(lr, pg.engine_id)
                self._lr_pushed[i] = lr
        stats = json.loads(self._engine.step())
        if stats.get("applied") or stats.get("overflow"):  # the window ended
            self._window_has_grads = False
        # The engine's groups include its group 0 (the config's own) even when
        # every model_parameters group has overrides: the lrs per the
        # caller's groups, in their order.
        if "group_lrs" in stats:
            engine_lrs = stats["group_lrs"]
            stats["group_lrs"] = [engine_lrs[pg.engine_id] for pg in self._param_groups]
        self.last_stats = stats
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
        """Discards the accumulated gradients of the current window. The
        model's own ``zero_grad()`` (and the optimizer's) calls it."""
        self._engine.zero_grad()
        self._window_has_grads = False
        self._foreign_backward = None

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
        return registered_names(self.module, self._param_id)

    def state_dict(self):
        """The model's state_dict with full-precision (fp32, CPU) values of the
        parameters the engine owns (the masters), and the model's other entries."""
        return self._state_dicts.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        """Loads parameters (into the engine's masters and working copies; the
        optimizer's moments are kept) and the model's other entries."""
        self._state_dicts.load_state_dict(state_dict, strict)

    def read_full_parameter(self, pid):
        """Engine parameter `pid`'s fp32 master, in its shape (a CPU copy)."""
        self._check_open()
        self._engine.synchronize()
        value = _dlpack.from_dlpack(self._engine.read_parameter(pid))
        return value.view(self._shape_of_id[pid]).clone()

    def write_full_parameter(self, pid, value):
        """Sets engine parameter `pid` (master and working copy; its moments
        are kept) from `value` (its shape, any float dtype)."""
        self._check_open()
        self._engine.synchronize()
        v = value.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
        self._engine.write_parameter(pid, _dlpack.to_dlpack(v))

    def save_checkpoint(self, directory, data_position=0, note=""):
        """Writes a checkpoint (parameters, fp32 masters and moments, step count,
        loss scaler) under `directory`; call after the step() ending a window."""
        self._engine.save_checkpoint(os.fspath(directory), data_position, note)

    def load_checkpoint(self, directory, convert_optimizer_states=False):
        """Restores the newest checkpoint under `directory`; returns a dict with
        data_position, note, optimizer_step and path. A checkpoint saved with
        another strata.optimizer_states is refused unless
        convert_optimizer_states is true: its states are then encoded in this
        engine's format (not between int8 and the other formats)."""
        info = self._engine.load_checkpoint(os.fspath(directory),
                                            convert_optimizer_states=convert_optimizer_states)
        self._show_scheduled_lr()
        return info

    def save_16bit_model(self, path):
        """Writes the model's state_dict with the engine's parameters in the
        training dtype (the masters rounded to nearest even, which is what the
        working copies hold after a step) to `path`: safetensors when it ends
        in ".safetensors" (parameters and floating-point buffers only, shapes
        kept), else torch.save of the whole state_dict. Tied parameters appear
        under every name in torch.save's file and under the first one in
        safetensors. Either way the file is new, of mode 0600, and renamed
        over `path` only when that is nothing or a regular file: a symlink,
        FIFO or directory there is refused naming it and left alone. With
        several ranks every rank calls it (state_dict() is a collective)."""
        self._write_16bit_model(self._16bit_state_dict(path), path)

    def _16bit_state_dict(self, path):
        """save_16bit_model's state_dict for `path` (a collective with several
        ranks, as state_dict() is)."""
        safetensors = os.fspath(path).endswith(".safetensors")
        if not safetensors:
            check_replaceable(path, "16-bit model file")  # before the work, on every rank
        sd = self.state_dict()
        names = self._registered_names()
        out = {}
        seen = set()
        for key, value in sd.items():
            if key in names:
                if safetensors:
                    if names[key] in seen:
                        continue
                    seen.add(names[key])
                value = value.to(self.dtype)
            out[key] = value
        return out

    @staticmethod
    def _write_16bit_model(state_dict, path):
        if os.fspath(path).endswith(".safetensors"):
            write_safetensors({k: v for k, v in state_dict.items() if torch.is_tensor(v)}, path)
        else:
            write_file_replacing(path, lambda f: torch.save(state_dict, f), "16-bit model file")

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
            g.release()
        with torch.no_grad():
            for g in self._groups:
                for p in g.params:
                    pid = self._param_id[id(p)]
                    value = _dlpack.from_dlpack(self._engine.read_parameter(pid))
                    dtype, device = self._origin[id(p)]
                    p.data = value.view(self._shape_of_id[pid]).to(device=device, dtype=dtype)
                    p.grad = None
                    for attr in ("ds_id", "ds_shape", "ds_numel", "ds_status"):
                        p.__dict__.pop(attr, None)
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod, _, _ in self._zero_grad_routes.values():
            mod.__dict__.pop("zero_grad", None)
        self._zero_grad_routes = {}
        self._accumulators = []
        self._views.owner = {}
        self._state["closed"] = True
        self._finalizer()  # destroys the engine
        atexit.unregister(self._finalizer)


def _model_name(engine):
    """How errors name an engine: its model's class."""
    return type(engine.module).__name__


def _routed_zero_grad(module, *args, **kwargs):
    """``module.zero_grad()`` of a module holding an open engine's parameters
    (Engine._route_module_zero_grad), then the module's class's own."""
    for engine in list(ENGINES):
        route = engine._zero_grad_routes.get(id(module))
        if route is None or route[0] is not module or engine._state["closed"]:
            continue
        _, name, whole = route
        if whole:
            engine.zero_grad()
        elif engine._window_has_grads:
            raise FailedPreconditionError(
                f"{name}.zero_grad(): {name} holds some of the parameters of the engine of "
                f"{_model_name(engine)}, whose gradient window holds gradients and is cleared "
                f"as a whole: call zero_grad() on {_model_name(engine)} (or engine.zero_grad()) "
                "to discard them all; nothing was cleared", "FailedPrecondition")
    return type(module).zero_grad(module, *args, **kwargs)


def export(checkpoint_dir, path, dtype="fp32"):
    """Writes the parameters of the checkpoint under `checkpoint_dir` (a root:
    its newest checkpoint that verifies; or one ckpt-<N> directory) to `path`
    as safetensors: dtype "fp32" the fp32 masters, "train" the training-dtype
    copies, each tensor in the model's shape under every name the model's
    state_dict gives it (a tied weight under each of its names), so that a
    fresh model loads the parameters with load_state_dict(strict=True) when
    they are all its state_dict holds. A checkpoint written before shapes
    and tied names were recorded gives each tensor flat ([numel]) under its
    first name. Every file's size and CRC-32C are verified first. Needs no
    engine (the same C++ as `strata checkpoint export`). Returns a dict:
    checkpoint, optimizer_step, tensors, bytes."""
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
