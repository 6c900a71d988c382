"""Which nodes may move before an earlier node with their values unchanged (the work a later
host read needs, moved before an earlier read so that the two wait once).

:func:`hoistable`: the nodes after ``first`` that some ``arguments`` need, when each may run
before ``first``: of known effects, writing no memory (or, where the caller moves the work's
effects with it, only memory the moving nodes made), drawing no random number, reading nothing on
the host (a constant copied from the host on its first call only, ``RuntimeOp.made_once``, waits
for nothing after), not passing a
grad-mode switch (or, where the caller moves each node with its mode, a constant one), and not
conflicting (:func:`fxpasses.analysis.order.conflict`: memory, attributes) with a node it passes;
and no node that stays between ``first`` and where the arguments are read may write what they
read. Users are :mod:`.prefetch_reads` and :mod:`.early_counts`. Written by hand: torch.fx has
no scheduler.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch.fx as fx

from ..analysis.capture import is_grad_switch
from ..analysis.graph import upstream
from ..analysis.meta import storages_of
from ..analysis.ops import node_facts
from ..analysis.order import Effects, conflict, effects
from .grad_switches import switch_mode


def graph_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's place in ``graph``."""
    return {n: i for i, n in enumerate(graph.nodes)}


def hoistable(arguments: Sequence[fx.Node], first: fx.Node, until: fx.Node, moving: set[fx.Node],
              refuse: Callable[[fx.Node], str | None] = lambda node: None,
              across_modes: bool = False, with_effects: bool = False) -> tuple[list[fx.Node], str | None]:
    """The nodes after ``first`` that ``arguments`` need (less ``moving``), in graph order, and why
    they cannot all run before ``first`` (None: they can; ``refuse`` may name a reason of its own)
    with the values they have at ``until``, where they are read: see the module docstring.
    ``across_modes``: the nodes may pass grad-mode switches (the caller moves them with their mode);
    ``with_effects``: the moving work's own effects move with it: writes to memory a moving node
    made (no other node sees it before), and the nodes without users among it (checks, attribute
    writes) whose inputs are computed by then."""
    order = graph_order(first.graph)
    ancestors = upstream(arguments) | set(arguments)
    if first in ancestors:
        return [], "needs the first read"
    needed = sorted((n for n in ancestors if order[n] > order[first] and n not in moving), key=order.__getitem__)
    if with_effects and needed:  # checks and attribute writes among the moving nodes
        moving_now = set(needed)

        def ready(arg: fx.Node) -> bool:  # computed before ``first``, or moving
            return order[arg] < order[first] or arg in moving_now

        followers = [n for n in between(first.next, needed[-1]) if not n.users and n not in moving_now
                     and not is_grad_switch(n) and all(ready(a) or a.op == "get_attr" for a in n.all_input_nodes)]
        constants = {a for n in followers for a in n.all_input_nodes if not ready(a)}  # (get_attr)
        needed = sorted({*needed, *followers, *constants}, key=order.__getitem__)
    # the nodes that stay between the reads, each one's effects read once
    chosen = set(needed)
    made = set().union(*(storages_of(n) - set().union(*(storages_of(a) for a in n.all_input_nodes))
                         for n in needed)) if with_effects else set()
    staying = [(p, effects(p)) for p in between(first, until) if p not in moving and p not in chosen]
    for node in needed:
        mine = effects(node)
        why = refuse(node) or why_it_stays(node, mine, frozenset(made))
        if why is None:
            why = next((f"{reason}: {p.name}" for p, theirs in staying if order[p] < order[node]
                        if (reason := _passing(mine, p, theirs, across_modes)) is not None), None)
        if why is not None:
            return [], f"{node.name} {why}"
    read_from = set().union(*(storages_of(a) for a in arguments))
    for step, found in staying:  # what the prefetch reads must be what the read would
        if found.unknown or found.writes & read_from:
            return [], f"{step.name} may write what it reads, between the reads"
    return needed, None


def between(first: fx.Node, node: fx.Node) -> Iterable[fx.Node]:
    """``first`` and the nodes after it, up to ``node`` (excluded), or to the graph's end where
    ``node`` does not follow ``first`` (two regions whose nodes interleave)."""
    step = first
    while step is not node and step.op != "root":
        yield step
        step = step.next


def why_it_stays(node: fx.Node, found: Effects, made: frozenset[int] = frozenset()) -> str | None:
    """Why ``node`` (its effects ``found``) may not run elsewhere than where it is, whatever it
    passes, or None: not a call, an unknown effect, a write (but to memory in ``made``), a random
    draw, a read on the host (a constant copied from the host on its first call only, ``made_once``,
    waits for nothing after), no metadata. Also the rule :mod:`.sink_to_regions` moves nodes by."""
    if node.op == "get_attr":  # (a constant of the graph module: read, never written)
        return None
    if not node.op.startswith("call"):
        return "is not a call"
    if getattr(node.target, "host_reads", ()):  # another read (moved, it would precede the prefetch)
        return "reads on the host"
    if found.unknown:
        return "has unknown effects"
    if found.writes and not found.writes <= made:
        return "writes memory"
    if found.random:
        return "draws random numbers"
    facts = node_facts(node)
    if facts is None:
        return "has no metadata"
    if facts.host_read and not getattr(node.target, "made_once", False):  # (a kept constant: no wait)
        return "reads on the host"
    return None


def _passing(mine: Effects, passed: fx.Node, theirs: Effects, across_modes: bool) -> str | None:
    if is_grad_switch(passed):
        return None if across_modes and switch_mode(passed) is not None else "would pass a grad-mode switch"
    return conflict(mine, theirs)
