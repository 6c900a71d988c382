"""Count reads that the fused graph makes one after the other, made one wait.

SelectRows places each read of its selections' counts (:class:`~fxpasses.runtime.select.CheckCounts`)
as late as is safe in the traced graph's order, and reads whose counts are computed before an
earlier read's place share it. Fusing CaptureLoss's regions changes that order: in the real
criterion one region computes the assigner's count and the keypoint levels' counts, so their two
reads follow each other with no GPU work between, and each still waits. A read whose counts
(and capacities) are all computed before the read just before it joins that one: one
:class:`~fxpasses.runtime.select.StartCounts` over both reads' counts, queued after the last of
them, and one CheckCounts that checks both, as one read of SelectRows checks several (every
count fits first, then the guards read with the counts, then no selection is empty); its results
go where each read's went. Reading earlier is as safe as reading at the place SelectRows chose
(nothing before that place shows or suffers from a count), and the later read's guards see their
counts read in the same read, which their deferral allows.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from ..analysis.meta import ANNOTATED, input_names
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from ..runtime.select import CheckCounts, StartCounts


def _reads(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, CheckCounts)]


def _source(node: fx.Node) -> fx.Node:
    """The node that computes ``node``'s value: through ``getitem`` of a tuple (a fused region's
    outputs, which the graph takes apart after it, in any order), the node that made the tuple."""
    while node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _computed_before(read: fx.Node, place: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether everything ``read`` waits for (its capacities, its counts) is computed before ``place``."""
    started = read.args[-1]
    needed = [a for a in read.args[:-1] if isinstance(a, fx.Node)] + list(started.all_input_nodes)
    return all(order[_source(n)] < order[place] for n in needed)


def _taken_apart_after(node: fx.Node, parts: list[fx.Node], order: dict[fx.Node, int],
                       later_than: fx.Node | None = None) -> fx.Node:
    """Move the ``getitem`` links of each of ``parts`` that the graph places after ``later_than``
    (default ``node``; the tuples they take apart are computed before ``node``) to right after
    ``node``; the last node so placed (``node`` if none moved)."""
    cursor, bound = node, order[later_than if later_than is not None else node]
    for part in parts:
        chain = []
        while part.op == "call_function" and part.target is operator.getitem and isinstance(part.args[0], fx.Node):
            chain.append(part)
            part = part.args[0]
        for link in reversed(chain):
            if order[link] > bound:
                cursor.append(link)
                cursor = link
    return cursor


def merge_reads(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Merge each read into the one before it where its counts are ready there (see the module
    docstring), in place; a certificate per merge."""
    certificates = []
    while True:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        reads = _reads(gm.graph)
        pair = next(((a, b) for a, b in zip(reads, reads[1:]) if _computed_before(b, a, order)), None)
        if pair is None:
            return certificates
        certificates.append(_merge(gm, pass_name, *pair, order))


def _merge(gm: fx.GraphModule, pass_name: str, first: fx.Node, second: fx.Node,
           order: dict[fx.Node, int]) -> Certificate:
    graph = gm.graph
    starts = (first.args[-1], second.args[-1])
    kept = [len(r.target.selections) for r in (first, second)]
    counts = [*starts[0].args[:kept[0]], *starts[1].args[:kept[1]],  # counts, then the truths
              *starts[0].args[kept[0]:], *starts[1].args[kept[1]:]]
    merged_id = f"{first.target.op_id}_{second.target.op_id.rsplit('_', 1)[-1]}"  # check_counts_0_1
    last = max((_source(c) for c in counts), key=order.__getitem__)  # the copy queued right after it
    with graph.inserting_after(_taken_apart_after(last, counts, order)):
        start = graph.call_function(StartCounts(merged_id.replace("check", "start", 1)), tuple(counts))
    op = CheckCounts(merged_id, [*first.target.selections, *second.target.selections],
                     [*first.target.guards, *second.target.guards],
                     (*first.target.check_points, *second.target.check_points))
    _taken_apart_after(first.prev, [a for a in second.args[:-1] if isinstance(a, fx.Node)], order, first)
    with graph.inserting_before(first):
        check = graph.call_function(op, (*first.args[:-1], *second.args[:-1], start))
    start.meta = dict(starts[1].meta)
    check.meta = dict(first.meta)
    check.meta["val"] = (*first.meta.get("val", ()), *second.meta.get("val", ()))
    for node in (start, check):
        node.meta[ANNOTATED] = input_names(node)
    for read, offset in ((first, 0), (second, kept[0])):
        for user in list(read.users):
            if user.target is not operator.getitem:  # (SelectRows' reads have getitem users only)
                raise AssertionError(f"{user.name} reads {read.name} other than by position")
            user.args = (check, offset + user.args[1])
            user.meta[ANNOTATED] = input_names(user)
    location = node_location(first)
    site = Site((first.name, second.name), (location,) if location else (),
                f"count reads {first.name} and {second.name}: one wait")
    checks = [Check("counts-ready-at-the-first-read", True, {
        "second_read_counts": tuple(n.name for n in starts[1].all_input_nodes),
        "evidence": "in the fused graph's order each is computed before the first read"})]
    for node in (second, first, *starts):
        graph.erase_node(node)
    return Certificate.from_checks(pass_name, site, checks, effect={
        "read": f"{check.name} ({merged_id}) checks the selections of both reads in one wait",
        "order": "every count fits first, then the guards read with them, then no selection is empty"})
