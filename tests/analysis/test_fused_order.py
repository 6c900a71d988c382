"""The order a graph has once its regions are fused, replayed before fusing: a count read that the
fusion would move past its check point (the region computing its count also holds that point)
is made a barrier, so the read runs before the point."""

from __future__ import annotations

import operator
import threading

import pytest
import torch
import torch.fx as fx

from fxpasses.analysis.capture import plan_regions
from fxpasses.analysis.fused_order import fused_order, fused_places, late_reads
from fxpasses.analysis.fusion import fuse_region
from fxpasses.analysis.meta import annotate
from fxpasses.runtime.select import Capacities, CheckCounts, StartCounts


def _read_before_exp() -> fx.GraphModule:
    """``n = (x > 0).sum()`` read on the host before ``e = (3 x).exp()`` (its check point), then
    ``(e > 1).sum()`` read at the end (a next level's count, as in the Ultralytics criterion):
    the arithmetic and the counts are capturable, the reads are not."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    caps = [Capacities(f"capacity_{i}", "here", 4, 1) for i in range(2)]
    sizes = [graph.call_function(operator.getitem, (graph.call_function(c, ()), 0)) for c in caps]
    count = graph.call_function(torch.sum, (graph.call_function(torch.gt, (x, 0)),))
    scaled = graph.call_function(torch.mul, (x, 3.0))
    read = graph.call_function(CheckCounts("check_counts_0", [caps[0]], check_points=("exp",)),
                               (sizes[0], graph.call_function(StartCounts("start_counts_0"), (count,))))
    grown = graph.call_function(torch.exp, (scaled,))
    grown.name = "exp"
    above = graph.call_function(torch.sum, (graph.call_function(torch.gt, (grown, 1.0)),))
    later = graph.call_function(CheckCounts("check_counts_1", [caps[1]], check_points=("output",)),
                                (sizes[1], graph.call_function(StartCounts("start_counts_1"), (above,))))
    total = graph.call_function(torch.sum, (graph.call_function(torch.mul, (grown, 2.0)),))
    graph.output((total, graph.call_function(operator.getitem, (read, 0)),
                  graph.call_function(operator.getitem, (later, 0))))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate(gm, [torch.randn(8)])
    return gm


def test_a_read_the_fusion_would_move_past_its_check_point_becomes_a_barrier():
    gm = _read_before_exp()
    read = next(n for n in gm.graph.nodes if isinstance(n.target, CheckCounts))
    one_region = [[n for n in gm.graph.nodes if n.target in (torch.gt, torch.sum, torch.mul, torch.exp)]]
    moved = fused_order(gm.graph, one_region)
    assert late_reads(gm.graph, {n.name: i for n, i in moved.items()}) == {read}
    plan = plan_regions(gm, ("cpu",), min_region_ops=1, count_copies=False)
    assert plan.verdicts[read].barrier
    (counted,) = [{n.name for n in r} for r in plan.regions if "sum_1" in {n.name for n in r}]
    assert "exp" not in counted
    for index, nodes in enumerate(plan.regions):
        fuse_region(gm, nodes, f"r{index}")
    place = fused_places(gm)
    assert place["check_counts_0"] < place["exp"] and not late_reads(gm.graph, place)


def test_the_replayed_order_is_the_fused_graph_order():
    gm = _read_before_exp()
    calls = [n for n in gm.graph.nodes if n.target in (torch.gt, torch.sum, torch.mul, torch.exp)]
    regions = [calls[:3], calls[3:]]  # the first count; the rest
    names = {n: n.name for n in gm.graph.nodes}
    replayed = fused_order(gm.graph, regions)
    for name, nodes in zip(("r0", "r1"), regions):
        fuse_region(gm, nodes, name)
    place = fused_places(gm)
    assert all(replayed[n] == replayed[m] for region in regions for n in region for m in region)
    order = sorted(names, key=replayed.__getitem__)
    assert sorted(names.values(), key=place.__getitem__) == [names[n] for n in order]


def test_a_read_after_its_check_point_in_the_graph_order_is_an_error_not_a_loop():
    """No barrier helps a read its check point precedes in the graph itself (SelectRows never
    places one so): the planner says so instead of planning again for ever (it looped before)."""
    import threading

    import pytest

    graph = fx.Graph()
    x = graph.placeholder("x")
    cap = Capacities("capacity_0", "here", 4, 1)
    size = graph.call_function(operator.getitem, (graph.call_function(cap, ()), 0))
    early = graph.call_function(torch.exp, (graph.call_function(torch.mul, (x, 3.0)),))
    early.name = "exp"  # the count is computed from it: it precedes the read whatever the plan
    count = graph.call_function(torch.sum, (graph.call_function(torch.gt, (early, 1.0)),))
    read = graph.call_function(CheckCounts("check_counts_0", [cap], check_points=("exp",)),
                               (size, graph.call_function(StartCounts("start_counts_0"), (count,))))
    graph.output((graph.call_function(torch.sum, (early,)), graph.call_function(operator.getitem, (read, 0))))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate(gm, [torch.randn(8)])
    raised = []

    def plan() -> None:
        try:
            plan_regions(gm, ("cpu",), min_region_ops=1, count_copies=False)
        except ValueError as exc:
            raised.append(exc)

    worker = threading.Thread(target=plan, daemon=True)  # (a loop must fail the test, not hang it)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "plan_regions did not return"
    assert raised and "check_counts_0" in str(raised[0])
    with pytest.raises(ValueError, match="follow a check point"):
        plan_regions(gm, ("cpu",), min_region_ops=1, count_copies=False)
