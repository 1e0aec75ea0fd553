"""State dicts while the engine owns the parameters.

Promises (engine.py's docstring, "model.load_state_dict()"):

* ``model.state_dict()`` (or a submodule's) gives each owned parameter's
  fp32 master in the parameter's original dtype and device (what close()
  gives back) instead of the empty placeholder.
* ``model.load_state_dict()`` (or a submodule's): a pre-hook per module
  takes each owned key out of the state_dict and writes its value into the
  engine (WriteParameter: master and working copy, moments kept); a
  post-hook takes those keys out of missing_keys again. A shape mismatch is
  torch's message.
* ``engine.state_dict()`` / ``engine.load_state_dict()``: the same through
  the engine's registered names (fp32 CPU masters; shape errors as
  InvalidArgumentError).

The hooks do nothing once the engine is closed. They read the Engine's
``_engine`` (looked up at each call), ``_param_id``, ``_shape_of_id``,
``_origin`` and ``_state``.
"""

import torch
import torch.utils.dlpack as _dlpack

from ._errors import InvalidArgumentError


def registered_names(model, param_id):
    """Every qualified name of every registered parameter -> parameter id."""
    names = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for n, p in mod._parameters.items():
            if p is not None and id(p) in param_id:
                names[f"{mname}.{n}" if mname else n] = param_id[id(p)]
    return names


class StateDicts:
    """The state-dict hooks of one Engine and its state_dict/load_state_dict."""

    def __init__(self, engine):
        self._owner = engine
        self._loaded = (None, set())  # model.load_state_dict: (its missing_keys, keys written)
        self._in_engine_state_dict = False

    def install(self, module):
        """Hooks every module of `module` that owns registered parameters;
        returns the handles."""
        handles = []
        param_id = self._owner._param_id
        for mod in module.modules():
            owned = [(n, p) for n, p in mod._parameters.items()
                     if p is not None and id(p) in param_id]
            if owned:
                hook = self._make_state_dict_hook(owned)
                handles.append(mod._register_state_dict_hook(hook))
                handles.append(mod._register_load_state_dict_pre_hook(
                    self._make_load_state_dict_hook(owned)))
                handles.append(mod.register_load_state_dict_post_hook(
                    self._drop_loaded_from_missing))
        return handles

    def _make_load_state_dict_hook(self, owned):
        """model.load_state_dict() (or a submodule's) while the engine owns the
        parameters: each owned value goes into the engine (WriteParameter:
        master and working copy, moments kept), as engine.load_state_dict
        does, instead of into the empty placeholder. The key is taken out of
        the state_dict so that torch does not copy it; the post-hook takes it
        out of missing_keys again."""
        e = self._owner

        def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs):
            if e._state["closed"]:
                return
            for name, p in owned:
                key = prefix + name
                if key not in state_dict:
                    continue
                value = state_dict.pop(key)
                if self._loaded[0] is not missing_keys:  # a new load_state_dict call
                    self._loaded = (missing_keys, set())
                self._loaded[1].add(key)
                pid = e._param_id[id(p)]
                shape = e._shape_of_id[pid]
                if not torch.is_tensor(value) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {got} from "
                        f"checkpoint, the shape in current model is {shape}.")
                    continue
                v = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
                e._engine.write_parameter(pid, _dlpack.to_dlpack(v))

        return hook

    def _drop_loaded_from_missing(self, module, incompatible_keys):
        missing, loaded = self._loaded
        if missing is incompatible_keys.missing_keys and loaded:
            missing[:] = [k for k in missing if k not in loaded]

    def _make_state_dict_hook(self, owned):
        """model.state_dict() while the engine owns the parameters: each one's
        fp32 master in the parameter's original dtype and device (what close()
        gives back), instead of the empty placeholder."""
        e = self._owner

        def hook(module, state_dict, prefix, local_metadata):
            if self._in_engine_state_dict or e._state["closed"]:
                return
            e._engine.synchronize()
            for name, p in owned:
                key = prefix + name
                if key not in state_dict:
                    continue
                pid = e._param_id[id(p)]
                value = _dlpack.from_dlpack(e._engine.read_parameter(pid))
                dtype, device = e._origin[id(p)]
                state_dict[key] = value.view(e._shape_of_id[pid]).to(device=device,
                                                                     dtype=dtype)

        return hook

    def state_dict(self):
        """engine.state_dict(): the model's state_dict with full-precision
        (fp32, CPU) values of the parameters the engine owns (the masters),
        and the model's other entries."""
        e = self._owner
        e._engine.synchronize()
        names = registered_names(e.module, e._param_id)
        values = {}
        self._in_engine_state_dict = True
        try:
            out = e.module.state_dict()
        finally:
            self._in_engine_state_dict = False
        for key in out:
            if key in names:
                pid = names[key]
                if pid not in values:
                    shape = e._shape_of_id[pid]
                    values[pid] = _dlpack.from_dlpack(e._engine.read_parameter(pid)).view(shape)
                out[key] = values[pid]
        return out

    def load_state_dict(self, state_dict, strict):
        """engine.load_state_dict(): parameters into the engine's masters and
        working copies (the optimizer's moments kept), the model's other
        entries into the model."""
        e = self._owner
        names = registered_names(e.module, e._param_id)
        written = set()
        rest = {}
        for key, value in state_dict.items():
            if key not in names:
                rest[key] = value
                continue
            pid = names[key]
            shape = e._shape_of_id[pid]
            if tuple(value.shape) != shape:
                raise InvalidArgumentError(
                    f"load_state_dict: {key} has shape {tuple(value.shape)}, the parameter "
                    f"{shape}", "InvalidArgument")
            if pid in written:
                continue
            v = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
            e._engine.write_parameter(pid, _dlpack.to_dlpack(v))
            written.add(pid)
        missing = [k for k, pid in names.items() if pid not in written]
        result = e.module.load_state_dict(rest, strict=False)
        if strict:
            missing += [k for k in result.missing_keys if k not in names]
            if missing or result.unexpected_keys:
                raise InvalidArgumentError(
                    f"load_state_dict: missing keys {missing}, unexpected keys "
                    f"{list(result.unexpected_keys)}", "InvalidArgument")
