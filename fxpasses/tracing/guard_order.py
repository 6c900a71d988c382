"""Guards on sizes checked as early as their inputs allow: a call that fails one stops early.

A guard node is recorded where Python took a value, often long after the value could be known
(``nl, ne = targets.shape`` ... ``if nl == 0``). :func:`hoist_guards` moves each guard whose
decision reads only sizes (``size``, ``dim``, ``numel``) and Python arithmetic on them, with that
arithmetic, to just after the last node it needs; a size of a tensor made by an op that keeps its
input's shape (``x.float()``, ``x.to(device)``) is read from that input first, so a decision on
the inputs' sizes alone moves to the front of the graph. A guard that reads tensor data
(``mask.any()``, ``t.item()``) stays where it is: its value is read where the loss read it, past
every in-place write before it.

CaptureLoss applies it again once its reads are prefetched and its regions fused (each fused
where its last node was), which can leave a guard behind a region it does not need. A guard
moves only where every argument is such a decision (``ExpectEqualSizes`` compares two).

Moving a decision earlier changes no value: sizes and Python numbers are pure, and a failed guard
abandons the call either way (the native loss runs); only less work is wasted first.
"""

from __future__ import annotations

import torch.fx as fx

from ..analysis.size_decisions import decision, is_size_read, needs
from ..ir.trace_ops import GuardOp

# methods whose result has their input's shape (their sizes are their input's)
_SAME_SHAPE = frozenset("to float double half bfloat16 long int short bool contiguous clone detach "
                        "type_as".split())


def _forward_sizes(graph: fx.Graph) -> None:
    """``x.float().size(0)`` reads ``x.size(0)``: the size of a same-shape op's input."""
    for node in graph.nodes:
        if not is_size_read(node):
            continue
        source = node.args[0]
        while source.op == "call_method" and source.target in _SAME_SHAPE and isinstance(source.args[0], fx.Node):
            source = source.args[0]
        if source is not node.args[0]:
            node.args = (source, *node.args[1:])


def hoist_guards(graph: fx.Graph) -> dict[fx.Node, str]:
    """Move size guards forward (see the module docstring); returns where each guard sits:
    ``front`` (its decision reads the inputs' sizes alone), ``after <node>`` (moved up to the
    last node its decision needs) or ``where read`` (a decision on tensor data, or nothing to
    gain)."""
    _forward_sizes(graph)
    placed: dict[fx.Node, str] = {}
    for guard in [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, GuardOp)]:
        cone: dict[fx.Node, None] = {}
        needed = needs(cone) if guard.args and isinstance(guard.args[0], fx.Node) and not guard.kwargs \
            and all(decision(a, cone) for a in guard.args) else []
        if not needed:
            placed[guard] = "where read"
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        anchor = max(needed, key=order.__getitem__)
        before = order[guard]
        cursor = anchor
        for node in sorted([*cone, guard], key=order.__getitem__):
            if order[node] > order[anchor]:  # after the anchor: moved up, in their order
                cursor.append(node)
                cursor = node
        moved = {n: i for i, n in enumerate(graph.nodes)}[guard] < before
        front = all(n.op in ("placeholder", "get_attr") for n in needed)
        placed[guard] = "front" if front else f"after {anchor.name}" if moved else "where read"
    return placed
