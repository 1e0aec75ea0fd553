"""Grouping: which torch modules' parameters form one engine module, and
which engine modules each hooked torch module holds.

Promises (engine.py's docstring, "Grouping" and "Parameters used outside
their module's forward"):

* Every module that owns trainable parameters directly becomes an engine
  module, in ``named_modules()`` order; a leaf module (``_is_leaf``: marked
  ``_strata_leaf``, or torch's MultiheadAttention and
  TransformerEncoderLayer) owns its whole subtree's and its descendants get
  no hooks. Modules that share a parameter are merged (union-find over
  parameters). A parameter's name is its first qualified name.
* External parameters (``register_external_parameter``, recorded on a
  module as ``_strata_external_params``) add the engine module owning them
  to the groups their module (or the leaf around it) holds.
* ``set_leaf_modules`` marks leaves before initialize; both public calls
  find the open engine that owns a parameter through ``ENGINES``.

Imports nothing of the frontend: the engine modules are made by the
``new_group(index)`` callable the Engine gives.
"""

import weakref

import torch

from ._errors import FailedPreconditionError, InvalidArgumentError

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
ENGINES = weakref.WeakSet()


def _engine_of(params):
    """The open Engine that owns any of `params`, or None."""
    ids = {id(p) for p in params}
    for engine in list(ENGINES):
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


def all_named_parameters(module, prefix):
    """(qualified name, parameter) of `module`'s subtree, shared ones under
    every name (torch 1.13's named_parameters has no remove_duplicate)."""
    for mname, mod in module.named_modules(prefix=prefix, remove_duplicate=False):
        for n, p in mod._parameters.items():
            if p is not None:
                yield (f"{mname}.{n}" if mname else n), p


class Grouping:
    """The engine modules of one model. ``groups``: in registration order,
    each made by ``new_group(index)`` and given ``params`` and ``names``;
    ``of_module``: torch module -> [group] its hooks hold (its own, then
    those of its external parameters); ``of_param``: id(param) -> group;
    ``name_of_param``: id(param) -> its first qualified name."""

    def __init__(self, model, new_group):
        self.model = model
        self.groups = []
        self.of_module = {}
        self.name_of_param = {}
        self.of_param = {}
        self._build(new_group)

    def _build(self, new_group):
        """Engine modules from the torch modules owning trainable parameters;
        a leaf module (engine.py's docstring, "Leaf modules") owns its whole
        subtree's; external parameters add their groups to their user's."""
        trainable = {id(p) for p in self.model.parameters()
                     if p.requires_grad and p.numel() > 0}
        owners = []  # (module, [(qualified name, param)]), named_modules() order
        seen = set()

        def walk(mod, prefix):
            if id(mod) in seen:
                return
            seen.add(id(mod))
            if _is_leaf(mod):
                direct = [(n, p) for n, p in all_named_parameters(mod, prefix)
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

        walk(self.model, "")
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
                by_root[root] = new_group(len(by_root))
                self.groups.append(by_root[root])
            g = by_root[root]
            g.params.append(p)
            g.names.append(name)
            self.name_of_param[key] = name
        for mod, direct in owners:
            self.of_module[mod] = [by_root[find(id(direct[0][1]))]]
        for g in self.groups:
            for p in g.params:
                self.of_param[id(p)] = g
        # External parameters: registered on a module, or on a module inside a
        # leaf (whose forward runs inside the leaf's).
        leaf_of = {}
        for mod in self.model.modules():
            if _is_leaf(mod):
                for sub in mod.modules():
                    leaf_of.setdefault(id(sub), mod)
        for mname, mod in self.model.named_modules():
            for p in mod.__dict__.get("_strata_external_params", ()):
                self._attach_external(leaf_of.get(id(mod), mod), p, mname)

    def _attach_external(self, mod, p, mname):
        """`mod`'s forward and backward also hold the group of `p`. A frozen
        parameter needs nothing (torch keeps its data); one not in the model is
        an error."""
        g = self.of_param.get(id(p))
        if g is None:
            if any(q is p for q in self.model.parameters()):
                return  # frozen: not the engine's
            raise InvalidArgumentError(
                f"register_external_parameter: the parameter of shape {tuple(p.shape)} "
                f"registered on module {mname or '<root>'} ({type(mod).__name__}) is not a "
                "parameter of the model given to initialize; register parameters the model "
                "owns", "InvalidArgument")
        groups = self.of_module.setdefault(mod, [])
        if g not in groups:
            groups.append(g)

    def add_external(self, mod, p):
        """register_external_parameter after initialize: attaches `p`'s group
        to `mod` (or the leaf around it). Returns the module that needs hooks
        now (it had none), or None."""
        mname = next((n for n, m in self.model.named_modules() if m is mod), None)
        if mname is None:
            raise InvalidArgumentError(
                f"register_external_parameter: the module ({type(mod).__name__}) is not part of "
                "the model this engine trains", "InvalidArgument")
        leaf = next((m for m in self.model.modules()
                     if _is_leaf(m) and any(s is mod for s in m.modules())), mod)
        hooked = leaf in self.of_module
        self._attach_external(leaf, p, mname)
        if not hooked and leaf in self.of_module:
            return leaf
        return None
