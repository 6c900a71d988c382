"""A networkx view of a torch.fx graph, for reachability questions.

Nodes of the DiGraph are the ``fx.Node`` objects; an edge ``u -> v`` means ``v`` uses ``u``'s
value. torch.fx has no reachability query of its own; networkx has them all.
"""

from __future__ import annotations

from itertools import combinations
from typing import Iterable

import networkx as nx
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .meta import value
from .ops import node_facts, storage_id


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


def downstream(g: nx.DiGraph, nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node that depends on any of ``nodes`` (the nodes themselves excluded)."""
    out: set[fx.Node] = set()
    for node in nodes:
        out |= nx.descendants(g, node)
    return out


def grad_modes(graph: fx.Graph) -> dict[fx.Node, bool]:
    """The grad mode each node runs in, following recorded ``_set_grad_enabled`` switches."""
    mode, modes = True, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            mode = bool(node.args[0])
        modes[node] = mode
    return modes


def gradient_may_reach_output(node: fx.Node) -> bool:
    """Whether a gradient of the graph's outputs may flow back into ``node``'s value.

    False only when every path from ``node`` to the output passes through an op that stops
    gradients: ``detach``, an op run with gradients off (``torch.no_grad()``) that writes to no
    input, or a result that holds no floating tensor (a comparison, ``argmax``, an integer cast,
    ``.item()``). Anything the analysis cannot see through answers True: a node
    without complete shape-propagation facts, one that is not torch's own code (it may keep the
    value, e.g. as an attribute), one that writes to memory not made below ``node`` (the value may
    reach another tensor).
    """
    contained = _fresh_storages_below(node)
    modes = grad_modes(node.graph)
    stack, seen = list(node.users), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return True
        facts = node_facts(n)
        if facts is None or not facts.complete or not facts.torch_code:
            return True
        # an in-place op into memory that ``node`` or a computation below it made (whose views
        # and readers are all below ``node``, walked too) moves the value along this walk; a
        # write anywhere else may carry it away
        if facts.writes_input and not facts.writes <= contained:
            return True
        if not (modes[n] or facts.writes_input) or _stops_gradient(n, value(n)):
            continue
        stack.extend(n.users)
    return False


def _fresh_storages_below(node: fx.Node) -> set[int]:
    """Storages of ``node``'s value and of every value computed (a kernel ran, not a view) from
    it, transitively: memory that only ``node``'s descendants can reach."""
    found, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        facts, val = node_facts(n), n.meta.get("val")
        fresh = n is node or (facts is not None and facts.complete and facts.computes
                              and not facts.writes_input)
        if fresh and isinstance(val, torch.Tensor):
            found.add(storage_id(val))
        stack.extend(n.users)
    return found


def _stops_gradient(node: fx.Node, val: object) -> bool:
    """``node`` is a detach, or its known result holds no floating tensor (nor a symbolic number)."""
    if node.target in ("detach", torch.detach, torch.Tensor.detach):
        return True
    leaves = pytree.tree_leaves(val)
    known = val is not None and all(isinstance(t, (torch.Tensor, bool, int, float)) for t in leaves)
    return known and not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves)
