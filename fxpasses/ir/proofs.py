"""Proofs: what one pass proves about a node and another pass relies on, kept in ``node.meta``,
and what those proofs rest on (the reads of calls kept whole, the assumptions rewrites rely on).

A proof names the certificate that made it (``Certificate.id``), like an analysis result in
LLVM's analysis manager: the pass that uses it does not re-derive it, does not read the other
pass's run-time objects, and cites the proof in its own certificate. Proofs travel with the node
through the pipeline's graph copies. (What an op does — its *facts*, read from torch's schemas —
is :mod:`fxpasses.analysis.ops`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch.fx as fx

PROVEN = "fxpasses.proven"  # node.meta key: {proof kind: proof}


@dataclass(frozen=True)
class RowIndependentCall:
    """The node computes ``method`` of the module at ``node.args[0]`` (a ``get_attr`` of
    ``module``) on each row tensor of ``node.args[1:]``, returning one result per argument; each
    output row depends on the same input row alone. So the rows may be stacked, split, or padded
    with extra rows whose outputs are dropped.
    """

    certificate: str
    module: str
    method: str

    kind = "row-independent-call"


@dataclass(frozen=True)
class BucketedSizes:
    """The node returns ``buckets`` capacities (power-of-two buckets of row counts), then as
    many counts. A shape whose data-dependent sizes are only such capacities is static for one
    recording: the buckets bound the recordings (a run-time op reads them; see SelectRows)."""

    certificate: str
    buckets: int

    kind = "bucketed-sizes"


Proof = Union[RowIndependentCall, BucketedSizes]


def prove(node: fx.Node, proof: Proof) -> None:
    node.meta.setdefault(PROVEN, {})[proof.kind] = proof


def proven(node: fx.Node, kind: str) -> Any:
    return node.meta.get(PROVEN, {}).get(kind)


KEPT_WHOLE = "fxpasses.kept_whole"  # node.meta key of a call kept whole: a frozen KeptWhole
RELIED_ON = "fxpasses.relied_on"  # gm.meta key: assumptions the applied rewrites depend on


@dataclass
class KeptWhole:
    """What the code of a call kept whole (a density method, a leaf module or function) read
    from the loss's state while the trace ran it, as the trace's assumptions (``reads``; not
    the trace's own: its graph calls the code, which reads them live), and where it wrote the
    loss's Python state (``writes``: ``source at file:line``). A rewrite whose proof ran that
    code (row independence, a witness) depends on them (:func:`rely_on`)."""

    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)

    def frozen(self) -> "KeptWhole":
        return KeptWhole(_unique(self.reads), tuple(dict.fromkeys(self.writes)))


def kept_whole(nodes: Sequence[fx.Node]) -> KeptWhole:
    """The union over ``nodes`` of what their kept-whole calls read and wrote."""
    parts = [n.meta.get(KEPT_WHOLE) for n in nodes]
    return KeptWhole([r for p in parts if p for r in p.reads],
                     [w for p in parts if p for w in p.writes]).frozen()


def rely_on(gm: fx.GraphModule, assumptions: Sequence[Any]) -> None:
    """Record that a rewrite of ``gm`` holds only while ``assumptions`` do: the specialization
    checks them before every call (a change retraces, and the proof runs again)."""
    gm.meta[RELIED_ON] = _unique([*gm.meta.get(RELIED_ON, ()), *assumptions])


def relied_on(gm: fx.GraphModule) -> tuple:
    return tuple(gm.meta.get(RELIED_ON, ()))


def _unique(items: Sequence[Any]) -> tuple:
    """``items`` without repeats, by identity (a trace makes one object per assumption)."""
    return tuple({id(i): i for i in items}.values())
