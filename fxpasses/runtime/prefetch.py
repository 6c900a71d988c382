"""Scalars that later ops read on the host, copied there in one transfer.

:class:`Prefetch` starts the copy (:class:`~fxpasses.runtime.select.PendingCounts`: on CUDA a
pinned buffer, a non-blocking copy and an event); the first op that takes its values waits for
it, the others reuse them (:mod:`fxpasses.passes.prefetch_reads`).
"""

from __future__ import annotations

import torch

from ..ir.runtime_op import RuntimeOp
from .select import PendingCounts


class Prefetch(RuntimeOp):
    """``prefetch(v_1, ...) -> PendingCounts``: the values of 0-dim integer or boolean tensors,
    on their way to the host."""

    pure = True
    grad_free = True

    def __call__(self, *values: torch.Tensor) -> PendingCounts:
        return PendingCounts(values)

    def propagate(self, *values: torch.Tensor) -> None:
        return None
