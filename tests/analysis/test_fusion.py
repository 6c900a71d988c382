"""fxpasses.analysis.fusion: a fused region keeps every other node's order, switches included."""

import operator

import torch
import torch.fx as fx

from fxpasses.analysis.fusion import fuse_region, stable_topological_order


def _graph():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.exp, (x,))             # region
    side = g.call_function(torch.neg, (a,))           # between region nodes, uses a region value
    off = g.call_function(torch._C._set_grad_enabled, (False,))  # no data edge: must not move
    b = g.call_function(torch.tanh, (a,))             # region
    on = g.call_function(torch._C._set_grad_enabled, (True,))
    c = g.call_function(operator.add, (b, side))
    g.output(c)
    return fx.GraphModule(torch.nn.Module(), g), a, b, side, off, on


def test_the_call_replaces_the_region_and_users_between_follow_it():
    gm, a, b, side, off, on = _graph()
    call = fuse_region(gm, [a, b], "region_0")
    order = list(gm.graph.nodes)
    assert call in order and a not in order and b not in order
    assert order.index(call) < order.index(side)  # side used a: now after the call
    assert order.index(off) < order.index(on)  # the switches keep their order
    gm.graph.lint()
    gm.recompile()
    x = torch.randn(3)
    torch._C._set_grad_enabled(True)
    assert torch.allclose(gm(x), x.exp().tanh() - x.exp())


def test_stable_order_changes_nothing_that_is_already_ordered():
    gm, *_ = _graph()
    before = list(gm.graph.nodes)
    stable_topological_order(gm.graph)
    assert list(gm.graph.nodes) == before
