"""The largest number of times any value occurs in an integer tensor, without a host read.

``x.unique(return_counts=True)[1].max()`` asks the host for ``unique``'s output length (on CUDA a
synchronisation) only to take a maximum. Each element's count is the number of elements equal to
it: up to :data:`PAIRWISE` elements, one comparison of every pair (three kernels, as ``unique``,
``to`` and ``max`` were); above, the longest run of the sorted values (``sort``, the run starts,
their running maximum). Both are exact for integers; an empty input raises at ``max()`` as the
native ``counts.max()`` does.
"""

from __future__ import annotations

import torch

from ..ir.runtime_op import RuntimeOp

# elements up to which each is compared with each (a batch's targets: a few hundred); the pairs'
# booleans then take at most 16 MiB
PAIRWISE = 1 << 12


class MaxMultiplicity(RuntimeOp):
    """``largest(x) -> counts.max()`` of ``x.unique(return_counts=True)``, a 0-dim int64 tensor."""

    pure = True
    grad_free = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        if flat.numel() <= PAIRWISE:
            return (flat.unsqueeze(0) == flat.unsqueeze(1)).sum(1).max()
        ordered = flat.sort().values
        starts = torch.diff(ordered, prepend=ordered[:1] - 1) != 0
        positions = torch.arange(ordered.numel(), device=ordered.device)
        return (positions - torch.where(starts, positions, 0).cummax(0).values + 1).max()

    def propagate(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((), dtype=torch.int64)
