"""Diagnosis of a forward that raised on a parameter used outside its
module's forward.

Promises: ``unmapped_error(error, param_id, name_of_param)`` returns the
FailedPreconditionError to raise instead of `error` (a RuntimeError that is
not a StrataError) when the frames of its traceback refer to registered
parameters that are not mapped now (their ``data`` an empty placeholder):
as locals (F.multi_head_attention_forward's out_proj_weight), or as an
attribute path from a module local on the failing statement
(``self.embed.weight``). The message names them, the frame, the fixes
(register_external_parameter, set_leaf_modules) and torch's error. Else
None; the diagnosis never raises (engine.py's docstring, "Parameters used
outside their module's forward").
"""

import linecache
import os
import re

import torch

from ._errors import FailedPreconditionError, StrataError
from ._grouping import all_named_parameters


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


def _unmapped_used(tb, param_id, name_of_param):
    """[(name, frame description)] of the registered parameters (ids in
    `param_id`) that are not mapped now and that the frames of traceback `tb`
    refer to: as locals, or as an attribute path from a module local on the
    failing statement."""

    def unmapped(p):
        return id(p) in param_id and p.data.numel() == 0

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
                if unmapped(value):
                    found.setdefault(id(value), (name_of_param[id(value)], where))
            elif isinstance(value, torch.nn.Module) and text and var in text:
                for q, p in all_named_parameters(value, ""):
                    if unmapped(p) and re.search(
                            rf"\b{re.escape(var)}\.{re.escape(q)}\b", text):
                        found.setdefault(id(p), (name_of_param[id(p)], where))
        tb = tb.tb_next
    return list(found.values())


def unmapped_error(error, param_id, name_of_param):
    """The error to raise for `error` from a forward: a
    FailedPreconditionError naming the parameters used where they are not
    mapped and the fix, when any is found; else None. `param_id`: the
    registered parameters' ids (a container); `name_of_param`: id -> name."""
    if isinstance(error, StrataError) or not isinstance(error, RuntimeError):
        return None
    try:
        used = _unmapped_used(error.__traceback__, param_id, name_of_param)
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
