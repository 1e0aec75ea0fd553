"""The hooks through which torch tells the engine what runs: forward
pre-hooks and hooks on the modules, autograd functions around their inputs
and outputs for backward, a hook on each parameter's gradient accumulator,
and the saved-tensor hooks.

Promises (engine.py's docstring, "Forward", "Backward", "Saved tensors"):

* ``hook_module``: the module's forward enters its groups' forward (first
  among its pre-hooks, so that weight_norm's runs with the parameters
  mapped) and leaves it in its forward hook; with grad enabled its outputs
  pass through an ``_OnBackward`` that enters the groups' backward, and its
  inputs through one that leaves it. A forward during engine.backward()
  (activation checkpointing) runs on copies of the views.
* ``hook_gradients``: each parameter's finished gradient goes to its group
  (``_Group.take_gradient``) until the engine is closed; the engine notes
  each (``Engine._note_gradient``: whose backward it came from).
* ``SavedTensors``: a tensor autograd saves that lives in a parameter's
  engine memory is stored as (parameter, offset, size, stride) and rebuilt
  from the parameter's view when backward uses it (the group fetched again
  if it was released).

The state the hooks change is the groups' (strata._group); they read the
Engine's ``_in_backward``, ``_state`` and ``_on_stream()`` at each call.
"""

import torch

from ._group import storage_ptr


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


def _wrap(structure, callback):
    """structure with its tensors that need a gradient passed through
    _OnBackward(callback)."""
    tensors = []
    _collect(structure, tensors)
    if not tensors:
        return structure
    wrapped = _OnBackward.apply(callback, *tensors)
    return _replace(structure, {id(t): w for t, w in zip(tensors, wrapped)})


def _enter_backward(groups):
    for g in groups:
        g.enter_backward()


def _exit_backward(groups):
    for g in groups:
        g.exit_backward()


def _make_pre_forward(engine, groups):
    """`groups`: the module's own group, then those of its external
    parameters (the list grows when one is registered after initialize)."""

    def hook(module, inputs):
        gs = tuple(groups)
        for g in gs:
            g.enter_forward()
        if engine._in_backward and torch.is_grad_enabled():
            with engine._on_stream():
                for g in gs:
                    g.begin_recompute()
        if torch.is_grad_enabled():
            return _wrap(inputs, lambda: _exit_backward(gs))
        return None

    return hook


def _make_post_forward(engine, groups):
    def hook(module, inputs, output):
        gs = tuple(groups)
        if torch.is_grad_enabled():
            output = _wrap(output, lambda: _enter_backward(gs))
        if engine._in_backward and torch.is_grad_enabled():
            for g in gs:
                g.end_recompute()
        for g in gs:
            g.exit_forward()
        return output

    return hook


def hook_module(engine, mod, groups):
    """Installs `mod`'s forward pre-hook and forward hook for `groups` (a
    list the hooks read at each call); returns their handles."""
    handle = mod.register_forward_pre_hook(_make_pre_forward(engine, groups))
    # First: the module's own pre-hooks (weight_norm's, which computes the
    # weight from weight_g and weight_v) run with the parameters mapped.
    mod._forward_pre_hooks.move_to_end(handle.id, last=False)
    return [handle, mod.register_forward_hook(_make_post_forward(engine, groups))]


def _make_grad_hook(engine, g, i):
    def hook(grad_inputs, grad_outputs):
        if engine._state["closed"]:
            return
        engine._note_gradient()
        g.take_gradient(i)

    return hook


def hook_gradients(engine, groups, views):
    """Hooks each parameter's gradient accumulator (made while the parameter
    has its full shape, dtype and device: autograd checks gradients against
    them), then gives it `views`' placeholder as its data. Returns the
    accumulators (the hooks live as long as they are referenced)."""
    accumulators = []
    with engine._on_stream(), torch.enable_grad():
        for g in groups:
            for i, p in enumerate(g.params):
                p.data = torch.empty(1, dtype=engine.dtype, device=engine.device).expand(p.shape)
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(_make_grad_hook(engine, g, i))
                accumulators.append(acc)
                p.data = views.placeholder()
                p.grad = None
    return accumulators


class _SavedView:
    """A tensor autograd saved that lives in a parameter's engine memory."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param, offset, size, stride):
        self.param = param
        self.offset = offset
        self.size = size
        self.stride = stride


class SavedTensors:
    """pack and unpack, the saved-tensor hooks of an engine's forward and
    backward. `views`: the Views whose ``owner`` says which parameter a
    storage belongs to; `group_of_param`: id(param) -> its group."""

    def __init__(self, views, group_of_param):
        self._views = views
        self._group_of_param = group_of_param

    def pack(self, t):
        owner = self._views.owner
        if not owner or t.numel() == 0:
            return t
        try:
            p = owner.get(storage_ptr(t))
        except (RuntimeError, NotImplementedError):  # no storage (sparse, ...)
            return t
        if p is None:
            return t
        return _SavedView(p, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def unpack(self, x):
        if not isinstance(x, _SavedView):
            return x
        if x.param.data.numel() == 0:
            # Used in backward after its module's backward ended (an op on the
            # parameter alone): fetched again, held to the end of backward.
            self._group_of_param[id(x.param)].enter_backward()
        return x.param.data.as_strided(x.size, x.stride, x.offset)
