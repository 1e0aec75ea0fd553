"""The frontend's stream ordering, on the host device, with a stand-in for torch.cuda's streams.

On a GPU the engine's compute stream is a `torch.cuda.ExternalStream`; the
frontend runs forward, backward and the gradient hand-over on it, ordered
after the caller's current stream (its inputs) and before the caller's later
work (what it reads). None of that runs without a GPU, so here a recording
stand-in replaces `torch.cuda.current_stream`, `torch.cuda.stream` and the
engine's stream object, and the order of the frontend's stream operations is
checked: the engine's stream waits for the caller's before a forward or a
backward runs on it, every engine call inside runs with the engine's stream
current, and the caller's stream waits for the engine's afterwards.
test_cuda_frontend.py checks the same on a GPU through the results.
"""

import contextlib

import torch

import strata
from test_torch_frontend import GPT, batches, config


class FakeStream:
    def __init__(self, name, log):
        self.name = name
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


class RecordingEngine:
    """The extension's engine, recording which stream is current at each call."""

    CALLS = ("before_forward", "after_forward", "before_backward", "before_backward_grads",
             "after_backward")

    def __init__(self, engine, log, current):
        self._e = engine
        self._log = log
        self._current = current

    def __getattr__(self, name):
        attr = getattr(self._e, name)
        if name not in self.CALLS:
            return attr

        def call(*args, **kwargs):
            self._log.append((name, self._current[-1].name))
            return attr(*args, **kwargs)

        return call


def test_forward_backward_and_hand_over_are_ordered_on_the_engines_stream(monkeypatch):
    torch.manual_seed(4)
    engine = strata.initialize(GPT(), config("cpu", "cpu"))
    log = []
    caller, ours = FakeStream("caller", log), FakeStream("engine", log)
    current = [caller]

    @contextlib.contextmanager
    def use(stream):
        log.append(("enter", stream.name))
        current.append(stream)
        try:
            yield
        finally:
            current.pop()
            log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", use)
    engine._stream = ours
    engine._engine = RecordingEngine(engine._engine, log, current)

    idx, tgt = batches(1)[0]
    loss = engine(idx, tgt)
    forward = list(log)
    log.clear()
    engine.backward(loss)
    backward = list(log)
    engine.step()

    for phase, events in (("forward", forward), ("backward", backward)):
        # Ordered after the caller's work, run on the engine's stream, the
        # caller ordered after it.
        assert events[:2] == [("wait", "engine", "caller"), ("enter", "engine")], (phase, events)
        assert events[-2:] == [("exit", "engine"), ("wait", "caller", "engine")], (phase, events)
        calls = [e for e in events if e[0] in RecordingEngine.CALLS]
        assert calls, phase
        assert all(stream == "engine" for _, stream in calls), (phase, calls)
    assert any(e[0] == "before_forward" for e in forward)
    assert any(e[0] == "before_backward_grads" for e in backward)  # the hand-over
    # The gradient copies of the hand-over run inside an engine-stream block.
    depth, inside = 0, []
    for e in backward:
        if e[0] == "enter":
            depth += 1
        elif e[0] == "exit":
            depth -= 1
        elif e[0] == "before_backward_grads":
            inside.append(depth)
    assert inside and all(d >= 1 for d in inside)
    engine._engine = engine._engine._e
    engine._stream = None
    engine.close()
