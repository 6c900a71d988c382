"""Outputs the caller keeps own their memory: nothing a later replay writes reaches the caller.

    # own(x) == x   (a copy where x's memory is a recording's static memory)

CaptureLoss puts one :class:`OwnedOutputs` before the graph's output. At run time it checks each
output tensor's storage against the static memory of every recording of the graph's regions and
clones exactly those: an output that is (a view of) a replayed buffer, however it got there —
through a view, ``swapaxes``, an identity function, a paired call's split — is copied; every
other output is returned as it is. The check is exact (storage pointers, not an analysis of which
ops may alias), and cheap: one set lookup per output tensor.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..ir.runtime_op import RuntimeOp
from .capture import CapturedRegion


class OwnedOutputs(RuntimeOp):
    """``own(*outputs) -> outputs``, with every output in graph memory cloned."""

    pure = True

    def __init__(self, op_id: str, regions: Sequence[CapturedRegion]):
        super().__init__(op_id)
        self.regions = tuple(regions)

    def propagate(self, *outputs: Any) -> tuple[Any, ...]:
        return outputs

    def __call__(self, *outputs: Any) -> tuple[Any, ...]:
        memory = frozenset().union(*(r.memory() for r in self.regions))
        owned = []
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in memory:
                self.count("outputs-copied")
                out = out.clone()
            owned.append(out)
        return tuple(owned)
