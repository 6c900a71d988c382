"""Fusing a convex region of a graph into one call, keeping every other node's order.

torch.fx lifts the region's nodes into a GraphModule (``fuse_as_graphmodule``); the call that
replaces them is inserted where the region's last node was, and any node that used a region value
before that point is moved after the call by a *stable* topological order: nodes keep their
relative order wherever data allows. (torch's own ``fuse_by_partitions`` re-sorts the whole graph
with a sort that is not stable in several torch versions; that could move a grad-mode switch or an
in-place op, which carry no data edge. So the insertion and the order are written by hand here.)
"""

from __future__ import annotations

import heapq
import operator

import torch.fx as fx
from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule


def fuse_region(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> fx.Node:
    """Replace ``nodes`` (convex, in graph order) by ``call_module(name)``; returns that node."""
    sub_gm, inputs, outputs = fuse_as_graphmodule(gm, nodes, name)
    gm.add_submodule(name, sub_gm)
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    returned = next(n for n in sub_gm.graph.nodes if n.op == "output").args[0]
    if isinstance(returned, tuple):
        anchor = call
        for i, out in enumerate(outputs):
            with gm.graph.inserting_after(anchor):
                anchor = gm.graph.call_function(operator.getitem, (call, i))
            anchor.meta = dict(out.meta)
            out.replace_all_uses_with(anchor)
    elif outputs:
        call.meta = dict(outputs[0].meta)
        outputs[0].replace_all_uses_with(call)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    stable_topological_order(gm.graph)
    return call


def stable_topological_order(graph: fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, changing the given order least:
    among the nodes whose inputs are placed, the earliest in the current order goes next."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in graph.nodes}
    ready = [(order[n], n) for n in graph.nodes if waiting[n] == 0]
    heapq.heapify(ready)
    placed: list[fx.Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        placed.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (order[user], user))
    if len(placed) != len(order):
        raise ValueError("the graph has a cycle: a fused region was not convex")
    for previous, node in zip(placed, placed[1:]):
        if previous.next is not node:
            previous.append(node)
