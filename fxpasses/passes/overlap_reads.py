"""Work that does not need a count read's counts, issued while their copy travels to the host.

A count read waits (:class:`~fxpasses.runtime.select.CheckCounts`: an event recorded after the
counts' copy) for the GPU work queued before its :class:`~fxpasses.runtime.select.StartCounts`;
the host issues nothing meanwhile. In the real criterion, after the one-to-many branch's read
come the one-to-one branch's target packing and anchors: dozens of eager ops and run-time
checks that need neither the counts nor anything computed from them. Issued before the read,
their host time overlaps the wait, and their GPU work queues after the copy, which does not wait
for it.

A node after a read, up to the next read or grad-mode switch (a node moved past one would run
in the other mode), moves to just before the read, in its order among the moved ones, when:

- none of its inputs is the read or a node after it that stays (so nothing it computes depends
  on the counts, or on what does);
- it is not a check point of the read (a node that could show or suffer from a count that does
  not fit must follow the read: :mod:`fxpasses.passes.select_rewrite`), nor a fused region that
  holds one;
- its effects are known, it draws no random numbers (a call the read abandons runs natively
  after it: the draw would be made twice) and writes no memory the loss did not make (an input,
  a parameter, a buffer: a call the read abandons could not unsee the write);
- it does not conflict (:func:`fxpasses.analysis.order.conflict`: memory one writes and the
  other touches, random draws, attributes) with the read or with any node it passes that stays.

A call that the read abandons has run the moved nodes too: pure ones are dropped with it, and
attribute writes are undone as for any abandoned call (``undone_on_failure``). A certificate per
read that nodes follow says what moved and, by reason, what stayed. Written by hand: torch.fx
has no scheduler.
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

from ..analysis.capture import is_grad_switch, local_write_candidates
from ..analysis.capture_rules import op_name
from ..analysis.fused_order import fused_places
from ..analysis.order import Effects, conflict, effects
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from ..runtime.grad_mode import GradOff, GradRestore
from ..runtime.select import CheckCounts, StartCounts

_READS = (StartCounts, CheckCounts)
_SWITCHES = (GradOff, GradRestore)


def overlap_reads(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Move the nodes after each count read of ``gm`` that do not need it to just before it
    (see the module docstring), in place; a certificate per read."""
    reads = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, CheckCounts)]
    if not reads:
        return []
    place = fused_places(gm)
    top = list(gm.graph.nodes)
    known: dict[fx.Node, Effects] = {}
    local = frozenset(local_write_candidates(gm.graph))
    found = [_overlap(pass_name, read, {top[place[name]] for name in read.target.check_points
                                        if name in place}, local, known) for read in reads]
    return [cert for cert in found if cert is not None]


def _overlap(pass_name: str, read: fx.Node, check_points: set[fx.Node], local: frozenset,
             known: dict[fx.Node, Effects]) -> Certificate | None:
    """The certificate of moving ``read``'s free nodes; None where nothing follows it before the
    next read or the output (no decision to take)."""
    window = []
    for node in _after(read):
        if node.op == "output" or _is_read(node) or _is_switch(node):
            break  # (a node moved past a grad-mode switch would run in the other mode)
        window.append(node)
    if not window:
        return None
    staying, stays = [read], {read}
    # the read touches no graph memory: it reads ints (the capacities) and the host copy its
    # StartCounts made (PendingCounts, no tensor of the graph), whose metadata says nothing
    known[read] = Effects(frozenset(), frozenset())
    moved: list[fx.Node] = []
    kept: Counter[str] = Counter()
    for node in window:
        reason = _why_it_stays(node, staying, stays, check_points, local, known)
        if reason is None:
            moved.append(node)
        else:
            kept[reason] += 1
            staying.append(node)
            stays.add(node)
    for node in moved:
        read.prepend(node)
    start = read.args[-1]
    location = node_location(read)
    site = Site((start.name, read.name), (location,) if location else (),
                f"nodes after count read {read.name}, issued while its counts travel")
    evidence = {"moved": len(moved), "window": len(window), "stayed": dict(kept),
                "moved_ops": dict(Counter(op_name(n) for n in moved).most_common(8)),
                "moved_lines": tuple(dict.fromkeys(filter(None, map(node_location, moved))))[:6]}
    checks = [Check("nodes-independent-of-the-read", bool(moved), evidence,
                    None if moved else "read-overlap-none")]
    effect = {"order": f"{len(moved)} node(s) issued between {start.name} and {read.name}: their host "
                       "time overlaps the wait for the counts"} if moved else {}
    return Certificate.from_checks(pass_name, site, checks, effect=effect)


def _after(node: fx.Node):
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _why_it_stays(node: fx.Node, staying: list[fx.Node], stays: set[fx.Node], check_points: set[fx.Node],
                  local: frozenset, known: dict[fx.Node, Effects]) -> str | None:
    """Why ``node`` may not move before the read (``staying[0]``) past ``staying``, or None;
    ``local``: the writes of memory the loss made itself."""
    if any(arg in stays for arg in node.all_input_nodes):
        return "needs the read or a node that stays"
    if node in check_points:
        return "check point of the read"
    mine = _effects(node, known)
    if mine.unknown:
        return "effects unknown"
    if mine.random:
        return "draws random numbers"
    if mine.writes and node not in local:
        return "writes memory the loss did not make"
    for other in staying:
        if conflict(mine, _effects(other, known)) is not None:
            return "conflicts with the read" if other is staying[0] else "conflicts with a node it passes"
    return None


def _effects(node: fx.Node, known: dict[fx.Node, Effects]) -> Effects:
    if node not in known:
        known[node] = effects(node)
    return known[node]


def _is_read(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, _READS)


def _is_switch(node: fx.Node) -> bool:
    return is_grad_switch(node) or (node.op == "call_function" and isinstance(node.target, _SWITCHES))
