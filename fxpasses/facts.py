"""Facts one pass proves about a node and another pass relies on, kept in ``node.meta``.

A fact names the certificate that proved it (``Certificate.id``), like an analysis result in
LLVM's analysis manager: the pass that uses it does not re-derive it, does not read the other
pass's run-time objects, and cites the proof in its own certificate. Facts travel with the node
through the pipeline's graph copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

PROVEN = "fxpasses.proven"  # node.meta key: {fact kind: fact}


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


def prove(node: fx.Node, fact: RowIndependentCall) -> None:
    node.meta.setdefault(PROVEN, {})[fact.kind] = fact


def proven(node: fx.Node, kind: str) -> RowIndependentCall | None:
    return node.meta.get(PROVEN, {}).get(kind)
