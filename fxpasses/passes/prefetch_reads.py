"""Host reads of scalars the loss takes one after another, made one transfer.

    # n = int(counts.max()) ... m = int(largest)   ->   both copied in one transfer, at the first

The real criterion reads two sizes from its targets before the assigner runs: ``int(counts.max())``
for the packed keypoints (loss.py:790, with the bincount's bound: a
:class:`~fxpasses.runtime.bounded_counts.CheckedRead`) and the packed boxes' size (loss.py:405, a
:class:`~fxpasses.runtime.padded_size.PaddedSize`). Each waits for the device. Both depend on the
targets alone; computed before the first read, the second's value can travel with the first's.

A run-time op that reads some of its arguments on the host says which (``host_reads``) and
takes their values from a prefetch (``prefetched``, ``at``). The first such read of the graph
stays where it is; a later one joins it when the nodes its read arguments need that come after the
first read can run before it: each of known effects, writing no memory, drawing no random
number, reading nothing on the host, under the same grad mode, and not conflicting
(:func:`fxpasses.analysis.order.conflict`: memory, attributes) with any node it passes, and when
no node between the two reads may write what the later one reads (its value at the prefetch is
the value it would have read). Those
nodes move before the first read, in their order; one
:class:`~fxpasses.runtime.select.StartCounts` (``prefetch_...``: a pinned copy and an event, as
for the count reads) copies every joined read's arguments to the host in one transfer, which
the first read waits for; each read takes its values from it, and does what it did with them (a checked
read still abandons where its bound failed, before anything computed from it). Moving pure
integer work earlier changes no value. A certificate per group joined; a read that could not
join says why. Written by hand: torch.fx has no scheduler.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.meta import ANNOTATED, input_names, value
from ..analysis.ops import NODE_FACTS, NodeFacts
from ..certificates import Certificate, Check, Site
from ..ir.runtime_op import RuntimeOp
from ..locations import node_location
from ..runtime.select import StartCounts
from .hoisting import graph_order, hoistable


def prefetch_reads(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Join the graph's later scalar reads to its first (see the module docstring), in place;
    a certificate for the group (none where the graph has fewer than two such reads)."""
    reads = [n for n in gm.graph.nodes if _read_arguments(n)]
    if len(reads) < 2:
        return []
    first, joined, moved, refused = reads[0], [reads[0]], [], {}
    for read in reads[1:]:
        needed, why = _to_hoist(read, first, set(moved))
        if why is not None:
            refused[read.name] = why
            continue
        joined.append(read)
        moved.extend(needed)
    if len(joined) > 1:
        _rewrite(gm.graph, first, joined, sorted(moved, key=graph_order(gm.graph).__getitem__))
    location = node_location(first)
    site = Site(tuple(r.name for r in reads), (location,) if location else (),
                f"{len(reads)} host reads of scalars")
    check = Check("reads-joined", len(joined) > 1, {
        "joined": tuple(r.name for r in joined), "nodes_moved_before_the_first": len(moved),
        "not_joined": refused}, None if len(joined) > 1 else "reads-not-joined")
    effect = {"host_reads": f"{len(joined)} reads in one transfer, at {first.name}"} if len(joined) > 1 else {}
    return [Certificate.from_checks(pass_name, site, [check], effect=effect)]


def _read_arguments(node: fx.Node) -> tuple[fx.Node, ...]:
    """The arguments ``node`` reads on the host, each a 0-dim integer or boolean tensor computed
    by the graph; empty where it is no such read (or reads anything else)."""
    if node.op != "call_function" or not isinstance(node.target, RuntimeOp) or node.kwargs:
        return ()
    args = [node.args[i] if i < len(node.args) else None for i in node.target.host_reads]
    if not args or not all(isinstance(a, fx.Node) and _scalar_integer(value(a)) for a in args):
        return ()
    return tuple(args)


def _scalar_integer(val: object) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 0 and not val.is_floating_point() \
        and not val.is_complex()


def _to_hoist(read: fx.Node, first: fx.Node, moving: set[fx.Node]) -> tuple[list[fx.Node], str | None]:
    """The nodes after ``first`` that ``read``'s read arguments need (``moving``: already
    moving with an earlier read), and why they cannot run before ``first`` (None: they can)."""
    return hoistable(_read_arguments(read), first, read, moving)


def _rewrite(graph: fx.Graph, first: fx.Node, joined: list[fx.Node], moved: list[fx.Node]) -> None:
    for node in moved:
        first.prepend(node)
    per_read = [_read_arguments(r) for r in joined]  # before the reads take their kwargs
    arguments = [a for args in per_read for a in args]
    with graph.inserting_before(first):
        prefetch = graph.call_function(StartCounts(f"prefetch_{first.name}"), tuple(arguments))
    prefetch.meta.update({k: v for k, v in first.meta.items() if k in ("stack_trace", "source_fn_stack")})
    # metadata carried, not propagated again: the reads compute what they did (an unbacked size
    # propagated again would be a new symbol, and everything below it would follow)
    prefetch.meta["val"] = None
    prefetch.meta[NODE_FACTS] = NodeFacts(("aten::stack", "aten::_to_copy"), False, frozenset(),
                                          True, False, True, True, False)
    prefetch.meta[ANNOTATED] = input_names(prefetch)
    at = 0
    for read, args in zip(joined, per_read):
        read.kwargs = {"prefetched": prefetch, "at": at}
        read.meta[ANNOTATED] = input_names(read)
        at += len(args)
