"""Nodes after a count read that need neither its counts nor anything computed from them move to
just before it; what needs the counts, a check point, an input write, a random draw and a
write of memory a staying node reads stay after it; values are unchanged."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from fxpasses.analysis.meta import annotate
from fxpasses.passes.overlap_reads import overlap_reads
from fxpasses.runtime.select import Capacities, CheckCounts, StartCounts


def _read(graph: fx.Graph, a: fx.Node, check_points: tuple[str, ...] = ()) -> fx.Node:
    """``check_counts_0``: the read of ``a.sum()`` against a capacity of 4."""
    capacity = Capacities("capacity_a", "a.py:1", 4, 1)
    size = graph.call_function(operator.getitem, (graph.call_function(capacity, ()), 0))
    start = graph.call_function(StartCounts("start_counts_0"), (graph.call_function(torch.sum, (a,)),))
    return graph.call_function(CheckCounts("check_counts_0", [capacity], check_points=check_points),
                               (size, start))


def _graph(check_points: tuple[str, ...] = ()) -> fx.GraphModule:
    """``n = read(a.sum())``, then: ``x = b * 2`` (free), ``y = x + n`` (needs the count),
    ``z = x.cos()`` (free, after y), ``w.add_(1)`` (an input write), ``buf = zeros;
    buf.add_(x)`` (free, a local write), ``held = zeros; u = held * n`` (needs the count) then
    ``held.add_(x)`` (a write of memory ``u``, which stays, read), ``r = torch.rand(3)``."""
    graph = fx.Graph()
    a, b, w = (graph.placeholder(name) for name in "abw")
    read = _read(graph, a, check_points)
    n = graph.call_function(operator.getitem, (read, 0))
    nodes = {}
    nodes["x"] = graph.call_function(torch.mul, (b, 2))
    nodes["y"] = graph.call_function(torch.add, (nodes["x"], n))
    nodes["z"] = graph.call_function(torch.cos, (nodes["x"],))
    nodes["w_write"] = graph.call_method("add_", (w, 1))
    nodes["buf"] = graph.call_function(torch.zeros, (3,))
    nodes["buf_write"] = graph.call_method("add_", (nodes["buf"], nodes["x"]))
    nodes["held"] = graph.call_function(torch.zeros, (3,))
    nodes["u"] = graph.call_function(torch.mul, (nodes["held"], n))
    nodes["held_write"] = graph.call_method("add_", (nodes["held"], nodes["x"]))
    nodes["r"] = graph.call_function(torch.rand, (3,))
    for name, node in nodes.items():
        node.name = name  # (names the check points use)
    graph.output((n, nodes["y"], nodes["z"], nodes["r"], nodes["buf"], nodes["u"], nodes["held"]))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert annotate(gm, [torch.ones(3, dtype=torch.int64), torch.randn(3), torch.zeros(3)]) == []
    return gm


def _after_read(gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    names = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    cut = names.index("check_counts_0")
    return names[:cut], names[cut + 1:]


def _run(gm: fx.GraphModule) -> list:
    torch.manual_seed(0)
    return list(gm(torch.ones(3, dtype=torch.int64), torch.arange(3.0), torch.zeros(3)))


def test_free_nodes_move_before_the_read_and_the_rest_stay():
    gm = _graph()
    want = _run(gm)
    (cert,) = overlap_reads(gm, "CaptureLoss")
    gm.graph.lint()
    gm.recompile()
    before, after = _after_read(gm)
    assert before[-5:] == ["x", "z", "buf", "buf_write", "held"]  # in their order, after the start
    assert before.index("start_counts_0") < before.index("x")
    assert after == ["getitem_1", "y", "w_write", "u", "held_write", "r"]
    assert cert.applied and cert.checks[0].evidence["moved"] == 5
    stayed = dict(cert.checks[0].evidence["stayed"])
    # the random draw stays: as a node torch marks impure (effects unknown), or as a draw
    assert stayed.pop("effects unknown", 0) + stayed.pop("draws random numbers", 0) == 1
    assert stayed == {"needs the read or a node that stays": 3, "writes memory the loss did not make": 1,
                      "conflicts with a node it passes": 1}
    for got, expected in zip(_run(gm), want, strict=True):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(expected))


def test_nothing_moves_past_a_grad_mode_switch():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    read = _read(graph, a)
    free = graph.call_function(torch.mul, (b, 2))  # before the switch: moves
    graph.call_function(torch._C._set_grad_enabled, (False,))
    off = graph.call_function(torch.mul, (b, 3))  # runs without gradients: stays after the switch
    graph.call_function(torch._C._set_grad_enabled, (True,))
    graph.output((graph.call_function(operator.getitem, (read, 0)), free, off))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate(gm, [torch.ones(3, dtype=torch.int64), torch.randn(3, requires_grad=True)])
    (cert,) = overlap_reads(gm, "CaptureLoss")
    gm.recompile()
    before, after = _after_read(gm)
    assert before[-1] == "mul" and after[:2] == ["_set_grad_enabled", "mul_1"]
    assert cert.checks[0].evidence["moved"] == 1 and cert.checks[0].evidence["window"] == 1
    _, moved, kept = gm(torch.ones(3, dtype=torch.int64), torch.randn(3, requires_grad=True))
    assert moved.requires_grad and not kept.requires_grad


def test_a_check_point_stays_after_the_read():
    gm = _graph(check_points=("z",))
    overlap_reads(gm, "CaptureLoss")
    before, after = _after_read(gm)
    assert "z" in after and "x" in before


def test_a_read_with_nothing_free_after_it_is_refused():
    graph = fx.Graph()
    a = graph.placeholder("a")
    read = _read(graph, a)
    graph.output(graph.call_function(torch.mul, (a, graph.call_function(operator.getitem, (read, 0)))))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate(gm, [torch.ones(3, dtype=torch.int64)])
    (cert,) = overlap_reads(gm, "CaptureLoss")
    assert not cert.applied and cert.codes == ("read-overlap-none",)


def test_no_read_or_nothing_after_it_no_certificate():
    assert overlap_reads(fx.symbolic_trace(lambda x: x * 2), "CaptureLoss") == []
    graph = fx.Graph()
    a = graph.placeholder("a")
    graph.output(_read(graph, a))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate(gm, [torch.ones(3, dtype=torch.int64)])
    assert overlap_reads(gm, "CaptureLoss") == []


def test_an_attribute_write_moved_before_a_read_that_abandons_is_undone():
    """The write now runs before the read; the read abandons (a count over its capacity): the
    abandoned call's writes are put back, as the native run that follows must find them."""
    from types import SimpleNamespace

    from fxpasses.ir.abandon import Abandon
    from fxpasses.ir.trace_ops import WriteAttribute, undone_on_failure

    graph = fx.Graph()
    a, b, owner = (graph.placeholder(name) for name in ("a", "b", "owner"))
    read = _read(graph, a)
    graph.call_function(WriteAttribute("write_scale", "scale"), (owner, graph.call_function(torch.mul, (b, 2))))
    graph.output(graph.call_function(operator.getitem, (read, 0)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    state = SimpleNamespace(scale="before")
    annotate(gm, [torch.ones(3, dtype=torch.int64), torch.randn(3), state])
    (cert,) = overlap_reads(gm, "CaptureLoss")
    gm.recompile()
    before, _ = _after_read(gm)
    assert cert.checks[0].evidence["moved"] == 2 and before[-1] == "write_scale"
    with pytest.raises(Abandon), undone_on_failure():
        gm(torch.ones(9, dtype=torch.int64), torch.randn(3), state)  # 9 rows, capacity 4
    assert state.scale == "before"
    assert gm(torch.ones(3, dtype=torch.int64), torch.arange(3.0), state) == 3
    assert torch.equal(state.scale, torch.arange(3.0) * 2)
