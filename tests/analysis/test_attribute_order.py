"""Attribute reads and writes of the loss's state: which may pass each other, and where regions
may span a write.

Two reads commute; a write conflicts with a read or write touching its name along a path of plain
lookups (an instance attribute, a module's parameter, buffer or submodule, a dict item); a write
through a setter, or a read through a property, touches every name. An attribute write runs
eagerly (Python, no kernel) and is no barrier to a region, unless fusing the region would move the
write past a read of its attribute (the write reads the region's value, so it follows the fused
call): then the planner makes it a barrier and plans again."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from fxpasses.analysis.capture import plan_regions
from fxpasses.analysis.fused_order import fused_order, moved_writes
from fxpasses.analysis.meta import annotate
from fxpasses.analysis.order import conflict
from fxpasses.ir.sources import Attr
from fxpasses.ir.trace_ops import ReadSource, ReadState, WriteAttribute


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.bs, self.topk = 2, 3
        self.register_buffer("strides", torch.ones(3))


class Guarded(Holder):
    """``bs`` behind a property whose setter also writes ``topk``."""

    @property
    def bs(self):
        return self._bs

    @bs.setter
    def bs(self, value):
        self._bs, self.topk = value, value + 1


def _graph(holder: nn.Module, read_name: str) -> tuple[fx.GraphModule, fx.Node, fx.Node]:
    """``a = x * 2``; ``holder.bs = a.sum()`` (a write of a region's value); a read of
    ``holder.<read_name>``; ``b = a.exp()`` (the region's last node); the output uses all."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    owner = graph.get_attr("holder")
    a = graph.call_function(torch.mul, (x, 2.0))
    total = graph.call_function(torch.sum, (a,))
    write = graph.call_function(WriteAttribute("write_bs", "bs"), (owner, total))
    read = graph.call_function(ReadSource(f"read_{read_name}", (Attr(read_name),), f"loss.{read_name}", root=holder), ())
    b = graph.call_function(torch.exp, (a,))
    graph.output((b, read))
    root = nn.Module()
    root.holder = holder
    gm = fx.GraphModule(root, graph)
    annotate(gm, [torch.randn(4)])
    return gm, write, read


def _node(gm: fx.GraphModule, op_id: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if getattr(n.target, "op_id", None) == op_id)


def test_two_reads_commute_and_a_write_conflicts_only_with_its_name():
    gm, write, read = _graph(Holder(), "bs")
    other = _graph(Holder(), "topk")[2]
    assert conflict(write, read) is not None
    assert conflict(write, other) is None
    assert conflict(read, other) is None


def test_a_setter_or_a_buffer_of_the_name_conflicts():
    gm, write, _ = _graph(Guarded(), "topk")
    assert conflict(write, _node(gm, "read_topk")) is not None  # the setter writes topk too
    graph = gm.graph
    with graph.inserting_after(write):
        state = graph.call_function(ReadState("read_state_bs", gm.holder, "bs"), ())
    assert conflict(_graph(Holder(), "topk")[1], state) is not None  # same name: a conflict


def test_a_write_fusion_would_move_past_a_read_of_its_name_becomes_a_barrier():
    gm, write, read = _graph(Holder(), "bs")
    whole = [[n for n in gm.graph.nodes if n.target in (torch.mul, torch.sum, torch.exp)]]
    place = {n.name: i for n, i in fused_order(gm.graph, whole).items()}
    assert moved_writes(gm.graph, place) == {write}  # the write follows the region, the read not
    plan = plan_regions(gm, ("cpu",), min_region_ops=1, count_copies=False)
    assert plan.verdicts[write].barrier and len(plan.regions) == 2


def test_a_write_no_read_of_its_name_follows_is_no_barrier():
    gm, write, _ = _graph(Holder(), "topk")
    plan = plan_regions(gm, ("cpu",), min_region_ops=1, count_copies=False)
    assert not plan.verdicts[write].barrier and plan.verdicts[write].code == "op-attribute-write"
    assert len(plan.regions) == 1  # the region spans the write
