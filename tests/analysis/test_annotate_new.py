"""annotate_new: a node run again whose metadata is unchanged keeps it (its users are not run
again), and a change of sizes or of aliasing is still seen downstream."""

from __future__ import annotations

import operator

import torch
from torch import nn

from fxpasses import trace
from fxpasses.analysis.meta import annotate, annotate_new, storages_of, value


class Chain(nn.Module):
    def forward(self, x):
        y = x * 2
        v = y.view(-1)
        return (v.sum(0) + 1, y.sum(1))


def _annotated():
    x = torch.randn(4, 3)
    gm = trace(Chain(), (x,))
    assert annotate(gm, [x]) == []
    nodes = {n.name: n for n in gm.graph.nodes}
    return gm, nodes


def _rewire_mul(gm, nodes, make_input):
    """``y = x * 2`` computed from ``make_input(x)`` instead (a node a pass inserts)."""
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul]
    x = mul.args[0]
    with gm.graph.inserting_before(mul):
        replacement = make_input(gm.graph, x)
    mul.args = (replacement, *mul.args[1:])
    gm.recompile()
    return mul


def test_a_node_with_the_same_metadata_keeps_it_and_its_users_are_not_run_again():
    gm, nodes = _annotated()
    before = {name: value(n) for name, n in nodes.items()}
    mul = _rewire_mul(gm, nodes, lambda g, x: g.call_function(operator.add, (x, 0.5)))
    assert annotate_new(gm) == []
    assert value(mul) is before[mul.name]  # run again, the same allocation: kept
    assert all(value(u) is before[u.name] for u in mul.users)


def test_a_change_of_sizes_is_seen_downstream():
    gm, nodes = _annotated()
    mul = _rewire_mul(gm, nodes, lambda g, x: g.call_method("repeat", (x, 2, 1)))
    assert annotate_new(gm) == []
    assert tuple(value(mul).shape) == (8, 3)
    sums = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "sum"]
    assert sorted(tuple(value(n).shape) for n in sums) == [(), (8,)]


def test_a_view_of_a_new_allocation_is_seen_as_its_view():
    gm, nodes = _annotated()
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul]
    (view,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    with gm.graph.inserting_before(view):
        other = gm.graph.call_function(operator.mul, (mul.args[0], 3))
    view.args = (other, *view.args[1:])  # the same sizes, other memory
    gm.recompile()
    assert annotate_new(gm) == []
    assert storages_of(view) == storages_of(other) and not storages_of(view) & storages_of(mul)


def test_a_view_turned_into_a_copy_holds_memory_of_its_own():
    gm, nodes = _annotated()
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul]
    (view,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    with gm.graph.inserting_before(view):
        transposed = gm.graph.call_method("t", (mul,))
    view.target, view.args = "reshape", (transposed, -1)  # (12,) as before, but copied
    gm.recompile()
    assert annotate_new(gm) == []
    assert tuple(value(view).shape) == (12,) and not storages_of(view) & storages_of(mul)


class UnsqueezedInPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        y.unsqueeze_(0)  # changes y's sizes in place
        return y.sum(1) + 1


def test_a_node_whose_sizes_a_user_changes_in_place_is_not_kept():
    x = torch.randn(4, 3)
    gm = trace(UnsqueezedInPlace(), (x,))
    assert annotate(gm, [x]) == []
    mul = _rewire_mul(gm, {}, lambda g, x: g.call_function(operator.add, (x, 0.5)))
    (unsqueeze,) = [n for n in gm.graph.nodes if n.target == "unsqueeze_"]
    with gm.graph.inserting_before(unsqueeze):  # its dim now computed: it is run again
        dim = gm.graph.call_function(operator.floordiv, (unsqueeze.args[1], 2))
    unsqueeze.args = (unsqueeze.args[0], dim)
    gm.recompile()
    assert annotate_new(gm) == []
    assert tuple(value(mul).shape) == (4, 3)  # as it was made, before the user's unsqueeze_
    assert tuple(value(unsqueeze).shape) == (1, 4, 3)
