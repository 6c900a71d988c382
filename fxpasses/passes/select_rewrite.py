"""The graph surgery of SelectRows: selections become gathers into a static capacity.

For each space (a mask and its selections) of one level (see :mod:`fxpasses.analysis.selection`):

    (C,)   = Capacities()                          # host: chosen before the count is known
    count  = m.sum()                               # on the device
    idx    = nonzero_static(m.flatten(), size=C, fill_value=-1).squeeze(-1)
    idx    = where(idx >= 0, idx, idx.amax().clamp(min=0))   # padding copies the last real row
    x[m]  ==>  rows_of(x.flatten(0, m.dim() - 1)).index_select(0, idx)   # (C, ...): real rows first
              (integer x: .masked_fill(count == 0, 0): an empty selection's index rows are 0)
    sum(v) ==> sum(v.masked_fill(~valid, 0))       # valid = arange(C) < count
    mean(v) ==> sum(v.masked_fill(~valid, 0)) / (count * elements per row)
    loss(a, b, reduction=r) ==> reduce_r(loss(a, b, reduction="none").masked_fill(~valid, 0))
    y[m2]  ==>  y[m2 & valid]                      # a child never selects padding rows
    x[m.nonzero(as_tuple=True)]  ==>  as x[m]    # (x's first dims shaped as m, static sizes)
    buf[m.nonzero(as_tuple=True)] = v  ==>  buf[positions] = where(valid, v, v[last].detach())
    labels[m].long() ==> labels[m].long().masked_fill(count == 0, 0)   # an index, as clean
    (n,)   = CheckCounts(C, count)                 # the host read: as late as is safe
    out    ==>  out.narrow(row_dim, 0, n)          # rows handed to the caller

A scatter's padding positions repeat the last real one (``last``: row ``count - 1``), so its
padding rows write that row's value again, bitwise (one value per position, whichever write
lands last), and their gradient, ``grad[positions]``, goes nowhere. ``masked_fill``, not a
product: a padding row's value is a real row's, finite where that row's is, but ``0 * inf``
would be NaN. No node waits for the count on the host, so nothing moves: the capacity comes
first (it reads no tensor), and the read comes before the first node after the count that could
show or suffer from a count that did not fit (:func:`check_point`): a visible effect, a host
read of values downstream of the gathers, an index op whose index depends on them other than
through an integer gather or an integer cast of rows computed row by row (both cleaned as above)
or their views, or the output. A gathered row is a real row or a copy of one (the first real
rows where a count exceeds its capacity), so such an index holds values native indexes with; so
do the indices of a ``topk``/``max``... over a dim no smaller than the one a
``scatter``/``gather`` indexes along. A data-read size the host has as a Python int
(``int(counts.max())``) that an index into that dim would wait for is guarded nonzero where it
is read (no wait: a call where it is zero is abandoned as at any guard). A count of zero leaves
no real row: the padding then copies the first position, and those first rows (and an integer
row of 0) must only reach the read, where the call is abandoned; ``rows_of`` (a
:class:`~fxpasses.runtime.select.NonEmptyRows`) gives an empty batch one zero row to gather.
Reads that go to the same place are one, and so are reads whose counts are all computed before
an earlier read's place (the later ones move up to it), the counts' copy to the host queued as
soon as they are computed (:func:`place_reads`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import networkx
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..analysis.graph import downstream, to_digraph
from ..analysis.capture import is_state
from ..analysis.meta import storages_of, tensors_in, value
from ..analysis.ops import node_facts
from ..analysis.order import effects
from ..analysis.selection import SpaceAnalysis, is_coordinates
from ..ir.proofs import BucketedSizes, prove
from ..locations import node_location
from ..runtime.select import Capacities, CheckCounts, NonEmptyRows, StartCounts
from .fold_state import reads_state_element
from ..ir.trace_ops import ExpectTruth, ExpectValue, GuardOp

# aten ops that read memory at positions given by a tensor (a bad index fails the device)
_INDEXING = ("aten.index", "aten.gather", "aten.scatter", "aten.take", "aten.embedding",
             "aten.bincount", "aten.put", "aten._index_put", "aten.masked_scatter")


@dataclass
class SpaceRewrite:
    """One rewritten space: its capacity (op, node and the getitem of its value), its count,
    where both are known, the values whose rows leave (by their nodes now), and its truth
    ``count == 0`` on the device (``empty``)."""

    capacities: Capacities
    planned: fx.Node
    capacity: fx.Node
    count: fx.Node
    start: fx.Node
    exits: tuple[tuple[fx.Node, int], ...]
    mask: str
    empty: fx.Node


@dataclass
class Rewritten:
    """What the rewrite of a level did: its spaces, every node it made, its integer gathers
    (zero when empty), the nodes computed row by row from its gathers and the integer casts of
    floats among them; the reads are placed once every level is rewritten (:func:`place_reads`)."""

    spaces: list[SpaceRewrite] = field(default_factory=list)
    made: set[fx.Node] = field(default_factory=set)
    cleaned: set[fx.Node] = field(default_factory=set)
    rows: set[fx.Node] = field(default_factory=set)
    casts: set[fx.Node] = field(default_factory=set)


def rewrite_level(gm: fx.GraphModule, analyses: list[SpaceAnalysis], level_id: str,
                  min_bucket: int, masks: dict[str, fx.Node], proof: str, *,
                  slice_exits: bool = False) -> Rewritten:
    """Rewrite the spaces of one level in ``gm`` (see the module docstring); their reads come
    later (:func:`place_reads`).

    ``masks``: mask nodes by mask name (a child's mask is the and-node its parent made; updated
    here for this level's children). ``proof``: the certificate id cited by the bucket fact.
    ``slice_exits``: slice every value whose rows leave (for the witness, whose outputs are
    those values) instead of the graph outputs only.
    """
    graph = gm.graph
    named = {n.name: n for n in graph.nodes}
    result = Rewritten()
    made, cleaned = result.made, result.cleaned
    for number, analysis in enumerate(analyses):
        first = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
        space = analysis.space
        mask = masks[space.mask] if space.mask in masks else named[space.mask]
        site = node_location(named[space.sites[0]]) or space.mask
        op = Capacities(f"capacity_{level_id}_{number}", site, min_bucket, space.level)
        with graph.inserting_before(first):  # reads no tensor: first of all
            planned = graph.call_function(op, ())
        with graph.inserting_after(planned):
            capacity = graph.call_function(operator.getitem, (planned, 0))
        made |= {planned, capacity}
        prove(planned, BucketedSizes(proof, 1))
        with graph.inserting_after(mask):
            count = _made(graph.call_function(torch.sum, (mask,)), mask, made)
        order = {n: i for i, n in enumerate(graph.nodes)}
        start = max(count, capacity, key=order.__getitem__)  # a mask may be a placeholder
        rewritten, empty = _space(gm, analysis, mask, count, capacity, start, masks, made, cleaned,
                                  result.rows, result.casts)
        exits = analysis.exits if slice_exits else analysis.outputs
        result.spaces.append(SpaceRewrite(op, planned, capacity, count, start,
                                          tuple((rewritten[name], dim) for name, dim in exits),
                                          space.mask, empty))
    return result


@dataclass
class DeferredTruth:
    """A guard on a value's truth (``if mask.any():``), read with the counts instead of where
    the loss read it: ``count`` is its truth on the device (``value != 0``), computed where the
    guard was; ``node`` the guard node it replaced, kept aside to put back."""

    guard: ExpectTruth
    count: fx.Node
    node: fx.Node


def place_reads(gm: fx.GraphModule, levels: list[Rewritten], *, defer_truths: bool = False
                ) -> tuple[dict[str, dict], list[str]]:
    """The reads of the rewritten spaces: each space's goes where :func:`check_point` says, the
    spaces whose reads go to the same place share one (a call waits once), and so do those whose
    counts are computed before an earlier read's place (:func:`_merged`); its counts' copy to the
    host queued right after the last of them is computed
    (:class:`~fxpasses.runtime.select.StartCounts`); the rows that leave are sliced to their
    counts. ``defer_truths``: the guards on a value's truth after the first count join the reads
    too (:func:`_defer_truths`). Returns, by mask, the node its read went before and why; and the
    reads' names."""
    graph = gm.graph
    made = set().union(*(level.made for level in levels))
    cleaned = set().union(*(level.cleaned for level in levels))
    spaces = [s for level in levels for s in level.spaces]  # lower levels first
    truths = _defer_truths(gm, spaces, made) if defer_truths else []
    cleaned |= _clean_integer_casts(gm, spaces, set().union(*(level.rows for level in levels)),
                                    set().union(*(level.casts for level in levels)), made)
    sizes = _guard_host_sizes(gm, spaces, made, cleaned)
    while True:
        groups: dict[fx.Node, list[Any]] = {}
        placement = {}
        for space in spaces:
            before, why = check_point(gm, space.planned, space.start, made, cleaned)
            groups.setdefault(before, []).append(space)
            placement[space.mask] = {"before": before.name, "reason": why}
        for truth in truths:
            before, _ = check_point(gm, None, truth.count, made, cleaned)
            groups.setdefault(before, []).append(truth)
        order = {n: i for i, n in enumerate(graph.nodes)}
        merged = _merged(groups, order)
        early = [t for t in truths if not _read_with_its_counts(gm, t, merged)]
        if not early:
            break
        for truth in early:  # its value needs counts read later: the guard stays where it was
            _restore(graph, truth, made)
            truths.remove(truth)
    reads = []
    for number, (before, members) in enumerate(merged.items()):
        selections = [m for m in members if isinstance(m, SpaceRewrite)]
        guards = [m for m in members if isinstance(m, DeferredTruth)]
        counts = [m.count for m in (*selections, *guards)]
        with graph.inserting_after(max(counts, key=order.__getitem__)):
            started = _made(graph.call_function(StartCounts(f"start_counts_{number}"), tuple(counts)),
                            counts[-1], made)
        with graph.inserting_before(before):
            check = _made(graph.call_function(CheckCounts(
                f"check_counts_{number}", [s.capacities for s in selections],
                [(g.guard, g.guard.expected) for g in guards], (before.name,)),
                (*(s.capacity for s in selections), started)), counts[-1], made)
        reads.append(check.name)
        for k, space in enumerate(selections):
            if space.exits:
                with graph.inserting_after(check):
                    host_count = graph.call_function(operator.getitem, (check, k))
                _slice_exits(graph, space.exits, host_count)
    return placement, reads, sizes


def _clean_integer_casts(gm: fx.GraphModule, spaces: list[SpaceRewrite], rows: set[fx.Node],
                         casts: set[fx.Node], made: set[fx.Node]) -> set[fx.Node]:
    """``labels[idx].long()`` ==> ``.masked_fill(count == 0, 0)``, an index as clean as an
    integer gather, where every value it depends on that the capacities shape is computed row by
    row from the gathers (``rows``): a gathered row is a real row or a copy of one (also when a
    count exceeds its capacity: then the first real rows), so the cast's rows are values native
    computes too (an index in bounds where native's is), but for an empty selection, zeroed here.
    A value computed over the rows (a masked sum: partial when rows were cut off) is not row by
    row: such a cast stays an index that waits for the read."""
    graph = gm.graph
    dag = to_digraph(graph)
    padded = downstream([s.planned for s in spaces])
    cleaned = set()
    for node in list(graph.nodes):
        if node not in rows or node not in casts:
            continue
        ancestors = networkx.ancestors(dag, node)
        if not ancestors & padded <= rows | {s.capacity for s in spaces}:
            continue
        empties = [s.empty for s in spaces if s.planned in ancestors]  # any of them empty: zero
        empty, cursor = empties[0], node
        for other in empties[1:]:
            with graph.inserting_after(cursor):
                empty = cursor = _made(graph.call_function(operator.or_, (empty, other)), node, made)
        with graph.inserting_after(cursor):
            zeroed = _made(graph.call_method("masked_fill", (node, empty, 0)), node, made)
        node.replace_all_uses_with(zeroed, delete_user_cb=lambda user: user is not zeroed)
        cleaned.add(zeroed)
    return cleaned


def _guard_host_sizes(gm: fx.GraphModule, spaces: list[SpaceRewrite], made: set[fx.Node],
                      cleaned: set[fx.Node]) -> list[str]:
    """Guards ``n != 0`` on the sizes read from data as Python ints (``int(counts.max())``) that
    would hold a space's read before an index op (:data:`MAYBE_EMPTY_DIM`), each right after its
    read: the host has the value there, so the guard costs no wait, and the read can go later.
    Where it fails the call is abandoned as by any guard of the trace (``guard-failed``, before
    anything is visible: the loss's own code has read the value there). Returns the guards'
    names."""
    graph = gm.graph
    added: list[str] = []
    while True:
        binders = []
        for space in spaces:
            before, why = check_point(gm, space.planned, space.start, made, cleaned)
            if why == MAYBE_EMPTY_DIM:
                binders += _host_int_binders(gm, before, added)
        if not binders:
            return added
        for binder in dict.fromkeys(binders):
            with graph.inserting_after(binder):
                test = _made(graph.call_function(operator.ne, (binder, 0)), binder, made)
            guard = ExpectValue(f"expect_nonzero_{binder.name}", True, node_location(binder) or binder.name)
            with graph.inserting_after(test):
                added.append(_made(graph.call_function(guard, (test,)), binder, made).name)


def _host_int_binders(gm: fx.GraphModule, index_op: fx.Node, added: list[str]) -> list[fx.Node]:
    """The nodes that read, as Python ints, the data-read sizes of the dims ``index_op``
    indexes into and that no guard of this pass checks yet."""
    indexed = index_op.args[0] if index_op.args and isinstance(index_op.args[0], fx.Node) else None
    symbols = {d.node.expr for t in tensors_in(value(indexed)) for d in t.shape
               if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol} if indexed is not None else set()
    guarded = {n.args[0].args[0] for n in gm.graph.nodes if n.name in added}
    return [n for n in gm.graph.nodes if n not in guarded and n.op in ("call_function", "call_method")
            and isinstance(n.meta.get("val"), torch.SymInt) and n.meta["val"].node.expr in symbols
            and "unbacked_bindings" in n.meta]


def _defer_truths(gm: fx.GraphModule, spaces: list[SpaceRewrite], made: set[fx.Node]) -> list[DeferredTruth]:
    """The guards on a tensor's truth after the first space's count, each replaced by its truth
    on the device (``value != 0``, computed where the guard read it): no longer a host read, it
    is checked with the counts. Sound where the counts' read is: nothing before it shows, and
    nothing computed on a decision that did not hold may index memory or decide on the host
    (:func:`check_point` over every node after the guard); a guard whose value depends on counts
    read later than it is put back (its value is reliable only once they fit: they are read
    first, in the same read, or earlier)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((order[s.start] for s in spaces), default=None)
    found = []
    for node in list(graph.nodes):
        if first is None or order[node] <= first or node.op != "call_function" or \
                type(node.target) is not ExpectTruth or node.users or \
                not isinstance(node.args[0], fx.Node) or \
                not isinstance(value(node.args[0]), torch.Tensor):
            continue
        with graph.inserting_before(node):
            truth = _made(graph.call_function(torch.ne, (node.args[0], 0)), node, made)
        found.append(DeferredTruth(node.target, truth, node))
        graph.erase_node(node)
    return found


def _restore(graph: fx.Graph, truth: DeferredTruth, made: set[fx.Node]) -> None:
    with graph.inserting_before(truth.count):
        guard = graph.call_function(truth.guard, (truth.count.args[0],))
    guard.meta = dict(truth.node.meta)
    graph.erase_node(truth.count)
    made.discard(truth.count)


def _read_with_its_counts(gm: fx.GraphModule, truth: DeferredTruth,
                          merged: dict[fx.Node, list[Any]]) -> bool:
    """Every space whose capacity ``truth``'s value depends on is read with it or earlier (a
    count that does not fit abandons the call first, so the truth is read from rows that fit)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    read_at = {id(m): before for before, members in merged.items() for m in members}
    needs = [s for members in merged.values() for s in members if isinstance(s, SpaceRewrite)
             and truth.count in downstream([s.planned])]
    return all(order[read_at[id(s)]] <= order[read_at[id(truth)]] for s in needs)


def _merged(groups: dict[fx.Node, list[Any]], order: dict[fx.Node, int]) -> dict[fx.Node, list[Any]]:
    """``groups`` (check point -> what is read there) with each member moved to the earliest
    check point that comes after its count: a read earlier than its check point is as safe
    (nothing before that point shows or suffers from its count), and one wait replaces two. Each
    space is still placed (reported) at its own check point."""
    points = sorted(groups, key=order.__getitem__)
    merged: dict[fx.Node, list[Any]] = {}
    for before in points:
        for member in groups[before]:
            into = next(p for p in points if order[p] > order[member.count])
            merged.setdefault(into, []).append(member)
    return {p: merged[p] for p in points if p in merged}


def _made(node: fx.Node, like: fx.Node, made: set[fx.Node]) -> fx.Node:
    """A new node of the rewrite, reporting the user's line of ``like``."""
    if "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    made.add(node)
    return node


def _space(gm: fx.GraphModule, analysis: SpaceAnalysis, mask: fx.Node, count: fx.Node,
           capacity: fx.Node, cursor: fx.Node, masks: dict[str, fx.Node], made: set[fx.Node],
           cleaned: set[fx.Node], rowwise: set[fx.Node], casts: set[fx.Node]
           ) -> tuple[dict[str, fx.Node], fx.Node]:
    """Index, validity and every rewrite of one space, the index nodes placed after ``cursor``;
    ``made`` gets every new node, ``cleaned`` the integer gathers zeroed when empty, ``rowwise`` the
    nodes computed row by row from the gathers (the index, the gathers, the rows' region),
    ``casts`` the region's integer casts of floats (read before the gathers replace their inputs).
    Returns the nodes by name, a rewritten site's name naming its gather, and ``count == 0``."""
    graph = gm.graph
    named = {n.name: n for n in graph.nodes}
    before = set(made)
    casts.update(named[n] for n in analysis.region if n in named and integer_cast_of_floats(named[n]))

    def add(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = _made(graph.call_function(target, args, kwargs), mask, made)
        return cursor

    dims = analysis.space.rank
    flat = add(torch.flatten, mask) if dims > 1 else mask
    found = add(torch.squeeze, add(torch.nonzero_static, flat, size=capacity, fill_value=-1), -1)
    last = add(torch.clamp, add(torch.amax, found), min=0)  # no real row: the first position
    index = add(torch.where, add(operator.ge, found, 0), found, last)
    empty = add(operator.eq, count, 0)
    positions = add(torch.arange, capacity, device=add(getattr, mask, "device"))
    valid = add(operator.lt, positions, count)
    invalid = add(operator.invert, valid)
    rows_of = NonEmptyRows(f"rows_of_{analysis.space.mask}")
    ranks = {name: value(named[name]).dim() for name, _ in analysis.child_masks}  # before rewriting
    for name in analysis.space.sites:  # x[m] ==> rows_of(x.flatten(0, m.dim() - 1))[idx]
        site = named[name]
        if name in analysis.space.positions:  # m.nonzero() ==> the positions of idx in m
            stacked = _coordinates(graph, site, mask, dims, count, capacity, made, cleaned, rows_of, index)
            if stacked is None:
                del named[name]  # a tuple: its parts are the positions, nothing else reads it
            else:
                named[name] = stacked
            continue
        source = site.args[0]
        gathered = _gather(graph, site, source, dims, rows_of, index, made)
        with graph.inserting_before(site):
            if not _floating(value(source)):  # indices of an empty selection: 0, never garbage
                gathered = _made(graph.call_method("masked_fill", (gathered, empty, 0)), site, made)
                cleaned.add(gathered)
        site.replace_all_uses_with(gathered)
        graph.erase_node(site)
        named[name] = gathered  # a site may itself be reduced, a child's mask or an output
    rowwise.update(made - before, (named[n] for n in analysis.region if n in named))  # row by row
    for reduction in analysis.reductions:
        _mask_reduction(graph, named, reduction, invalid, count, made)
    for name, dim in analysis.child_masks:  # y[m2] ==> y[m2 & valid]: never a padding row
        child = masks.get(name, named[name])  # and-ed already by another parent of this level
        with graph.inserting_after(child):
            shaped = _made(graph.call_method("view", (valid, _along(dim, ranks[name]))), child, made)
        with graph.inserting_after(shaped):
            kept = _made(graph.call_function(operator.and_, (child, shaped)), child, made)
        for user in list(child.users):  # (read from the graph: a rewritten source has no metadata)
            if _selects_by(user, child):
                user.replace_input_with(child, kept)
        masks[name] = kept
    for scatter in analysis.scatters:  # padding rows write the last real row's value again
        _scatter_real_rows(graph, named, scatter, valid, count, capacity, made)
    for use in analysis.counts:  # rows.shape[0] as a value ==> the true count, on the device
        user = named[use.user]
        with graph.inserting_before(user):
            true = count if use.factor == 1 else \
                _made(graph.call_function(operator.mul, (count, use.factor)), user, made)
        user.replace_input_with(named[use.size], true)
    return named, empty


def _coordinates(graph: fx.Graph, site: fx.Node, mask: fx.Node, rank: int, count: fx.Node,
                 capacity: fx.Node, made: set[fx.Node], cleaned: set[fx.Node],
                 rows_of: NonEmptyRows, index: fx.Node) -> fx.Node | None:
    """``m.nonzero(as_tuple=...)`` as the positions of ``m`` padded to the capacity, a padding
    row copying the last real position (0 when there is none: cleaned). Parts of the tuple
    replace its ``getitem`` users; the positions themselves replace ``m.nonzero()`` (returned).

    ``x[m.nonzero(as_tuple=True)]`` over dims shaped as ``m`` becomes the gather that ``x[m]``
    becomes, ``rows_of(x.flatten(0, rank - 1)).index_select(0, index)`` (``index``: the space's
    padded positions in the flattened mask, the same positions, padded alike): the same rows,
    and a backward that adds the padding rows' (zero)
    gradients in parallel, where ``aten.index``'s backward (a sort, then one pass per distinct
    position) adds them one after another into the last real row: 0.3 ms per gather on an H200
    at batch 16, with capacities up to eight times the count."""
    def add(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with graph.inserting_before(site):
            return _made(graph.call_function(target, args, kwargs), site, made)

    found = add(torch.nonzero_static, mask, size=capacity, fill_value=-1)  # (C, m.dim())
    last = add(torch.clamp, add(torch.index_select, found, 0, _last_row(add, count, capacity)), min=0)
    positions = add(torch.where, add(operator.ge, found, 0), found, last)
    cleaned.add(positions)
    if not site.kwargs.get("as_tuple", False):
        site.replace_all_uses_with(positions)
        graph.erase_node(site)
        return positions
    parts = tuple(add(torch.select, positions, 1, d) for d in range(rank))
    cleaned.update(parts)
    for user in list(site.users):
        if user.op == "call_function" and user.target is operator.getitem and \
                isinstance(user.args[1], int):
            user.replace_all_uses_with(parts[user.args[1]])
            graph.erase_node(user)
        else:  # a guard on the tuple's length, say: the tuple of the parts
            user.args = fx.node.map_arg(user.args, lambda n: parts if n is site else n)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n: parts if n is site else n)
    graph.erase_node(site)
    for user in [user for user in parts[0].users if _gathers_by(user, parts, mask, rank)]:
        user.replace_all_uses_with(_gather(graph, user, user.args[0], rank, rows_of, index, made))
        graph.erase_node(user)
    return None


def _gather(graph: fx.Graph, site: fx.Node, source: Any, rank: int, rows_of: NonEmptyRows,
            index: fx.Node, made: set[fx.Node]) -> fx.Node:
    """``rows_of(source.flatten(0, rank - 1)).index_select(0, index)``, before ``site``."""
    with graph.inserting_before(site):
        rows = _made(graph.call_function(torch.flatten, (source, 0, rank - 1)), site, made) \
            if rank > 1 else source
        rows = _made(graph.call_function(rows_of, (rows,)), site, made)
        return _made(graph.call_function(torch.index_select, (rows, 0, index)), site, made)


def _gathers_by(node: fx.Node, parts: tuple[fx.Node, ...], mask: fx.Node, rank: int) -> bool:
    """``node`` is ``x[parts]``, ``parts`` the tuple ``mask.nonzero(as_tuple=True)`` has become,
    with the dims it indexes shaped as ``mask``, static sizes (shape metadata; unknown: no)."""
    index = node.args[1] if node.op == "call_function" and node.target is operator.getitem else None
    if not (isinstance(index, tuple) and len(index) == len(parts) and all(a is b for a, b in zip(index, parts))):
        return False
    x, m = value(node.args[0]), value(mask)
    if not isinstance(x, torch.Tensor) or not isinstance(m, torch.Tensor) or x.dim() < rank:
        return False
    return all(type(a) is int for a in m.shape) and tuple(x.shape[:rank]) == tuple(m.shape)


def _last_row(add: Any, count: fx.Node, capacity: fx.Node) -> fx.Node:
    """The row of the last real position, as a 1-element index: ``count - 1`` (beyond the
    capacity: some real row, the call is abandoned at the read; with no real row: row 0)."""
    last = add(torch.remainder, add(torch.clamp, add(operator.sub, count, 1), min=0), capacity)
    return add(torch.reshape, last, (1,))


def _scatter_real_rows(graph: fx.Graph, named: dict[str, fx.Node], scatter: Any, valid: fx.Node,
                       count: fx.Node, capacity: fx.Node, made: set[fx.Node]) -> None:
    """``buf[positions] = v`` ==> ``buf[positions] = where(valid, v, v[last].detach())``."""
    node, rows = named[scatter.node], named[scatter.values]

    def add(target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
        with graph.inserting_before(node):
            create = graph.call_method if method else graph.call_function
            return _made(create(target, args, kwargs), node, made)

    last = add("detach", add(torch.index_select, rows, 0, _last_row(add, count, capacity)), method=True)
    shaped = add("view", valid, _along(0, scatter.rank), method=True)
    node.replace_input_with(rows, add(torch.where, shaped, rows, last))


def _selects_by(node: fx.Node, mask: fx.Node) -> bool:
    """``node`` is ``x[mask]`` or ``mask.nonzero(...)``."""
    if node.op == "call_function" and node.target is operator.getitem:
        return len(node.args) == 2 and node.args[1] is mask
    return is_coordinates(node) and node.args[0] is mask


INTEGER_CASTS = ("long", "int", "short", "byte", "char", "to", "type")  # as methods


def integer_cast_of_floats(node: fx.Node) -> bool:
    """``x.long()``, ``x.to(torch.int64)``... of a floating ``x`` (by their metadata): values
    that become an index."""
    if node.op != "call_method" or node.target not in INTEGER_CASTS or not node.args or \
            not isinstance(node.args[0], fx.Node):
        return False
    source, cast = value(node.args[0]), value(node)
    return isinstance(cast, torch.Tensor) and _floating(source) and \
        not cast.is_floating_point() and not cast.is_complex() and cast.dtype != torch.bool


def _floating(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def _slice_exits(graph: fx.Graph, exits: Any, host_count: fx.Node) -> None:
    """Rows handed on: the real rows only."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node, dim in exits:
        with graph.inserting_before(output):
            real = graph.call_method("narrow", (node, dim, 0, host_count))
        if "stack_trace" in node.meta:
            real.meta["stack_trace"] = node.meta["stack_trace"]
        output.replace_input_with(node, real)


def _along(dim: int, rank: int) -> list[int]:
    return [1] * dim + [-1] + [1] * (rank - dim - 1)


_NEUTRAL = {"sum": 0, "mean": 0, "any": False, "all": True}  # what a padding row is filled with


def _mask_reduction(graph: fx.Graph, named: dict[str, fx.Node], r: Any, invalid: fx.Node,
                    count: fx.Node, made: set[fx.Node]) -> None:
    """sum/mean over the rows of the real rows only (see the module docstring)."""
    node = named[r.node]

    def add(target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
        with graph.inserting_before(node):
            create = graph.call_method if method else graph.call_function
            return _made(create(target, args, kwargs), node, made)

    if r.argument:  # loss(..., reduction=r) ==> reduce_r(loss(..., reduction="none"))
        with graph.inserting_before(node):
            rows = _made(graph.node_copy(node), node, made)
        rows.kwargs = {**node.kwargs, "reduction": "none"}
    else:
        rows = named[r.rows]
    shaped = add("view", invalid, _along(r.row_dim, r.rank), method=True)
    masked = add("masked_fill", rows, shaped, _NEUTRAL[r.kind], method=True)
    if r.kind in ("sum", "any", "all") and not r.argument:  # the same call on the masked rows
        node.replace_input_with(rows, masked)
        return
    dims = list(range(r.rank)) if r.dims is None else list(r.dims)
    total = add(torch.ops.aten.sum.dim_IntList, masked, dims, r.keepdim, dtype=r.dtype)
    if r.kind == "mean":
        total = add(operator.truediv, total, add(operator.mul, count, r.per_row)
                    if r.per_row != 1 else count)
    node.replace_all_uses_with(total)
    graph.erase_node(node)


# -- where the read goes ---------------------------------------------------------------------

def check_point(gm: fx.GraphModule, planned: fx.Node | None, start: fx.Node, made: set[fx.Node],
                cleaned: set[fx.Node]) -> tuple[fx.Node, str]:
    """The node a space's read goes before, and why: the first after ``start`` (its count and
    capacity) that could show or suffer from a count that did not fit (see the module
    docstring). ``made``: the rewrite's own nodes (safe by construction); ``cleaned``: its
    integer gathers, zero when empty."""
    graph = gm.graph
    # what the capacity shapes; for a deferred guard (no capacity) every node: what follows it
    # computes on a decision that may not hold, and an index made before it may be one that
    # decision protected (if (idx >= 0).all(): table[idx])
    padded = downstream([planned]) if planned is not None else set(graph.nodes)
    external = external_storages(gm)
    cleaned = set(cleaned)
    nonzero: set = set()  # size symbols a guard before has checked to be nonzero
    seen = False
    for node in graph.nodes:
        nonzero |= _nonzero_sizes(node)
        if node is start:
            seen = True
            continue
        if not seen or node in made:
            continue
        if node.op == "output":
            return node, "the output"
        state_read = planned is None and reads_state_element(node)  # the same on any branch
        why = _shows(node, external) or (
            _suffers(node, padded, cleaned, nonzero, made) if node in padded and not state_read else None)
        if why:
            return node, why
        if node in padded and _keeps_cleaned(node, cleaned):
            cleaned.add(node)
    raise AssertionError("a graph without an output")


def external_storages(gm: fx.GraphModule) -> set[int]:
    """The storages of the loss's inputs and state: a write to one is visible."""
    return set().union(*(storages_of(n) for n in gm.graph.nodes if n.op == "placeholder" or is_state(n)))


def visible_before(gm: fx.GraphModule, node: fx.Node, external: set[int],
                   cleared: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """(node name, why) of the first node before ``node`` whose effect an abandoned call would
    have made already (a read placed after ``node`` could then not abandon unseen), or None.
    ``cleared``: nodes known to write nothing (a region the row walk went through: it refuses
    any write of state)."""
    for earlier in gm.graph.nodes:
        if earlier is node:
            return None
        why = None if earlier.name in cleared else _shows(earlier, external)
        if why:
            return earlier.name, why
    return None


def _shows(node: fx.Node, external: set[int]) -> str | None:
    """Why an abandon after ``node`` would not be invisible, or None. An attribute write is
    put back when the call is abandoned (``undone_on_failure``); one that keeps the rows is
    refused by the analysis (``select-boundary``)."""
    found = effects(node)
    if found.unknown:
        return "effects unknown"
    if found.random:
        return "a random draw"
    if found.writes and found.writes & external:
        return "a write to an input, parameter or buffer"
    return None


def _suffers(node: fx.Node, padded: set[fx.Node], cleaned: set[fx.Node], nonzero: set,
             made: set[fx.Node]) -> str | None:
    """Why ``node``, downstream of the gathers, may fail or decide on rows that did not fit. A
    cleaned index (0 for an empty selection) is valid only into dims of at least one element:
    static, or a size read from data that a guard before has checked nonzero (``nonzero``)."""
    if isinstance(node.target, GuardOp) and node.target.reads_values and \
            any(tensors_in(value(a)) for a in node.all_input_nodes):
        return "a host read of values downstream of the gathers"  # bool(tensor), a compared value
    facts = node_facts(node)
    if facts is None or not facts.complete:
        return "no metadata"
    if facts.host_read:
        return "a host read of values downstream of the gathers"
    if any(op.startswith(_INDEXING) for op in facts.ops):
        indices = [a for a in node.all_input_nodes if a in padded and (a in cleaned or
                   any(not _floating(t) and t.dtype != torch.bool for t in tensors_in(value(a))))]
        if _along_a_dim(node):  # the index is the third argument; the source is data
            indices = [a for a in indices if a is node.args[2]]
        if any(a not in cleaned and not _bounded_along(node, a, made) for a in indices):
            return "an index op whose index depends on the gathered rows"
        indexed = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if indices and indexed is not None and indexed not in indices and \
                not all(_at_least_one(d, nonzero) for t in tensors_in(value(indexed)) for d in t.shape):
            return MAYBE_EMPTY_DIM
    return None


MAYBE_EMPTY_DIM = "an index op into a dim whose size, read from data, may be zero"


_ALONG_A_DIM = ("scatter", "scatter_", "scatter_add", "scatter_add_", "gather")  # (x, dim, index, ...)
_INDICES_OF = ("topk", "sort", "max", "min", "kthvalue")  # (values, indices): [0, size of dim)
_SHAPES_ONLY = ("view", "reshape", "expand", "unsqueeze", "squeeze", "flatten", "contiguous")


def _bounded_along(node: fx.Node, index: fx.Node, made: set[fx.Node]) -> bool:
    """``node`` scatters or gathers along a dim by ``index``, whose values are below that dim's
    size whatever the data (``x.scatter_add_(-1, topk(m, k, dim=-1).indices, ones)``, as the
    assigner counts its candidates): no index out of bounds, even from rows that did not fit."""
    indexed = value(node.args[0]) if _along_a_dim(node) and node.args[2] is index else None
    if not isinstance(indexed, torch.Tensor):
        return False
    size = indexed.shape[node.args[1]]
    bound = _index_bound(index, made)
    if bound is None:
        return False
    if isinstance(size, int) and isinstance(bound, int):
        return size >= bound
    return _expr(size) == _expr(bound)  # the same size read from data: max(1).indices into dim 1


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _along_a_dim(node: fx.Node) -> bool:
    """``x.scatter_add_(dim, index, src)``, ``torch.gather(x, dim, index)``... (a static dim)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return name in _ALONG_A_DIM and node.op in ("call_method", "call_function") and \
        len(node.args) >= 3 and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], int) \
        and isinstance(node.args[2], fx.Node)


def _index_bound(node: fx.Node, made: set[fx.Node]) -> int | torch.SymInt | None:
    """A size ``n`` with every value of ``node`` in ``[0, n)`` whatever the data: the indices of
    a ``topk``/``sort``/``max``... over a dim of size ``n``, through views and fills with a
    constant in range (0 where ``n`` is read from data); None where not shown, or where another
    node writes its memory (the rewrite's own nodes, without metadata yet, write none: a scatter
    keeps the loss's node)."""
    nodes, fills = [node], []
    while True:
        if node.op == "call_method" and node.target in _SHAPES_ONLY or \
                node.op == "call_function" and node.target is operator.getitem and \
                isinstance(node.args[1], (slice, tuple)) and not any(
                    isinstance(a, fx.Node) for a in pytree.tree_leaves(node.args[1])):
            node = node.args[0]
        elif node.op == "call_method" and node.target in ("masked_fill_", "masked_fill", "fill_") and \
                isinstance(node.args[-1], int) and not isinstance(node.args[-1], bool):
            fills.append(node.args[-1])
            node = node.args[0]
        else:
            break
        if not isinstance(node, fx.Node):
            return None
        nodes.append(node)
    bound = _indices_of(node)  # a fill of 0 is in range of any dim indices exist for
    if bound is None or not all(v == 0 or isinstance(bound, int) and 0 <= v < bound for v in fills):
        return None
    return None if _written_elsewhere(nodes, made) else bound


def _written_elsewhere(nodes: list[fx.Node], made: set[fx.Node]) -> bool:
    """Whether a node other than ``nodes`` may write their memory: one that takes it (or an
    alias of it, followed through the users) and writes it, or whose effects are unknown. (A
    fresh intermediate is reached by no other path.)"""
    memory = set().union(*(storages_of(n) for n in nodes))
    seen, frontier = set(nodes), list(nodes)
    while frontier:
        for user in frontier.pop().users:
            if user in seen or user in made:
                continue
            seen.add(user)
            found = effects(user)
            if found.writes is None or found.writes & memory:
                return True
            if storages_of(user) & memory:  # an alias: what its users do counts too
                frontier.append(user)
    return False


def _indices_of(node: fx.Node) -> int | torch.SymInt | None:
    """The size of the dim whose positions ``node`` holds: ``topk(x, k, dim)[1]`` (or
    ``.indices``), ``x.max(dim)[1]``..."""
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1 or \
            node.op == "call_function" and node.target is getattr and node.args[1] == "indices":
        made = node.args[0]
    else:
        return None
    if not isinstance(made, fx.Node) or made.op not in ("call_function", "call_method"):
        return None
    name = made.target if made.op == "call_method" else getattr(made.target, "__name__", None)
    if name not in _INDICES_OF or not made.args or not isinstance(made.args[0], fx.Node):
        return None
    position = 2 if name in ("topk", "kthvalue") else 1
    dim = made.kwargs.get("dim", made.args[position] if len(made.args) > position else None)
    if not isinstance(dim, int):
        return None  # max(x) without a dim: no indices; a dim from data: not shown
    return value(made.args[0]).shape[dim]


def _at_least_one(size: Any, nonzero: set) -> bool:
    """A dim known to hold an element: a static size >= 1, a symbol checked nonzero, or the
    minimum or maximum of such."""
    if isinstance(size, int):
        return size >= 1
    expr = _expr(size)
    if expr.is_Integer:
        return int(expr) >= 1
    if expr.is_Symbol:
        return expr in nonzero
    return expr.func.__name__ in ("Min", "Max") and all(_at_least_one(a, nonzero) for a in expr.args)


def _nonzero_sizes(node: fx.Node) -> set:
    """The size symbols a guard ``node`` checks nonzero: ``if n == 0:`` seen False (``bool(n ==
    0)``, or ``n != 0`` / ``n > 0`` seen True), ``n`` a size read from data."""
    if node.op != "call_function" or not isinstance(node.target, GuardOp) or not node.args:
        return set()
    test = node.args[0]
    if isinstance(test, fx.Node) and test.op == "call_function" and test.target is bool and test.args:
        test = test.args[0]
    if not isinstance(test, fx.Node) or test.op != "call_function" or len(test.args) != 2 or \
            test.args[1] != 0 or not isinstance(test.args[0], fx.Node):
        return set()
    expected = {operator.eq: False, operator.ne: True, operator.gt: True}.get(test.target)
    size = test.args[0].meta.get("val")
    if expected is None or node.target.expected is not expected or \
            not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
        return set()
    return {size.node.expr}


def _keeps_cleaned(node: fx.Node, cleaned: set[fx.Node]) -> bool:
    """A view of a cleaned integer row (a reshape, an expand, a getitem of a slice)."""
    facts = node_facts(node)
    inputs = node.all_input_nodes
    return facts is not None and facts.complete and not facts.computes and \
        len(inputs) == 1 and inputs[0] in cleaned
