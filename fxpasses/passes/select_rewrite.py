"""The graph surgery of SelectRows: selections become gathers into a static capacity.

For one level (the spaces whose masks are available together; see
:mod:`fxpasses.analysis.selection`):

    count  = m.sum()                                   # on the device
    C, n   = ReadCounts(count, ...)                    # ONE host read for the level
    idx    = nonzero_static(m.flatten(), size=C, fill_value=-1).squeeze(-1)
    idx    = where(idx >= 0, idx, idx.max())           # padding copies the last real row
    x[m]  ==>  x.flatten(0, m.dim() - 1).index_select(0, idx)      # (C, ...): real rows first
    sum(v) ==> sum(v.masked_fill(~valid, 0))           # valid = arange(C) < count
    mean(v) ==> sum(v.masked_fill(~valid, 0)) / (count * elements per row)
    loss(a, b, reduction=r) ==> reduce_r(loss(a, b, reduction="none").masked_fill(~valid, 0))
    y[m2]  ==>  y[m2 & valid]                          # a child never selects padding rows
    out    ==>  out.narrow(row_dim, 0, n)              # rows handed to the caller

``masked_fill``, not a product: a padding row's value is a real row's, finite where that row's
is, but ``0 * inf`` would be NaN. The read comes where the last mask of the level is computed;
selections placed earlier move after it with everything that depends on them, when the nodes
moved and jumped over do not conflict and keep their grad mode (as PairCalls checks its reordering);
otherwise each space reads its own count.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..analysis.graph import downstream, grad_modes, to_digraph
from ..analysis.meta import value
from ..analysis.order import conflict
from ..analysis.selection import SpaceAnalysis
from ..facts import BucketedSizes, prove
from ..locations import node_location
from ..runtime.select import ReadCounts


@dataclass
class Rewritten:
    """What the rewrite of a level did, for its certificates."""

    reads: list[str] = field(default_factory=list)  # ReadCounts node names
    grouped: bool = False
    placement: dict = field(default_factory=dict)  # evidence of the grouping decision


def rewrite_level(gm: fx.GraphModule, analyses: list[SpaceAnalysis], level_id: str,
                  min_bucket: int, masks: dict[str, fx.Node], proof: str, *,
                  group: bool = True, slice_exits: bool = False,
                  analysed: frozenset[str] = frozenset()) -> Rewritten:
    """Rewrite the spaces of one level in ``gm`` (see the module docstring).

    ``masks``: mask nodes by mask name (a child's mask is the and-node its parent made; updated
    here for this level's children). ``proof``: the certificate id cited by the bucket fact.
    ``slice_exits``: slice every value whose rows leave (for the witness, whose outputs are
    those values) instead of the graph outputs only. ``analysed``: names of the nodes of every
    region the row walk proved free of writes (this level's are added).
    """
    graph = gm.graph
    named = {n.name: n for n in graph.nodes}
    spaces = [(a, masks[a.space.mask] if a.space.mask in masks else named[a.space.mask])
              for a in analyses]
    counts = []
    for a, mask in spaces:
        with graph.inserting_after(mask):
            counts.append(_made(graph.call_function(torch.sum, (mask,)), mask))
    result = Rewritten()
    sites = [named[s] for a, _ in spaces for s in a.space.sites]
    names = analysed | {n for a, _ in spaces for n in a.region}
    analysed_nodes = {named[n] for n in names if n in named}
    anchor, moved = _placement(graph, sites, counts, group, analysed_nodes, result.placement)
    result.grouped = anchor is not None and len(spaces) > 1
    groups = [list(range(len(spaces)))] if anchor is not None else [[i] for i in range(len(spaces))]
    for number, members in enumerate(groups):
        order = _order(graph)
        read_after = max((counts[i] for i in members), key=order.__getitem__)
        if len(members) > 1 and order[anchor] > order[read_after]:
            # the counts end the block before the grad-mode switch back to the moved nodes'
            # mode, the read and the level's new nodes follow it, with the moved nodes
            for count in sorted((counts[i] for i in members), key=order.__getitem__):
                anchor.prepend(count)
            read_after = anchor
        where = [node_location(named[spaces[i][0].space.sites[0]]) or spaces[i][0].space.mask
                 for i in members]
        op = ReadCounts(f"read_counts_{level_id}_{number}", where, min_bucket)
        with graph.inserting_after(read_after):
            read = _made(graph.call_function(op, tuple(counts[i] for i in members)),
                         counts[members[-1]])
        prove(read, BucketedSizes(proof, len(members)))
        result.reads.append(read.name)
        parts, cursor = [], read
        for k in range(2 * len(members)):  # the buckets, then the counts
            with graph.inserting_after(cursor):
                cursor = _made(graph.call_function(operator.getitem, (read, k)), read)
            parts.append(cursor)
        if moved:  # the level's selections and what depends on them follow the read
            _move(graph, moved, cursor, anchor)
        for k, i in enumerate(members):
            analysis, mask = spaces[i]
            cursor = _space(gm, analysis, mask, counts[i], parts[k], parts[len(members) + k],
                            cursor, masks, slice_exits)
    return result


MADE = "fxpasses.select.made"  # node.meta key: made by this rewrite (pure by construction)


def _made(node: fx.Node, like: fx.Node) -> fx.Node:
    """A new node of the rewrite, reporting the user's line of ``like``."""
    if "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    node.meta[MADE] = True
    return node


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _space(gm: fx.GraphModule, analysis: SpaceAnalysis, mask: fx.Node, count: fx.Node,
           capacity: fx.Node, host_count: fx.Node, cursor: fx.Node, masks: dict[str, fx.Node],
           slice_exits: bool) -> fx.Node:
    """Index, validity and every rewrite of one space; returns the last node placed at ``cursor``."""
    graph = gm.graph
    named = {n.name: n for n in graph.nodes}

    def add(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = _made(graph.call_function(target, args, kwargs), mask)
        return cursor

    dims = analysis.space.rank
    flat = add(torch.flatten, mask) if dims > 1 else mask
    found = add(torch.squeeze, add(torch.nonzero_static, flat, size=capacity, fill_value=-1), -1)
    index = add(torch.where, add(operator.ge, found, 0), found, add(torch.amax, found))
    positions = add(torch.arange, capacity, device=add(getattr, mask, "device"))
    valid = add(operator.lt, positions, count)
    invalid = add(operator.invert, valid)
    ranks = {name: value(named[name]).dim() for name, _ in analysis.child_masks}  # before rewriting
    for name in analysis.space.sites:  # x[m] ==> x.flatten(0, m.dim() - 1).index_select(0, idx)
        site = named[name]
        source = site.args[0]
        with graph.inserting_before(site):
            rows = _made(graph.call_function(torch.flatten, (source, 0, dims - 1)), site) \
                if dims > 1 else source
            gathered = _made(graph.call_function(torch.index_select, (rows, 0, index)), site)
        site.replace_all_uses_with(gathered)
        graph.erase_node(site)
        named[name] = gathered  # a site may itself be reduced, a child's mask or an output
    for reduction in analysis.reductions:
        _mask_reduction(graph, named, reduction, invalid, count)
    for name, dim in analysis.child_masks:  # y[m2] ==> y[m2 & valid]: never a padding row
        child = named[name]
        with graph.inserting_after(child):
            shaped = _made(graph.call_method("view", (valid, _along(dim, ranks[name]))), child)
        with graph.inserting_after(shaped):
            kept = _made(graph.call_function(operator.and_, (child, shaped)), child)
        for user in list(child.users):
            if user.op == "call_function" and user.target is operator.getitem and user.args[1] is child:
                user.update_arg(1, kept)
        masks[name] = kept
    exits = analysis.exits if slice_exits else analysis.outputs
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for name, dim in exits:  # rows handed on: the real rows only
        node = named[name]
        with graph.inserting_before(output):
            real = _made(graph.call_method("narrow", (node, dim, 0, host_count)), node)
        output.replace_input_with(node, real)
    return cursor


def _along(dim: int, rank: int) -> list[int]:
    return [1] * dim + [-1] + [1] * (rank - dim - 1)


def _mask_reduction(graph: fx.Graph, named: dict[str, fx.Node], r: Any, invalid: fx.Node,
                    count: fx.Node) -> None:
    """sum/mean over the rows of the real rows only (see the module docstring)."""
    node = named[r.node]

    def add(target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
        with graph.inserting_before(node):
            create = graph.call_method if method else graph.call_function
            return _made(create(target, args, kwargs), node)

    if r.argument:  # loss(..., reduction=r) ==> reduce_r(loss(..., reduction="none"))
        with graph.inserting_before(node):
            rows = _made(graph.node_copy(node), node)
        rows.kwargs = {**node.kwargs, "reduction": "none"}
    else:
        rows = named[r.rows]
    shaped = add("view", invalid, _along(r.row_dim, r.rank), method=True)
    masked = add("masked_fill", rows, shaped, 0, method=True)
    if r.kind == "sum" and not r.argument:  # the same call on the masked rows
        node.replace_input_with(rows, masked)
        return
    dims = list(range(r.rank)) if r.dims is None else list(r.dims)
    total = add(torch.ops.aten.sum.dim_IntList, masked, dims, r.keepdim, dtype=r.dtype)
    if r.kind == "mean":
        total = add(operator.truediv, total, add(operator.mul, count, r.per_row)
                    if r.per_row != 1 else count)
    node.replace_all_uses_with(total)
    graph.erase_node(node)


# -- one read for the level: where, and what moves ---------------------------------------------

def _placement(graph: fx.Graph, sites: list[fx.Node], counts: list[fx.Node], group: bool,
               analysed: set[fx.Node], evidence: dict) -> tuple[fx.Node | None, list[fx.Node]]:
    """Where the level's nodes that must follow its one read go (an anchor: after it), and the
    nodes that move there; ``(None, [])`` when one read per space is needed instead.

    Nodes of an analysed region (the row walk refused any write to state or inputs) and nodes
    made by this rewrite are pure (two pure nodes swap freely); any other pair of a moved node and
    a node it jumps over must not conflict (:func:`fxpasses.analysis.order.conflict`, as PairCalls
    checks its reordering)."""
    order = _order(graph)
    last = max(counts, key=order.__getitem__)
    early = [s for s in sites if order[s] < order[last]]
    evidence.update(early_sites=len(early))
    if len(counts) == 1:
        return last, []
    if not group:
        evidence.update(grouped=False, reason="grouping disabled")
        return None, []
    g = to_digraph(graph)
    dependents = downstream(g, early) | set(early)
    if last in dependents:
        evidence.update(grouped=False, reason="a mask of the level depends on another's rows")
        return None, []
    moved = [n for n in graph.nodes if n in dependents and order[n] < order[last]]
    if not moved:
        evidence.update(grouped=True, moved_nodes=0)
        return last, []
    modes = grad_modes(graph)
    wanted = {modes[n] for n in moved}
    anchor = last
    if len(wanted) == 1 and modes[last] not in wanted:  # move past the switch back to their mode
        switch = next((n for n in graph.nodes if order[n] > order[last]
                       and n.target is torch._C._set_grad_enabled and n.args[0] in wanted), None)
        anchor = switch
    if anchor is not None:  # what depends on the moved nodes before the anchor moves too
        moved = [n for n in graph.nodes if n in dependents and order[n] < order[anchor]]
        wanted = {modes[n] for n in moved}
    jumped = [n for n in graph.nodes if anchor is not None and order[moved[0]] < order[n]
              <= order[anchor] and n not in dependents]
    pure = analysed | {n for n in graph.nodes if n.meta.get(MADE)}
    # a moved node now runs after every jumped node: only those it used to precede swap
    effects = [f"{m.name} / {j.name}: {why}" for m in moved for j in jumped
               if order[j] > order[m] and not (m in pure and j in pure)
               and (why := conflict(m, j)) is not None]
    ok = len(wanted) == 1 and anchor is not None and not effects
    evidence.update(grouped=ok, moved_nodes=len(moved), jumped_nodes=len(jumped),
                    conflicts=tuple(effects[:10]), grad_modes=tuple(sorted(wanted)),
                    analysis="fxpasses.analysis.order (storages, random draws, attributes)")
    if not ok:
        evidence["reason"] = "nodes that may not swap in between" if effects else \
            "the moved nodes run in different grad modes" if len(wanted) != 1 else \
            "no grad-mode switch back to the moved nodes' mode"
        return None, []
    return anchor, moved


def _move(graph: fx.Graph, moved: list[fx.Node], after: fx.Node, anchor: fx.Node) -> None:
    """Place ``moved`` (in their order) after ``anchor``, or right after ``after`` (the read's
    last part) when the anchor comes before it."""
    order = _order(graph)
    cursor = after if order[anchor] <= order[after] else anchor
    for node in moved:
        cursor.append(node)
        cursor = node
