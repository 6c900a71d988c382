"""fxpasses.analysis.gradients: whether a gradient of the outputs reaches a node (yes, no, undecided)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpasses.analysis.gradients import gradient_reach
from fxpasses.analysis.meta import annotate
from fxpasses.trace import LeafPolicy, trace


def identity(x):
    """Declared a leaf function: opaque to the analysis."""
    return x


def _reach(loss, *, leaves=(), leaf_modules=(), module=None):
    """The answer for the graph's ``tanh`` node (the one value every loss below starts from)."""
    x = torch.randn(4, 2, requires_grad=True)
    gm = trace(module or loss, (x,), policy=LeafPolicy(leaf_functions=tuple(leaves),
                                                     leaf_modules=tuple(leaf_modules)))
    annotate(gm, [x])
    (start,) = [n for n in gm.graph.nodes if n.target in (torch.tanh, "tanh")]
    return gm, gradient_reach(start)


def _used(x):
    return torch.tanh(x).sum()


def _detached(x):
    return x.sum(), torch.tanh(x).detach()


def _compared(x):
    return x.sum(), (torch.tanh(x) > 0).double().sum()


def _read_without_grad(x):
    y = torch.tanh(x)
    with torch.no_grad():
        t = y * 2
    return x.sum() + t.sum()


def _one_path_used(x):
    y = torch.tanh(x)
    return y.sum(), identity(y).detach()


@pytest.mark.parametrize("loss, expected", [(_used, True), (_detached, False), (_compared, False),
                                            (_read_without_grad, False), (_one_path_used, True)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_torch_ops_decide(loss, expected):
    _, reach = _reach(loss, leaves=[identity])
    assert reach.reaches is expected and reach.undecided == ()


def test_a_leaf_then_detach_is_looked_through():
    gm, reach = _reach(lambda x: (x.sum(), identity(torch.tanh(x)).detach()), leaves=[identity])
    (leaf,) = [n.name for n in gm.graph.nodes if n.target is identity]
    assert reach.reaches is False and reach.through == (leaf,) and reach.undecided == ()


def test_an_output_reached_only_through_a_leaf_is_undecided():
    """The leaf's result may or may not carry a gradient (it might detach inside)."""
    gm, reach = _reach(lambda x: (x.sum(), identity(torch.tanh(x)).sum()), leaves=[identity])
    (leaf,) = [n.name for n in gm.graph.nodes if n.target is identity]
    assert reach.reaches is None and reach.undecided == (leaf,)


def test_a_write_into_other_memory_is_undecided():
    def loss(x):
        y = torch.tanh(x)
        z = x.detach().clone()
        z[:1] = y[:1]  # y's value moves into memory it did not make
        return x.sum(), z.detach()

    _, reach = _reach(loss)
    assert reach.reaches is None and len(reach.undecided) == 1


def test_a_written_tensor_that_reaches_an_output_decides():
    """``buffer[mask] = value``, then the buffer summed: a gradient reaches ``value``."""
    def loss(x):
        y = torch.tanh(x)
        z = x.detach().clone()
        z[:1] = y[:1]
        return z.sum()

    _, reach = _reach(loss)
    assert reach.reaches is True


def test_a_write_into_other_memory_without_gradients_stops():
    def loss(x):
        y = torch.tanh(x)
        z = x.detach().clone()
        with torch.no_grad():
            z[:1] = y[:1]
        return x.sum() + z.sum()

    _, reach = _reach(loss)
    assert reach.reaches is False


def test_an_in_place_write_into_memory_made_below_is_followed():
    def loss(x):
        y = torch.tanh(x) * 1
        y.add_(1)
        return x.sum(), y.detach()

    _, reach = _reach(loss)
    assert reach.reaches is False


class Counting(nn.Module):
    """A leaf module that writes the loss's Python state on each call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.detach()


class CountingLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = Counting()

    def forward(self, x):
        return x.sum(), self.counter(torch.tanh(x)).detach()


def test_kept_whole_code_that_writes_state_is_undecided():
    """It may keep the value (here it keeps a count): the walk cannot follow it."""
    gm, reach = _reach(None, module=CountingLoss(), leaf_modules=[Counting])
    (leaf,) = [n.name for n in gm.graph.nodes if n.op == "call_module"]
    assert reach.reaches is None and reach.undecided == (leaf,)
