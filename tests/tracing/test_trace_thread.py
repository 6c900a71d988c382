"""A trace records only the tracing thread: another thread reading and writing the loss's
objects while a trace runs is native and leaves the trace as it would be without it."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
from torch import nn

from fxpasses import trace
from fxpasses.ir.trace_ops import ReadState, WriteAttribute


class Settings:
    def __init__(self):
        self.gain, self.k, self.note = 2.0, 3, "seen"
        self.ns = types.SimpleNamespace(w=0.5)  # a float the trace stands in for until it ends


class Loss(nn.Module):
    """Pauses in the middle of its call (``self.pause``) while the trace runs."""

    def __init__(self, pause):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.other = nn.Linear(2, 2), nn.Linear(2, 2)
        self.settings = Settings()
        self.pause = pause

    def forward(self, x):
        y = self.lin(x) * self.settings.gain * self.settings.ns.w
        self.pause()
        return y.sum() * self.settings.k


def _meanwhile(loss, seen):
    """Another thread's reads and writes of the loss's objects, on the trace's objects."""
    def work():
        s = loss.settings
        seen["gain"] = s.gain * 2  # a float read by the trace: a plain float here
        seen["note"], seen["absent"] = s.note, getattr(s, "missing", None)
        w = s.ns.w  # the trace's stand-in: computed with natively here
        seen["w"], seen["w-tensor"], seen["w-int"] = w * 4, torch.ones(2) * w, int(w * 4)
        seen["bias"] = loss.other.bias.detach().clone()  # a parameter the trace never reads
        s.written = 7  # written here, kept: the trace must neither record nor undo it
    def pause():
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    return pause


def _traced(loss, x):
    gm = trace(loss, (x,))
    info = gm.meta["fxpasses"]
    # the loss's own objects (the pause differs: a closure here, a lambda there)
    return gm, {(a.kind, str(a.source)) for a in info.assumptions
                if str(a.source).startswith("loss.") and str(a.source) != "loss.pause"}, [
        (n.op, type(n.target).__name__ if not isinstance(n.target, str) else n.target)
        for n in gm.graph.nodes]


def test_another_threads_reads_and_writes_during_a_trace_are_not_recorded():
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(1))
    _, alone, alone_nodes = _traced(Loss(lambda: None), x)
    seen: dict = {}
    loss = Loss(lambda: None)
    loss.pause = _meanwhile(loss, seen)
    gm, assumed, nodes = _traced(loss, x)
    assert assumed == alone and nodes == alone_nodes
    assert not [n for n in gm.graph.nodes if isinstance(n.target, (WriteAttribute, ReadState))
                and "other" in str(getattr(n.target, "name", n.target))]
    assert type(seen["gain"]) is float and seen["gain"] == 4.0
    assert seen["note"] == "seen" and seen["absent"] is None
    assert seen["w"] == 2.0 and seen["w-int"] == 2 and type(seen["w-tensor"]) is torch.Tensor
    torch.testing.assert_close(seen["w-tensor"], torch.full((2,), 0.5))
    assert loss.settings.written == 7  # native: kept after the trace (a module's attributes are
    # put back as the trace found them, another thread's writes included: README, limits)
    loss.pause = lambda: None
    out = gm.meta["fxpasses"].unflatten_output(gm(x))
    torch.testing.assert_close(out, loss(x))



class Scaled(nn.Module):
    """``(x * scale).sum()`` with a pause (``self.pause``) between its two ops."""

    def __init__(self, scale, pause):
        super().__init__()
        self.scale, self.pause = scale, pause

    def forward(self, x):
        y = x * self.scale
        self.pause()
        return torch.exp(y).sum()


def test_two_threads_tracing_at_once_each_get_their_own_graph():
    """A trace started on another thread while one runs waits for it: both graphs compute
    their own loss on new inputs. (Traces patch what the process shares; two at once saw each
    other's recorder, and the first baked its later values into its graph as constants.)"""
    second_asked, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()

    def first_pause():  # goes on once the second trace is inside its loss, or could not get there
        second_asked.wait(5)
        second_inside.wait(1)

    def second_pause():
        second_inside.set()
        first_done.wait(5)

    losses = {"first": Scaled(2.0, first_pause), "second": Scaled(3.0, second_pause)}
    graphs, errors = {}, []

    def run(name):
        try:
            if name == "second":
                second_asked.set()
            graphs[name] = trace(losses[name], (torch.ones(3),))
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            if name == "first":
                first_done.set()

    threads = [threading.Thread(target=run, args=(name,)) for name in losses]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    x = torch.tensor([0.5, -1.0, 2.0, 0.25])
    for name, loss in losses.items():
        loss.pause = lambda: None
        got = graphs[name](x)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, loss(x), rtol=0, atol=0, msg=name)


class Flow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def log_prob(self, x):
        return self.lin(x).sum(-1)


class Gains:
    def __init__(self):
        self.scale = 2.0


class FlowLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow = Flow()

    def forward(self, x, gains):
        return self.flow.log_prob(x).mean() * gains.scale


def test_a_trace_failing_before_the_loss_runs_leaves_nothing_patched(monkeypatch):
    """The trace's journal undoes what it set before the loss ran (the density method made one
    node, the attribute hooks of a tracked object's class), not only what it set while the loss
    ran. (The hooks of an argument's class had been undone only on leaving the loss's run: a
    trace failing before it left ``Gains.__getattribute__`` patched for the process.)"""
    trace_module = sys.modules["fxpasses.trace"]  # (the package's ``trace`` is the function)

    loss = FlowLoss()
    before = (dict(vars(loss.flow)), nn.Module.__getattribute__, nn.Module.__setattr__,
              dict(vars(Gains)), torch.zeros)

    def failing(*args, **kwargs):
        raise RuntimeError("failed before the loss ran")

    monkeypatch.setattr(trace_module, "_function_state", failing)
    with pytest.raises(trace_module.TraceFailure, match="failed before the loss ran"):
        trace(loss, (torch.ones(3, 2), Gains()))
    assert "log_prob" not in vars(loss.flow)  # patched on the instance by the trace, undone
    after = (dict(vars(loss.flow)), nn.Module.__getattribute__, nn.Module.__setattr__,
             dict(vars(Gains)), torch.zeros)
    assert after[0].keys() == before[0].keys() and after[1:] == before[1:]
    monkeypatch.undo()
    gains = Gains()
    gm = trace(loss, (torch.ones(3, 2), gains))  # and the next trace is whole
    x = torch.randn(4, 2)
    out = gm(*gm.meta["fxpasses"].signature.inputs([x, gains]))
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, loss(x, gains))
