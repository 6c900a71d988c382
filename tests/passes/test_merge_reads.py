"""Two count reads whose counts are all ready at the first become one read (one wait), with the
results each read gave; a read whose count needs the first read's result stays apart."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from fxpasses.ir.abandon import Abandon
from fxpasses.passes.merge_reads import merge_reads
from fxpasses.runtime.select import Capacities, CheckCounts, StartCounts


def _two_reads(second_needs_first: bool, late_capacity: bool = False
               ) -> tuple[fx.GraphModule, Capacities, Capacities]:
    """``a.sum()`` read against capacity A, then ``b.sum()`` (or ``b.sum() * n_a``) against B
    (``late_capacity``: B's value taken apart after the first read)."""
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    cap_a, cap_b = Capacities("capacity_a", "a.py:1", 4, 1), Capacities("capacity_b", "b.py:2", 4, 2)
    planned = [graph.call_function(c, ()) for c in (cap_a, cap_b)]
    sizes = [graph.call_function(operator.getitem, (planned[0], 0))]
    if not late_capacity:
        sizes.append(graph.call_function(operator.getitem, (planned[1], 0)))
    count_a = graph.call_function(torch.sum, (a,))
    count_b = None if second_needs_first else graph.call_function(torch.sum, (b,))
    read_a = graph.call_function(CheckCounts("check_counts_0", [cap_a]),
                                 (sizes[0], graph.call_function(StartCounts("start_counts_0"), (count_a,))))
    n_a = graph.call_function(operator.getitem, (read_a, 0))
    if late_capacity:
        sizes.append(graph.call_function(operator.getitem, (planned[1], 0)))
    if second_needs_first:
        count_b = graph.call_function(torch.mul, (graph.call_function(torch.sum, (b,)), n_a))
    read_b = graph.call_function(CheckCounts("check_counts_1", [cap_b]),
                                 (sizes[1], graph.call_function(StartCounts("start_counts_1"), (count_b,))))
    graph.output((n_a, graph.call_function(operator.getitem, (read_b, 0))))
    return fx.GraphModule(torch.nn.Module(), graph), cap_a, cap_b


def _reads(gm: fx.GraphModule) -> list[str]:
    return [n.target.op_id for n in gm.graph.nodes if isinstance(n.target, CheckCounts)]


@pytest.mark.parametrize("late_capacity", [False, True])
def test_reads_whose_counts_are_ready_become_one(late_capacity):
    gm, _, cap_b = _two_reads(second_needs_first=False, late_capacity=late_capacity)
    a, b = torch.tensor([1, 1, 0]), torch.tensor([1, 1, 1])
    want = gm(a, b)
    (cert,) = merge_reads(gm, "CaptureLoss")
    gm.graph.lint()
    gm.recompile()
    assert _reads(gm) == ["check_counts_0_1"] and cert.applied
    assert gm(a, b) == want == (2, 3)
    with pytest.raises(Abandon) as raised:  # the second read's count over its capacity: grown
        gm(a, torch.ones(6, dtype=torch.int64))
    assert raised.value.code == "selection-capacity" and raised.value.retry
    assert cap_b.value == 32  # the bucket of 4 x 6
    with pytest.raises(Abandon) as raised:  # an empty selection of the first read
        gm(torch.zeros(3, dtype=torch.int64), b)
    assert raised.value.code == "selection-empty"


def test_a_read_whose_count_needs_the_first_read_stays_apart():
    gm, _, _ = _two_reads(second_needs_first=True)
    assert merge_reads(gm, "CaptureLoss") == []
    assert _reads(gm) == ["check_counts_0", "check_counts_1"]
