"""strata.init: build a model bigger than host memory, as DeepSpeed's
``deepspeed.zero.Init``.

    with strata.init(config="ds_config.json"):
        model = MyModel()            # parameters spilled module by module
    engine = strata.initialize(model, "ds_config.json")

What it promises:

* Spilling. Inside the context, when the ``__init__`` of a torch module
  returns (the outermost one of that instance: a subclass's ``super()``
  chain counts once), every parameter of its subtree that is not spilled yet
  is written to the spill store and its ``data`` becomes a placeholder: a
  zero-stride view of one element with the parameter's shape and dtype
  (``shape``, ``dtype``, ``device``, ``requires_grad``, ``numel()`` are
  those of the parameter; its class becomes a subclass of
  ``torch.nn.Parameter`` that also has DeepSpeed's ``ds_id``, ``ds_shape``,
  ``ds_numel`` and ``ds_status``, NOT_AVAILABLE while spilled). Spilled are
  parameters of the exact type ``torch.nn.Parameter`` on the CPU with at
  least one element; others
  (CUDA, meta, lazy or custom Parameter subclasses) stay as they are, and so
  do buffers. Host memory while building holds about one module's
  parameters at a time (the largest module's, plus those a parent's
  ``__init__`` touches, below), not the model's. ``copy.deepcopy`` of a
  spilled parameter is a spilled copy (the file copied), so
  ``nn.TransformerEncoder``'s clones of its layer take no RAM either.
* The spill store: files in a private directory (``strata-init-*``) under
  the config's ``zero_optimization.offload_param.nvme_path`` when
  ``offload_param.device`` is nvme, else ``offload_optimizer.nvme_path``
  when that is nvme, else the temporary directory (``tempfile``, TMPDIR);
  ``spill="<dir>"`` names the directory, ``spill="ram"`` keeps the values
  in RAM (no saving while building: for cpu placements, whose states need
  the RAM anyway, and for tests). The directory goes when its last spilled
  parameter is handed to an engine or garbage collected, and at exit.
* Touching a spilled parameter: any torch operation on it other than
  reading its metadata (an ``nn.init.*_`` call, ``param.data``, a forward)
  first reads it back from the store (transparently, so the values and the
  order in which the RNG is consumed are those of a plain build). Inside a
  module's ``__init__`` (a parent re-initializing a child:
  ``nn.init.normal_(self.fc.weight)``) it stays in RAM until that
  ``__init__`` returns and is then spilled again with its new values.
  ``nn.Module.apply(fn)`` streams while the context is active: each
  module's parameters that ``fn`` touches are spilled again when ``fn``
  returns for that module (HF's ``self.apply(self._init_weights)`` /
  ``post_init()`` in a model's ``__init__``), so a whole-model apply holds
  one module at a time. Touched anywhere else (after the context, or in the
  ``with`` block outside any ``__init__``), a parameter is read back for
  good: it is an ordinary parameter again.
  A tensor taken from a parameter (``w = p.data``) must not be written
  after the ``__init__`` (or ``fn``) that took it returned: the parameter
  has been spilled and the write would reach a copy.
* ``strata.initialize(model, config)`` on such a model registers each
  spilled trainable parameter with a callable that reads its values from
  the store straight into the engine's buffer when the engine initializes
  its states (one parameter in RAM at a time), then removes the spill
  files. The values are bitwise those a plain build with the same seed
  produces. Frozen spilled parameters are read back into RAM (torch keeps
  them). ``materialize(model)`` reads every spilled parameter back without
  an engine.
* Nested contexts are an error (FailedPreconditionError). The context
  patches ``__init__`` of every ``torch.nn.Module`` subclass (classes
  defined inside it too), ``nn.Module.__init_subclass__`` and
  ``nn.Module.apply``, process-wide; all are restored on exit, also when
  the block raises. One thread builds the model.
"""

import functools
import itertools
import os
import tempfile
import types
import weakref

import torch
import torch.utils.dlpack as _dlpack
from torch.utils._pytree import tree_flatten

from ._config import parse_config
from ._errors import FailedPreconditionError, InvalidArgumentError
from ._group import ParamStatus
from ._spill_store import _Store

_ACTIVE = None  # the init context in effect


class _Spill:
    """Where one parameter's values are: its store and key, the spilled
    shape and dtype; resident while read back inside a frame (below)."""

    __slots__ = ("store", "key", "shape", "dtype", "name", "resident", "ds_id", "_discard",
                 "__weakref__")
    _ids = itertools.count()  # ds_id: unique in the process, as DeepSpeed's

    def __init__(self, store, name, shape, dtype):
        self.store = store
        self.key = store.new_key()
        self.ds_id = next(_Spill._ids)
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.resident = False
        # The file goes with the record (a parameter garbage collected).
        self._discard = weakref.finalize(self, store.discard, self.key)

    def read(self):
        t = torch.empty(self.shape, dtype=self.dtype, device="cpu")
        self.store.read(self.key, t, self.name)
        return t

    def fill(self, capsule):
        """register_parameter_fn's callable: the values as fp32 into the
        engine's buffer (numel elements)."""
        out = _dlpack.from_dlpack(capsule)
        if self.dtype == torch.float32:
            self.store.read(self.key, out, self.name)
        else:
            out.copy_(self.read().view(-1))

    def discard(self):
        self._discard()


# torch.Tensor's C base class (TensorBase since torch 2.2, _TensorBase before).
_TENSOR_BASE = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
# Inside SpilledParameter's own __torch_function__: the subclass's handler
# off, torch function modes (torch.set_default_device's) left on. torch 1.13
# has only DisableTorchFunction, which has no modes to leave on there.
_NO_SUBCLASS_FUNCTION = getattr(torch._C, "DisableTorchFunctionSubclass",
                                torch._C.DisableTorchFunction)

# Reading these leaves a spilled parameter spilled: its metadata, which the
# placeholder carries. Anything else reads it back first.
_METADATA_ATTRS = {_TENSOR_BASE.__dict__[name] for name in (
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "ndim",
    "is_sparse", "is_cuda", "is_meta", "is_quantized", "is_mkldnn", "names", "name",
    "_backward_hooks", "output_nr", "_version") if name in _TENSOR_BASE.__dict__}
_METADATA = {getattr(torch.Tensor, name) for name in (
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
    "is_complex", "requires_grad_", "get_device", "__hash__", "__repr__", "register_hook")
    if hasattr(torch.Tensor, name)}


def _is_metadata(func):
    if func in _METADATA:
        return True
    owner = getattr(func, "__self__", None)
    return type(owner).__name__ == "getset_descriptor" and owner in _METADATA_ATTRS


class SpilledParameter(torch.nn.Parameter):
    """A parameter whose values are in a strata.init spill store; its data
    is a placeholder of its shape and dtype. A torch operation on it (other
    than reading metadata) reads the values back first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_metadata(func):
            for a in tree_flatten((args, kwargs))[0]:
                if type(a) is SpilledParameter:
                    _read_back(a)
        with _NO_SUBCLASS_FUNCTION():
            return func(*args, **kwargs)

    # DeepSpeed's attributes of a parameter zero.Init has partitioned, for
    # code that tests for them before an engine takes the model (which then
    # gives them its own): NOT_AVAILABLE while the values are in the store,
    # AVAILABLE while read back inside a module's __init__. Reading them
    # does not read the values back.
    @property
    def ds_status(self):
        rec = _record(self)
        return ParamStatus.NOT_AVAILABLE if rec is not None and not rec.resident \
            else ParamStatus.AVAILABLE

    @property
    def ds_shape(self):
        return self.shape

    @property
    def ds_numel(self):
        return self.numel()

    @property
    def ds_id(self):
        rec = _record(self)
        return rec.ds_id if rec is not None else None

    def __deepcopy__(self, memo):
        # copy.deepcopy of a spilled layer (nn.TransformerEncoder clones the
        # layer it is given): a spilled copy, its file copied in the store, so
        # the clones take no RAM either; a read-back one is copied as torch does.
        if id(self) in memo:
            return memo[id(self)]
        rec = _record(self)
        if rec is not None and not rec.resident:
            result = torch.nn.Parameter(_placeholder(rec.shape, rec.dtype), self.requires_grad)
            twin = _Spill(rec.store, rec.name, rec.shape, rec.dtype)
            rec.store.copy(rec.key, twin.key, rec.name)
            result.__dict__["_strata_spill"] = twin
            result.__class__ = SpilledParameter
        else:
            result = torch.nn.Parameter(_data(self).clone(), self.requires_grad)
        memo[id(self)] = result
        return result

    def __repr__(self):
        rec = self.__dict__.get("_strata_spill")
        if rec is None or rec.resident:
            return super().__repr__()
        return (f"SpilledParameter(shape={tuple(rec.shape)}, dtype={rec.dtype}, "
                f"requires_grad={self.requires_grad})")


_PLACEHOLDERS = {}


def _placeholder(shape, dtype):
    base = _PLACEHOLDERS.get(dtype)
    if base is None:
        base = _PLACEHOLDERS[dtype] = torch.zeros((), dtype=dtype, device="cpu")
    return base.expand(shape)


def _record(p):
    return p.__dict__.get("_strata_spill") if type(p) is SpilledParameter else None


def _set_data(p, t):
    with _NO_SUBCLASS_FUNCTION():
        p.data = t


def _data(p):
    with _NO_SUBCLASS_FUNCTION():
        return p.data


def _spillable(p):
    if type(p) is SpilledParameter:
        if _record(p) is not None:
            return False  # spilled, or read back in a frame
    elif type(p) is not torch.nn.Parameter:
        return False
    t = _data(p)
    return t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0


def _spill(p, store, name):
    """Moves a plain parameter's values into `store`."""
    t = _data(p)
    rec = _Spill(store, name, tuple(t.shape), t.dtype)
    store.write(rec.key, t, name)
    p.__dict__["_strata_spill"] = rec
    p.__class__ = SpilledParameter
    _set_data(p, _placeholder(rec.shape, rec.dtype))


def _respill(p):
    """A parameter read back inside a frame goes back to its store with its
    current values (a different shape or dtype if its data was replaced)."""
    rec = _record(p)
    if rec is None or not rec.resident:
        return
    t = _data(p)
    if t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0:
        _unspill(p)  # moved off the CPU (or emptied) inside __init__: torch's now
        return
    rec.shape, rec.dtype = tuple(t.shape), t.dtype
    rec.store.write(rec.key, t, rec.name)
    rec.resident = False
    _set_data(p, _placeholder(rec.shape, rec.dtype))


def _unspill(p):
    """An ordinary parameter again, with the data it has now; the record
    (and its file) go."""
    rec = p.__dict__.pop("_strata_spill", None)
    p.__class__ = torch.nn.Parameter
    if rec is not None:
        rec.discard()


def _read_back(p):
    rec = _record(p)
    if rec is None or rec.resident:
        return
    _set_data(p, rec.read())
    ctx = _ACTIVE
    if ctx is not None and ctx._frames:
        rec.resident = True
        ctx._frames[-1].append(p)
    else:
        _unspill(p)


def materialize_param(p):
    """Reads `p` back into RAM if spilled: an ordinary parameter again."""
    rec = _record(p)
    if rec is None:
        return
    if not rec.resident:
        _set_data(p, rec.read())
    _unspill(p)


def materialize(model):
    """Reads every spilled parameter of `model` back into RAM: ordinary
    parameters again, as a plain build made them. Returns the model."""
    for p in model.parameters():
        materialize_param(p)
    return model


def is_spilled(param):
    """Whether `param`'s values are in a strata.init spill store now."""
    rec = _record(param)
    return rec is not None and not rec.resident


# ---- for the engine (strata.initialize) ---------------------------------------


def take(p, name=None):
    """The spill record of `p` if its values are in a store (else None),
    for registration with register_parameter_fn; `p` becomes an ordinary
    parameter with the placeholder as its data (the engine replaces it).
    The record keeps the file until discarded (after the engine's Plan) or
    given back (put_back, when initialize fails); `name` (the parameter's
    qualified name in the model) is the one its errors give from now on."""
    rec = _record(p)
    if rec is None:
        return None
    if rec.resident:  # read back for good: an ordinary parameter
        _unspill(p)
        return None
    del p.__dict__["_strata_spill"]
    p.__class__ = torch.nn.Parameter
    if name is not None:
        rec.name = name  # the model's name for it, for errors
    return rec


def put_back(p, rec):
    """Undoes take(): `p` is spilled again (initialize failed)."""
    p.__dict__["_strata_spill"] = rec
    p.__class__ = SpilledParameter
    _set_data(p, _placeholder(rec.shape, rec.dtype))


# ---- the context ---------------------------------------------------------------


def _spill_dir(config, auto_values, spill):
    """The directory for spill files (None: RAM), from `spill` or the config."""
    if spill is not None:
        if spill == "ram":
            return None
        if not isinstance(spill, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"strata.init: spill must be a directory path or 'ram', not "
                f"{type(spill).__name__}", "InvalidArgument")
        base = os.fspath(spill)
        what = "spill"
    else:
        base, what = None, None
        if config is not None:
            zero = parse_config(config, auto_values)["zero_optimization"]
            for key in ("offload_param", "offload_optimizer"):
                section = zero.get(key, {})
                paths = section.get("nvme_path") or []
                if isinstance(paths, str):
                    paths = [paths]
                if section.get("device") == "nvme" and paths:
                    base, what = paths[0], f"zero_optimization.{key}.nvme_path"
                    break
        if base is None:
            base, what = tempfile.gettempdir(), "the temporary directory"
    if not os.path.isdir(base):
        raise InvalidArgumentError(
            f"strata.init: {what} {base!r} is not a directory (the spill files go there)",
            "InvalidArgument")
    try:
        return tempfile.mkdtemp(prefix="strata-init-", dir=base)
    except OSError as e:
        raise InvalidArgumentError(
            f"strata.init: cannot create a spill directory in {what} {base!r}: "
            f"{e.strerror or e} (errno {e.errno})", "InvalidArgument") from e


def _all_subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


class init:
    """Context manager: modules built inside it have their parameters
    spilled out of RAM as each module's ``__init__`` returns (module
    docstring). `config`: what strata.initialize takes (a DeepSpeed JSON
    path or dict; optional), for the spill directory; `auto_values` as
    initialize's. `spill`: a directory, or "ram"; overrides the config."""

    def __init__(self, config=None, *, auto_values=None, spill=None):
        self._config = config
        self._auto_values = auto_values
        self._spill = spill
        self._store = None
        self._frames = []  # per __init__ / apply fn in progress: params read back in it
        self._depth = {}  # id(module) -> wrapped __init__ calls in progress
        self._patched = []  # (class, original __init__)
        self._saved = {}  # nn.Module attribute -> its own value before (or None)
        self._entered = False

    @property
    def spill_dir(self):
        """The directory holding the spill files (None: RAM, or before entering)."""
        return None if self._store is None else self._store.directory

    def __enter__(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise FailedPreconditionError(
                "strata.init: already inside a strata.init context; nested contexts are not "
                "supported (build the whole model inside one)", "FailedPrecondition")
        if self._entered:
            raise FailedPreconditionError(
                "strata.init: this context was entered before; make a new strata.init(...)",
                "FailedPrecondition")
        self._store = _Store(_spill_dir(self._config, self._auto_values, self._spill))
        self._entered = True
        try:
            for cls in _all_subclasses(torch.nn.Module):
                self._wrap(cls)
            module_dict = torch.nn.Module.__dict__
            for attr in ("__init_subclass__", "apply"):
                self._saved[attr] = module_dict.get(attr)
            ctx = self

            def __init_subclass__(cls, **kwargs):
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)
                ctx._wrap(cls)

            torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
            torch.nn.Module.apply = _streaming_apply
        except BaseException:
            self._restore()
            raise
        _ACTIVE = self
        return self

    def __exit__(self, exc_type, exc, tb):
        global _ACTIVE
        self._restore()
        _ACTIVE = None
        # Parameters still read back (a module's __init__ raised): ordinary ones.
        for frame in self._frames:
            for p in frame:
                if type(p) is SpilledParameter:
                    _unspill(p)
        self._frames = []
        self._depth = {}
        self._store.context_open = False
        self._store.maybe_remove()
        return False

    def _restore(self):
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched = []
        for attr, value in self._saved.items():
            if value is None:
                if attr in torch.nn.Module.__dict__:
                    delattr(torch.nn.Module, attr)
            else:
                setattr(torch.nn.Module, attr, value)
        self._saved = {}

    def _wrap(self, cls):
        orig = cls.__dict__.get("__init__")
        if not isinstance(orig, types.FunctionType) or getattr(orig, "_strata_init", False):
            return
        ctx = self

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            if _ACTIVE is not ctx:
                return orig(module, *args, **kwargs)
            key = id(module)
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            ctx._frames.append([])
            ok = False
            try:
                orig(module, *args, **kwargs)
                ok = True
            finally:
                ctx._end_frame(ok)
                ctx._depth[key] -= 1
                if ctx._depth[key] == 0:
                    del ctx._depth[key]
                    if ok:
                        ctx._spill_subtree(module)

        __init__._strata_init = True
        cls.__init__ = __init__
        self._patched.append((cls, orig))

    def _end_frame(self, ok):
        frame = self._frames.pop()
        if not ok:  # raised: the enclosing frame (or the context's exit) takes them
            if self._frames:
                self._frames[-1].extend(frame)
            else:
                for p in frame:
                    _unspill(p)
            return
        for p in frame:
            _respill(p)

    def _spill_subtree(self, module):
        if "_modules" not in module.__dict__:
            return  # nn.Module.__init__ never ran: torch raises on its own
        for mname, mod in module.named_modules():
            for n, p in mod._parameters.items():
                if p is not None and _spillable(p):
                    where = f"{mname}.{n}" if mname else n
                    _spill(p, self._store, f"{type(module).__name__}.{where}")


def _streaming_apply(self, fn):
    """nn.Module.apply inside strata.init: children first, then fn(self) (as
    torch's), each fn call a frame whose read-back parameters are spilled
    again when it returns."""
    for module in self.children():
        module.apply(fn)
    ctx = _ACTIVE
    if ctx is None:
        fn(self)
        return self
    ctx._frames.append([])
    ok = False
    try:
        fn(self)
        ok = True
    finally:
        ctx._end_frame(ok)
    return self
