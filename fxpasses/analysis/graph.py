"""A networkx view of a torch.fx graph, for reachability questions.

Nodes of the DiGraph are the ``fx.Node`` objects; an edge ``u -> v`` means ``v`` uses ``u``'s
value. torch.fx has no reachability query of its own; networkx has them all. Every node
downstream of some nodes is the one query read from the fx nodes' ``users`` directly
(:func:`downstream`): one walk, where a DiGraph is a build of the whole graph first.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx


def to_digraph(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for user in node.users:
            g.add_edge(node, user)
    return g


def dependent_pairs(g: nx.DiGraph, nodes: Iterable[fx.Node]) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` of ``nodes`` where ``b`` depends on ``a``'s value (a path a -> b).

    Merging nodes into one keeps the graph acyclic exactly when this list is empty.
    """
    found = []
    for a, b in combinations(list(nodes), 2):
        if nx.has_path(g, a, b):
            found.append((a.name, b.name))
        elif nx.has_path(g, b, a):
            found.append((b.name, a.name))
    return found


def downstream(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node that depends on any of ``nodes`` (the nodes themselves excluded unless one
    depends on another), read from their ``users``: no DiGraph is needed for it, and building
    one per query cost more than the walk."""
    return _reached(nodes, lambda node: node.users)


def upstream(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node any of ``nodes`` depends on (the nodes themselves excluded unless one depends
    on another), read from their inputs: :func:`downstream`'s walk the other way."""
    return _reached(nodes, lambda node: node.all_input_nodes)


def _reached(nodes: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    out: set[fx.Node] = set()
    stack = [n for node in nodes for n in step(node)]
    while stack:
        node = stack.pop()
        if node not in out:
            out.add(node)
            stack.extend(step(node))
    return out


def grad_modes(graph: fx.Graph) -> dict[fx.Node, bool]:
    """The grad mode each node runs in, following recorded ``_set_grad_enabled`` switches."""
    mode, modes = True, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            mode = bool(node.args[0])
        modes[node] = mode
    return modes
