"""``torch.bincount(x, minlength=m)`` without its two host reads, its bound checked at the next one.

On CUDA ``bincount`` reads ``x.min()`` (it refuses negatives) and ``x.max()`` (its length is
``max(m, x.max() + 1)``) on the host: two synchronisations. Where every value of ``x`` lies in
``[0, m)`` (the image index of each target, counted per image of a batch of ``m``) the result is
``m`` bins, which an ``index_add_`` fills on the device without a read. :class:`BoundedBincount`
does that and says on the device whether the bound held; :class:`CheckedRead` is the read the
loss makes next (``int(counts.max())``) with that truth in the same transfer: where the bound did
not hold it abandons the call (``counts-out-of-range``, the call runs natively) before anything
computed from the counts is seen.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.abandon import Abandon
from ..ir.runtime_op import RuntimeOp


# bins times values up to which the counts compare each value with each bin (a batch's images
# and targets: far below); above, an index_add_, which torch's deterministic mode warns about
COMPARED = 1 << 22


class BoundedBincount(RuntimeOp):
    """``bincount(x, m) -> (counts, in_range)``: ``torch.bincount(x, minlength=m)`` where every
    value of ``x`` lies in ``[0, m)``, and whether they all did (a 0-dim bool tensor). A value out
    of the bound is not counted, or (above :data:`COMPARED`) counted in the nearest bin: a count
    is then wrong, never an index out of memory. Not captured: its input's length is the targets'
    count, new in most calls (a recording each)."""

    pure = True
    grad_free = True

    def __call__(self, x: torch.Tensor, minlength: int) -> tuple[torch.Tensor, torch.Tensor]:
        in_range = ((x >= 0) & (x < minlength)).all()
        if minlength * x.numel() <= COMPARED:  # each bin against each value: no atomics, deterministic
            bins = torch.arange(minlength, device=x.device, dtype=x.dtype)
            return (x.unsqueeze(0) == bins.unsqueeze(1)).sum(1), in_range
        counts = torch.zeros(minlength, dtype=torch.int64, device=x.device)
        if minlength > 0:
            counts.index_add_(0, x.clamp(0, minlength - 1).long(), torch.ones_like(x, dtype=torch.int64))
        return counts, in_range

    def propagate(self, x: torch.Tensor, minlength: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_zeros(minlength, dtype=torch.int64), x.new_ones((), dtype=torch.bool)


class CheckedRead(RuntimeOp):
    """``read(value, in_range) -> value.item()``, both read in one transfer; abandons the call
    (``counts-out-of-range``) where ``in_range`` is false. ``site``: the bincount's location."""

    pure = True
    grad_free = True
    host_reads = (0, 1)  # the arguments it reads on the host (a prefetch may read them earlier)

    def __init__(self, op_id: str, site: str):
        super().__init__(op_id)
        self.site = site

    def __call__(self, value: torch.Tensor, in_range: torch.Tensor, prefetched: Any = None, at: int = 0) -> int:
        """``prefetched``: a :class:`~fxpasses.runtime.select.PendingCounts` whose values from
        ``at`` on are ``value`` and ``in_range``, read earlier with other reads in one transfer."""
        if prefetched is not None:
            read, held = prefetched.values()[at:at + 2]
        else:
            read, held = torch.stack([value.reshape(()).to(torch.int64), in_range.to(torch.int64)]).tolist()
        if not held:
            self.count_code("counts-out-of-range")
            raise Abandon("counts-out-of-range", self.site, "a value counted by bincount lies outside "
                          "[0, minlength)", retrace=False)
        return read

    def propagate(self, value: torch.Tensor, in_range: torch.Tensor, prefetched: Any = None, at: int = 0) -> Any:
        return value.item()
