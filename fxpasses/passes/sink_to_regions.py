"""Work a region computes only for a later region, moved into that later region.

    # region A: decode(preds) | barrier: packed[idx, within] = targets | region B: assign(decode, packed)
    #   ->  barrier | region B': decode(preds); assign(decode, packed)

CaptureLoss's regions never span a barrier (a node no region may hold: an in-place write whose
index varies in length per call, a host read). The trace orders work as the loss's source does:
the real criterion decodes each branch's predictions (loss.py:867-880, :919) before it packs its
targets (loss.py:786-793 and :405-410, in-place writes as long as the batch's persons), and the
assigner that reads both runs after the packing. So the decode is one region and the assigner
another, and the decoded keypoints (batch x anchors x 17 x 5 floats) cross from one to the
other: the producer's static output, the consumer's static copy of it, a gradient buffer on each
side, and a region's replay more on every call.

For two regions with barriers between them, the capturable nodes from the earlier region's
first node on (its own, and those between the barriers) that only the later side needs (each user
after the later region's first node, or itself moved) move to just before that node, in their
order, where each may: a call of known effects that writes no memory, draws no random number and
reads nothing on the host (a constant copied from the host on its first call only,
``RuntimeOp.made_once``, waits for nothing after), whose grad mode is the one in effect there,
and that conflicts (:func:`fxpasses.analysis.order.conflict`: memory, attributes) with no node it
passes. Pure work moved later, still before its first user, computes the same values. The
regions are planned again, and the move is kept only where they then receive and hand on fewer
tensors (static buffers; as many, in fewer regions), else the nodes go back. A certificate per
pair of regions: moved, or why not. Written by hand: torch.fx has no scheduler.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from ..analysis.capture import CapturePlan, is_grad_switch
from ..analysis.order import Effects, conflict, effects
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from .grad_switches import traced_grad_modes
from .hoisting import between, graph_order, why_it_stays


def sink_to_regions(gm: fx.GraphModule, plan: CapturePlan, pass_name: str,
                    replan: Callable[[], CapturePlan]) -> tuple[CapturePlan, list[Certificate]]:
    """Move into each later region the work done before it only for it (see the module
    docstring), in place, where the regions then hold fewer static buffers; the final plan, and a
    certificate per pair of regions with barriers between them."""
    certificates: list[Certificate] = []
    tried: set[tuple[str, ...]] = set()
    while True:
        order = graph_order(gm.graph)
        pairs = [(a, b) for a, b in zip(plan.regions, plan.regions[1:])
                 if _key(a, b) not in tried and any(plan.verdicts[n].barrier for n in between(a[-1].next, b[0]))]
        if not pairs:
            return plan, certificates
        earlier, later = pairs[0]
        tried.add(_key(earlier, later))
        movable = {n for n in between(earlier[0], later[0]) if plan.verdicts[n].capturable}
        moving, held = _sinkable(gm, earlier[0], movable, later[0], order)
        site = Site(tuple(n.name for n in (earlier[0], later[0])),
                    tuple(dict.fromkeys(filter(None, map(node_location, (earlier[0], earlier[-1], later[0]))))),
                    f"regions from {earlier[0].name} and from {later[0].name}")
        evidence: dict[str, Any] = {"earlier_region_nodes": len(earlier), "sinkable": len(moving),
                                    "held_back": dict(list(held.items())[:8])}
        if not moving:
            certificates.append(_certificate(pass_name, site, False, evidence, "nothing moves"))
            continue
        places = _move(moving, later[0])
        moved_plan = replan()
        before, after = _cost(plan), _cost(moved_plan)
        evidence |= {"regions_before": before[1], "regions_after": after[1],
                     "buffers_before": before[0], "buffers_after": after[0]}
        if after < before:
            certificates.append(_certificate(pass_name, site, True, evidence))
            plan = moved_plan
            tried.clear()  # the regions are new: each pair may be tried again (each success
            continue       # lowers the cost, a pair of natural numbers: this ends)
        _restore(places)  # the graph is as it was: so is its plan
        certificates.append(_certificate(pass_name, site, False, evidence, "no fewer static buffers"))


def _cost(plan: CapturePlan) -> tuple[int, int]:
    """(static buffers: tensors the regions receive or hand on, regions)."""
    return sum(plan.copies(r) for r in plan.regions), len(plan.regions)


def _key(earlier: list[fx.Node], later: list[fx.Node]) -> tuple[str, ...]:
    return (earlier[0].name, earlier[-1].name, later[0].name, later[-1].name)


def _sinkable(gm: fx.GraphModule, start: fx.Node, movable: set[fx.Node], dest: fx.Node,
              order: dict[fx.Node, int]) -> tuple[list[fx.Node], dict[str, str]]:
    """The nodes of ``movable`` (from ``start`` on) that may move to just before ``dest``, and
    why others may not."""
    nodes = list(gm.graph.nodes)
    modes = traced_grad_modes(gm, nodes)
    first = order[start]
    wanted = modes[dest.prev]  # the mode in effect just before dest (placeholders come first)
    moving: set[fx.Node] = set()
    staying = []  # (node, effects) of the nodes that stay between a candidate and dest
    held: dict[str, str] = {}
    for node in reversed(nodes[first:order[dest]]):
        mine = effects(node)
        why = _why_it_stays(node, mine, moving, dest, order, modes, wanted) if node in movable else "not capturable"
        if why is None:
            why = next((f"{reason}: {p.name}" for p, theirs in staying
                        if not is_grad_switch(p) and (reason := conflict(mine, theirs)) is not None), None)
        if why is None:
            moving.add(node)
            continue
        if node in movable and len(held) < 64:
            held[node.name] = why
        staying.append((node, mine))
    return sorted(moving, key=order.__getitem__), held


def _why_it_stays(node: fx.Node, found: Effects, moving: set[fx.Node], dest: fx.Node,
                  order: dict[fx.Node, int], modes: dict[fx.Node, Any], wanted: Any) -> str | None:
    """Why ``node`` may not move to just before ``dest``: a user before it, not a call or a
    grad-mode switch, another grad mode there, or hoisting's rule (:func:`~.hoisting.why_it_stays`,
    writing no memory at all)."""
    if any(u not in moving and order[u] < order[dest] for u in node.users):
        return "used before the later region"
    if not node.op.startswith("call") or is_grad_switch(node):
        return "is not a plain call"
    if modes[node] != wanted or not isinstance(wanted, bool):
        return "another grad mode than the later region's"
    return why_it_stays(node, found)


def _move(moving: list[fx.Node], dest: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """Move ``moving`` (in graph order) to just before ``dest``; (node, the node it followed)."""
    places = [(node, node.prev) for node in moving]
    for node in moving:
        dest.prepend(node)
    return places


def _restore(places: list[tuple[fx.Node, fx.Node]]) -> None:
    """Put moved nodes back after the nodes they followed (in graph order: each anchor is back first)."""
    for node, anchor in places:
        anchor.append(node)


def _certificate(pass_name: str, site: Site, applied: bool, evidence: dict, why: str | None = None) -> Certificate:
    check = Check("work-moved-into-later-region", applied, evidence | ({"refused": why} if why else {}),
                  None if applied else "work-not-moved-into-region")
    effect = {"moved": f"{evidence['sinkable']} node(s), to just before the later region",
              "static_buffers": f"{evidence['buffers_before']} -> {evidence['buffers_after']} tensors",
              "regions": f"{evidence['regions_before']} -> {evidence['regions_after']}"} if applied else {}
    return Certificate.from_checks(pass_name, site, [check], effect=effect)
