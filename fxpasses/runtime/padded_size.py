"""A buffer's data-dependent size, rounded up to a capacity that only grows: one recording.

    # torch.zeros(b, n, k) -> torch.zeros(b, capacity(n), k)   capacity(0) == 0

The loss packs its targets per image into a zero buffer as long as the most objects in any image
(``n``, read from the data each call); images with fewer objects keep zero slots, which the loss
treats as padding. :class:`PaddedSize` gives that size as the largest bucket of ``n`` (``n``
rounded up to a multiple of :data:`STEP`, at least ``min_bucket``) it has given so far, so the
nodes over the buffer have a shape that is static for a recording
(:class:`~fxpasses.ir.proofs.BucketedSizes`) instead of one per value of ``n``, and a batch whose
``n`` falls in a smaller bucket than an earlier one's replays the same recording (two buckets
taking turns held two recordings, each with its static buffers, and the GPU's memory of both);
zero stays zero, so a branch on the buffer being empty goes the same way. CaptureLoss pads only
where a witness ran the loss at both sizes (:mod:`fxpasses.passes.pad_capacity`).

Multiples of 8, not powers of two: every slot costs the assigner a row of each (images, slots,
anchors) tensor, and batches of 16 realistic images hold at most 6-13 persons in one image (20 in
the tail). Powers of two made that 32 slots; multiples of 8 make it 24 (measured on the CPU over
40 fresh batches of 16 at 640 px: static buffers 466 -> 427 MiB, step 0.52 -> 0.46 s), at the
cost of one more growth (a new recording) early in a fit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode

from ..ir.runtime_op import RuntimeOp

STEP = 8  # capacities are multiples of this


def capacity_for(count: int, minimum: int) -> int:
    """``count`` rounded up to a multiple of :data:`STEP`, at least ``minimum``."""
    return max(minimum, -(-count // STEP) * STEP)


class PaddedSize(RuntimeOp):
    """``capacity(n) -> (C,)``: ``n`` (an int, or a 0-dim integer tensor read on the host as the
    factory would read it) rounded up to its bucket, or to the largest bucket given before;
    ``padded`` False gives ``n`` itself (the witness's exact run)."""

    pure = True
    grad_free = True
    host_reads = (0,)  # the argument it reads on the host when a tensor (a prefetch may read it earlier)
    only_grows = True  # (0 aside: an empty buffer stays empty)

    def __init__(self, op_id: str, site: str, min_bucket: int, traced: torch.SymInt | None = None):
        super().__init__(op_id)
        self.site = site
        self.min_bucket = min_bucket
        self.padded = True
        self.largest = 0  # the largest capacity given
        # the size symbol the buffer was propagated with, where nothing but the buffer holds it:
        # it then stands for the capacity, and the metadata below the buffer stays as it was
        self.traced = traced

    def fresh_state(self) -> dict[str, Any]:
        return {"traced": None}  # propagation's, in a shape environment of the pipeline

    def __call__(self, size: Any, prefetched: Any = None, at: int = 0) -> tuple[int]:
        """``prefetched``: a :class:`~fxpasses.runtime.select.PendingCounts` whose value ``at``
        is ``size``, read earlier with other reads in one transfer."""
        # a tensor: the host read torch.zeros(b, tensor) makes natively
        count = prefetched.values()[at] if prefetched is not None else int(size)
        if not self.padded or count == 0:
            return (count,)
        self.largest = max(self.largest, capacity_for(count, self.min_bucket))
        return (self.largest,)

    def propagate(self, size: Any, prefetched: Any = None, at: int = 0) -> tuple[torch.SymInt]:
        """The traced symbol in its own shape environment; else a fresh unbacked size (0, or at
        least ``min_bucket``)."""
        shape_env = detect_fake_mode().shape_env
        if self.traced is not None and self.traced.node.shape_env is shape_env:
            return (self.traced,)
        capacity = shape_env.create_unbacked_symint()
        torch._check(capacity >= 0)
        return (capacity,)
