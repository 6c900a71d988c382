"""Count reads that follow one another, made one: the later read's count work moved before the earlier.

SelectRows reads each branch's counts where that branch first needs them. In the real criterion
the one-to-one branch's assigner, which computes its counts, follows the one-to-many branch's
read in the traced order: two waits for the device a step. Nothing the one-to-one counts need
comes from the one-to-many read, so that work can run before it, and the two reads become one
(:func:`~fxpasses.passes.merge_reads.merge_reads`).

For each pair of consecutive reads the nodes the later read's counts and capacities need that
the graph computes after the earlier read move before it, in their order, when each may run
there (:func:`~fxpasses.passes.hoisting.hoistable`: known effects, no write but to memory the
moved work made, no random draw, no host read, no conflict with a node it passes), none is a
check point of either read and none needs the earlier read's results. The checks and attribute
writes among that work move with it (an abandoned call undoes the writes, as at any place).
Each node runs in the grad mode it ran in (the Ultralytics assigner runs under
``@torch.no_grad()``): a ``_set_grad_enabled`` before each change of mode among the moved
nodes, and one back after them. Moving work that computes counts earlier changes no value; the
merged read checks every selection before anything that could show a count that does not fit,
as each read did. A certificate per pair: moved and merged, or why not.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.meta import ANNOTATED
from ..analysis.ops import NODE_FACTS, NodeFacts
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from ..runtime.select import CheckCounts
from .grad_switches import traced_grad_modes
from .hoisting import hoistable
from .merge_reads import merge_reads


def _reads(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, CheckCounts)]


def early_counts(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Move each later read's count work before the read before it and merge the two (see the
    module docstring), in place; a certificate per pair of reads."""
    certificates, tried = [], set()
    while True:
        reads = _reads(gm.graph)
        pair = next(((a, b) for a, b in zip(reads, reads[1:]) if b not in tried), None)
        if pair is None:
            return certificates
        first, second = pair
        tried.add(second)
        arguments = [a for a in second.args[:-1] if isinstance(a, fx.Node)] + list(second.args[-1].all_input_nodes)
        points = {*first.target.check_points, *second.target.check_points}
        needed, why = hoistable(arguments, first, second, set(), across_modes=True, with_effects=True,
                                refuse=lambda n: "is a check point" if n.name in points else None)
        site = Site((first.name, second.name), tuple(filter(None, [node_location(second)])),
                    f"count reads {first.name} and {second.name}")
        if why is None:
            why = _move_keeping_modes(gm, first, needed)
        if why is None:
            merged = merge_reads(gm, pass_name)
            why = None if merged else "moved, yet the reads stayed two"
        else:
            merged = []
        check = Check("count-work-moved", why is None, {
            "nodes_moved_before_the_first": len(needed) if why is None else 0, "why": why},
            None if why is None else "count-work-not-moved")
        certificates.append(Certificate.from_checks(pass_name, site, [check]))
        certificates += merged


def _move_keeping_modes(gm: fx.GraphModule, first: fx.Node, nodes: list[fx.Node]) -> str | None:
    """Move ``nodes`` (in graph order) to just before ``first``, each in the grad mode it ran in:
    a ``_set_grad_enabled`` before each change of mode among them, and one back to ``first``'s
    mode after them. None, or why not (a mode the trace did not record as a constant)."""
    modes = traced_grad_modes(gm, list(gm.graph.nodes))
    if not all(isinstance(modes[n], bool) for n in (first, *nodes)):
        return "a grad mode the trace did not record as a constant"
    current = modes[first]
    for node in [*nodes, None]:
        wanted = modes[first] if node is None else modes[node]
        if wanted != current:
            with gm.graph.inserting_before(first):
                switch = gm.graph.call_function(torch._C._set_grad_enabled, (wanted,))
            switch.meta[NODE_FACTS] = NodeFacts((), False, frozenset(), False, False, False, True, True)
            switch.meta[ANNOTATED] = ()
            current = wanted
        if node is not None:
            first.prepend(node)
    return None
