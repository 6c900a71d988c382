"""A buffer's data-dependent size, rounded up to a capacity: one recording per power of two.

    # torch.zeros(b, n, k) -> torch.zeros(b, capacity(n), k)   capacity(0) == 0

The loss packs its targets per image into a zero buffer as long as the most objects in any image
(``n``, read from the data each call); images with fewer objects keep zero slots, which the loss
treats as padding. :class:`PaddedSize` gives that size as the power-of-two bucket of ``n`` (at
least ``min_bucket``), so the nodes over the buffer have a shape that is static for a recording
(:class:`~fxpasses.ir.proofs.BucketedSizes`) instead of one per value of ``n``; zero stays zero, so a
branch on the buffer being empty goes the same way. CaptureLoss pads only where a witness ran the
loss at both sizes (:mod:`fxpasses.passes.pad_capacity`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode

from ..ir.runtime_op import RuntimeOp
from .paired_capture import bucket


class PaddedSize(RuntimeOp):
    """``capacity(n) -> (C,)``: ``n`` (an int, or a 0-dim integer tensor read on the host as the
    factory would read it) rounded up to its bucket; ``padded`` False gives ``n`` itself (the
    witness's exact run)."""

    pure = True
    grad_free = True

    def __init__(self, op_id: str, site: str, min_bucket: int, traced: torch.SymInt | None = None):
        super().__init__(op_id)
        self.site = site
        self.min_bucket = min_bucket
        self.padded = True
        # the size symbol the buffer was propagated with, where nothing but the buffer holds it:
        # it then stands for the capacity, and the metadata below the buffer stays as it was
        self.traced = traced

    def __call__(self, size: Any) -> tuple[int]:
        count = int(size)  # a tensor: the host read torch.zeros(b, tensor) makes natively
        return (bucket(count, self.min_bucket) if self.padded and count > 0 else count,)

    def propagate(self, size: Any) -> tuple[torch.SymInt]:
        """The traced symbol in its own shape environment; else a fresh unbacked size (0, or at
        least ``min_bucket``: one recording per bucket)."""
        shape_env = detect_fake_mode().shape_env
        if self.traced is not None and self.traced.node.shape_env is shape_env:
            return (self.traced,)
        capacity = shape_env.create_unbacked_symint()
        torch._check(capacity >= 0)
        return (capacity,)
