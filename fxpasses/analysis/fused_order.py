"""The order a graph will have once CaptureLoss fuses its planned regions, and the count reads it
would put too late.

Fusing a region puts its call after the region's last node and then reorders the graph stably so
that every node follows its inputs (:mod:`.fusion`): a node that reads a region's value moves after
the call. A count read (:class:`~fxpasses.runtime.select.CheckCounts`) reads counts a region
computes, so it moves after that region; if the region also holds a node the read must precede
(SelectRows' check point: the first node that could show or suffer from a count that does not
fit, such as an index op on the gathered rows), that node would run on rows a count cut off before
the read abandons the call. :func:`late_reads` finds such reads in the order :func:`fused_order`
replays; the planner makes them barriers and plans again. Written by hand: torch.fx's
partitioners do not say where fused calls land.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch.fx as fx

from ..ir.trace_ops import ReadSource, ReadState, WriteAttribute
from ..runtime.select import CheckCounts
from .order import conflict, effects


def fused_order(graph: fx.Graph, regions: Sequence[list[fx.Node]]) -> dict[fx.Node, int]:
    """Each node's place in the graph once ``regions`` are fused in turn (a region's nodes: the
    place of its call)."""
    nodes = list(graph.nodes)
    unit: dict[fx.Node, object] = {n: n for n in nodes}
    seq: list[object] = list(nodes)
    for region in regions:
        call = object()
        members = set(region)
        anchor = seq.index(unit[region[-1]])
        seq = [u for u in seq[:anchor + 1] if u not in members] + [call] + \
            [u for u in seq[anchor + 1:] if u not in members]
        for member in region:
            unit[member] = call
        seq = _stable_topological(seq, nodes, unit)
    place = {u: i for i, u in enumerate(seq)}
    return {n: place[unit[n]] for n in nodes}


def _stable_topological(seq: list[object], nodes: list[fx.Node], unit: dict[fx.Node, object]) -> list[object]:
    """``seq`` reordered as :func:`~fxpasses.analysis.fusion.stable_topological_order` would."""
    index = {u: i for i, u in enumerate(seq)}
    inputs: dict[object, set[object]] = {u: set() for u in seq}
    for node in nodes:
        for arg in node.all_input_nodes:
            if unit[arg] is not unit[node]:
                inputs[unit[node]].add(unit[arg])
    users: dict[object, list[object]] = {u: [] for u in seq}
    for u, deps in inputs.items():
        for d in deps:
            users[d].append(u)
    waiting = {u: len(deps) for u, deps in inputs.items()}
    ready = [(index[u], i) for i, u in enumerate(seq) if waiting[u] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        u = seq[i]
        out.append(u)
        for user in users[u]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (index[user], index[user]))
    return out


def late_reads(graph: fx.Graph, place: dict[str, int]) -> set[fx.Node]:
    """The count reads of ``graph`` that ``place`` (a node's name -> where it runs: the order
    :func:`fused_order` replays, or a fused graph's, a region's nodes at its call) puts after one
    of their check points (the first node that could show or suffer from a count that does not
    fit): fusing moves a read after the region that computes its count, and that region may hold
    such a node."""
    return {n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, CheckCounts)
            and any(p in place and place[n.name] >= place[p] for p in n.target.check_points)}


def fused_places(gm: fx.GraphModule) -> dict[str, int]:
    """Where each node of a fused graph runs, by name: a region's nodes (those of the graph
    module it calls) at the region's call."""
    place = {}
    for i, node in enumerate(gm.graph.nodes):
        inner = gm.get_submodule(node.target) if node.op == "call_module" else \
            getattr(node.target, "fn", None) if node.op == "call_function" else None
        for member in getattr(getattr(inner, "graph", None), "nodes", ()):
            if member.op not in ("placeholder", "output"):
                place[member.name] = i
        place[node.name] = i
    return place


def moved_writes(graph: fx.Graph, place: dict[str, int]) -> set[fx.Node]:
    """The attribute writes of ``graph`` that ``place`` (as for :func:`late_reads`) puts on the
    other side of a read or write of an attribute they may touch (:func:`~.order.conflict`): a
    write that reads a region's value moves after the region's call, past such a node that
    stayed where it was."""
    touching = [(n, effects(n)) for n in graph.nodes if n.op == "call_function"
                and isinstance(n.target, (ReadSource, ReadState, WriteAttribute))]  # effects read once
    found = set()
    for i, (a, of_a) in enumerate(touching):
        for b, of_b in touching[i + 1:]:
            if place[a.name] >= place[b.name] and conflict(of_a, of_b):  # (two reads never conflict)
                found |= {n for n in (a, b) if isinstance(n.target, WriteAttribute)}
    return found
