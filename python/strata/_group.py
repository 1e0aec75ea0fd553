"""One engine module's state and the transitions between its states.

Promises: a ``_Group`` (the parameters of one or more torch modules that the
engine fetches and releases together) knows whether its parameter views are
held, how many forwards and backwards of its modules are in progress, which
gradients are finished, and the recomputations in progress; its methods are
the only code that changes that state and the only code that calls the
engine's BeforeForward, AfterForward, BeforeBackward and AfterBackward for
it. ``Views`` points each parameter's ``data`` at the engine's view while
its group is held (at one empty placeholder otherwise) and remembers which
parameter a live view's storage belongs to (for the saved-tensor hooks).

A group's parameter views are held with BeforeForward..AfterForward while a
forward of one of its modules runs (fwd_depth) or a backward of one does
(bwd_depth: from the backward of the module's outputs to that of its
inputs; to the end of backward when its inputs need no gradient). A module
called twice is fetched again for its second backward rather than held in
between.

Gradients are handed over when all of the group's are finished (after their
last use in backward): AfterForward if held, BeforeBackward, a copy into the
engine's buffers, AfterBackward. So no gradient buffer is held while other
modules' backward runs (a group used until the end of backward: the top
module's own parameters, tied weights); at most one is being written.
"""

import enum

import torch
import torch.utils.dlpack as _dlpack

if hasattr(torch.Tensor, "untyped_storage"):

    def storage_ptr(t):
        return t.untyped_storage().data_ptr()

elif hasattr(torch.Tensor, "_storage"):  # torch 1.13: without building a TypedStorage

    def storage_ptr(t):
        return t._storage().data_ptr()

else:  # torch 1.x

    def storage_ptr(t):
        return t.storage().data_ptr()


class ParamStatus(enum.Enum):
    """A registered parameter's ``ds_status``, DeepSpeed's ZeroParamStatus:
    AVAILABLE while its data is the engine's view, NOT_AVAILABLE while it is
    the empty placeholder (INFLIGHT is DeepSpeed's, never set here)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class Views:
    """What a registered parameter's ``data`` is: the engine's view while its
    group is held, else the placeholder; ``owner``: storage pointer of a live
    view -> its parameter."""

    def __init__(self, dtype, device):
        self.dtype = dtype
        self.device = device
        self.owner = {}
        self._empty = None

    def placeholder(self):
        # One empty tensor for every released parameter (p.data = it shares
        # nothing a parameter could write: it has no elements).
        if self._empty is None:
            self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        return self._empty

    def map(self, params, capsules):
        for p, cap in zip(params, capsules):
            v = _dlpack.from_dlpack(cap)
            p.data = v
            p.ds_status = ParamStatus.AVAILABLE
            if v.numel():
                self.owner[storage_ptr(v)] = p

    def unmap(self, params):
        for p in params:
            if p.data.numel():
                self.owner.pop(storage_ptr(p.data), None)
            p.data = self.placeholder()
            p.ds_status = ParamStatus.NOT_AVAILABLE


class _Group:
    """One engine module: the parameters of one or more torch modules.

    `frontend`: the Engine it belongs to. Its ``_engine`` (the _strata
    engine) is looked up at each call, so a wrapper put there (tests,
    bench/frontend_overhead.py) sees every call; its ``_views`` maps the
    parameters and its ``_on_stream()`` orders the gradient copies."""

    def __init__(self, index, frontend):
        self.index = index
        self.frontend = frontend
        self.params = []  # torch Parameters, registration order
        self.names = []  # their first qualified names
        self.fwd_depth = 0  # forwards of its modules in progress
        self.bwd_depth = 0  # backwards of its modules in progress
        self.in_backward = False  # gradients due in this backward pass
        self.held = False  # BeforeForward without AfterForward: views mapped
        self.pending = {}  # param index -> finished gradient, until all are there
        self.recompute = []  # the views replaced by copies, per recomputation in progress

    # ---- fetched and released ------------------------------------------------

    def hold(self):
        if not self.held:
            f = self.frontend
            f._views.map(self.params, f._engine.before_forward(self.index))
            self.held = True

    def release(self):
        if self.held:
            f = self.frontend
            f._engine.after_forward(self.index)
            self.held = False
            f._views.unmap(self.params)

    def maybe_release(self):
        if self.fwd_depth == 0 and self.bwd_depth == 0:
            self.release()

    # ---- forward and backward of its modules ---------------------------------

    def enter_forward(self):
        self.fwd_depth += 1
        self.hold()

    def exit_forward(self):
        self.fwd_depth -= 1
        self.maybe_release()

    def abandon_forward(self):
        """After a forward that raised: its forwards in progress never end."""
        if self.fwd_depth > 0:
            self.fwd_depth = 0
            self.recompute = []
            self.maybe_release()

    def enter_backward(self):
        self.bwd_depth += 1
        self.in_backward = True
        self.hold()

    def exit_backward(self):
        self.bwd_depth = max(0, self.bwd_depth - 1)
        self.maybe_release()

    def end_backward(self):
        """At the end of engine.backward(): modules whose inputs need no
        gradient end here; parameters that got no gradient get zeros."""
        self.bwd_depth = 0
        if self.in_backward or self.pending:
            self.hand_over()
        self.maybe_release()

    # ---- recomputation (activation checkpointing) ----------------------------
    # A forward during backward() is activation checkpointing recomputing it.
    # Non-reentrant checkpointing stores what the recomputation saves with
    # its own saved-tensor hooks (they replace the frontend's), so a saved
    # view of a parameter would point into engine memory that is reused once
    # the module is released. The recomputation therefore runs on copies of
    # the parameters (one module at a time; autograd keeps the saved ones
    # until their use in backward), and the views come back afterwards.

    def begin_recompute(self):
        """The parameters on copies of their views (on the engine's stream)."""
        self.recompute.append([p.data for p in self.params])
        for p in self.params:
            p.data = p.data.clone()

    def end_recompute(self):
        """The views back, if a recomputation of the group is in progress."""
        if self.recompute:
            for p, v in zip(self.params, self.recompute.pop()):
                p.data = v

    # ---- gradients -----------------------------------------------------------

    def take_gradient(self, i):
        """Parameter `i`'s gradient accumulator ran: its gradient is kept
        (``param.grad`` dropped) and, once all are there, handed over."""
        p = self.params[i]
        if p.grad is None:
            return
        # The accumulator runs once per backward graph: twice for a
        # parameter used both inside and outside a reentrant checkpoint.
        self.pending[i] = p.grad if i not in self.pending else self.pending[i] + p.grad
        p.grad = None
        if len(self.pending) == len(self.params):
            self.hand_over()

    def hand_over(self):
        """Gives the group's finished gradients (zeros where none came) to the engine."""
        self.release()
        f = self.frontend
        grads = f._engine.before_backward_grads(self.index)
        with f._on_stream():
            for i, cap in enumerate(grads):
                view = _dlpack.from_dlpack(cap)
                grad = self.pending.get(i)
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
        f._engine.after_backward(self.index)
        self.pending = {}
        self.in_backward = False
        if self.fwd_depth > 0:  # a forward of the group in progress
            self.hold()
        # Inside the group's backward (bwd_depth > 0) nothing needs the views
        # again: every node that used a parameter with a gradient ran before
        # its gradient was finished, and a saved view unpacked later (an op on
        # a detached parameter) fetches the group anew (SavedTensors.unpack).
