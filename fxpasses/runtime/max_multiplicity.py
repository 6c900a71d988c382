"""The largest number of times any value occurs in an integer tensor, without a host read.

``x.unique(return_counts=True)[1].max()`` asks the host for ``unique``'s output length (on CUDA a
synchronisation) only to take a maximum. Each element's count is the number of elements equal to
it: up to :data:`PAIRWISE` elements, one comparison of every pair (three kernels, as ``unique``,
``to`` and ``max`` were); above, the longest run of the sorted values (``sort``, the run starts,
their running maximum). Both are exact for integers. An empty input has no largest count: native
``counts.max()`` raises there, or never gets there (Ultralytics' ``preprocess`` returns early on
no targets, a branch a pass may have moved this op before): the call is abandoned
(``largest-count-empty``) and runs natively, which does either.
"""

from __future__ import annotations

import torch

from ..ir.abandon import Abandon
from ..ir.runtime_op import RuntimeOp

# elements up to which each is compared with each (a batch's targets: a few hundred); the pairs'
# booleans then take at most 16 MiB
PAIRWISE = 1 << 12


class MaxMultiplicity(RuntimeOp):
    """``largest(x) -> counts.max()`` of ``x.unique(return_counts=True)``, a 0-dim int64 tensor.
    ``site``: the unique's source location."""

    pure = True
    grad_free = True

    def __init__(self, op_id: str, site: str = ""):
        super().__init__(op_id)
        self.site = site

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        if flat.numel() == 0:  # (a size: no host read)
            self.count_code("largest-count-empty")
            raise Abandon("largest-count-empty", self.site, "the largest count of no values", retrace=False)
        if flat.numel() <= PAIRWISE:
            return (flat.unsqueeze(0) == flat.unsqueeze(1)).sum(1).max()
        ordered = flat.sort().values
        starts = torch.diff(ordered, prepend=ordered[:1] - 1) != 0
        positions = torch.arange(ordered.numel(), device=ordered.device)
        return (positions - torch.where(starts, positions, 0).cummax(0).values + 1).max()

    def propagate(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((), dtype=torch.int64)
