"""May two nodes of a graph swap places? Memory, random state and attributes say.

A rewrite that moves a node past another (pairing two calls moves the first call's users after
the second) keeps the program's meaning when the two do not *conflict*: neither writes memory the
other reads or writes (storages from the nodes' fake-tensor metadata, writes from the ops they
ran: :mod:`fxpasses.analysis.ops`), they do not both draw random numbers, and they do not both
touch Python attributes. A node whose effects are unknown (user code, a node shape propagation
never reached whose schema allows writes) conflicts with everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir.runtime_op import RuntimeOp
from ..ir.trace_ops import ReadSource, WriteAttribute
from .meta import storages_of
from .ops import may_write_inputs, node_facts

@dataclass(frozen=True)
class Effects:
    """What a node touches: storages read and written (None: unknown), random draws, attributes."""

    reads: frozenset[int] | None
    writes: frozenset[int] | None
    random: bool = False
    attributes: bool = False

    @property
    def unknown(self) -> bool:
        return self.writes is None


def effects(node: fx.Node) -> Effects:
    reads = _reads(node)
    if not node.op.startswith("call_") or node.target is torch._C._set_grad_enabled:
        return Effects(reads, frozenset())  # grad-mode switches are compared separately
    if isinstance(node.target, (ReadSource, WriteAttribute)):
        return Effects(reads, frozenset(), attributes=True)
    if isinstance(node.target, RuntimeOp):
        return Effects(reads, frozenset() if node.target.pure else None)
    facts = node_facts(node)
    if facts is None or not facts.complete:  # never propagated: what its schema allows
        return Effects(reads, None if may_write_inputs(node) or node.is_impure() else frozenset())
    if not facts.torch_code or node.is_impure():
        return Effects(reads, None)
    return Effects(reads, facts.writes, random=facts.random)


def _reads(node: fx.Node) -> frozenset[int] | None:
    """Storages of the node's tensor inputs; None when an input computed by the graph has no
    metadata (what it aliases is unknown)."""
    storages: set[int] = set()
    for arg in node.all_input_nodes:
        if "val" not in arg.meta and arg.op.startswith("call"):
            return None
        storages |= storages_of(arg)  # a real tensor's, and its fake copy's that ops wrote
    return frozenset(storages)


def conflict(a: fx.Node | Effects, b: fx.Node | Effects) -> str | None:
    """Why ``a`` and ``b`` (nodes, or their :func:`effects` read once) may not swap places, or None."""
    ea, eb = (x if isinstance(x, Effects) else effects(x) for x in (a, b))
    if ea.unknown or eb.unknown:
        return "effects unknown"
    if ea.random and eb.random:
        return "both draw random numbers"
    if ea.attributes and eb.attributes:
        return "both touch attributes"
    for writer, other in ((ea, eb), (eb, ea)):
        if writer.writes and (other.reads is None or writer.writes & other.reads or writer.writes & other.writes):
            return "one writes memory the other reads or writes"
    return None
