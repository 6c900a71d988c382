"""A paired call whose single flow call runs inside a CUDA graph, on rows padded to a bucket.

    # f(cat(x, y, 0)) == cat(f(x), f(y), f(0))   when f maps each row from that row alone

The rows of a paired call have a data-dependent count, so the call cannot be recorded once. But
the row independence that licensed the pairing also licenses padding: append zero rows up to a
*bucket* (the next power of two, at least ``min_bucket``), run the recorded graph for that bucket,
and keep the first rows. The padded rows' outputs are dropped, so their gradient is exactly zero;
CaptureLoss checks at pass time that a zero row has finite values and derivatives, so those zero
gradients stay zero through the flow's parameters. Buckets bound the recordings (one per power of
two); the flow is an argument of the recorded region, so its parameters and buffers are in-place
inputs that receive their gradients.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..guards import SiteGuard
from .capture import REGION_GUARDS, SIGNATURE, CaptureRecorder, CapturedRegion
from .paired import PairedCall, guard_failure, split_rows

BUCKET_RECORDED = SiteGuard("bucket-recorded", "a recording exists for the padded row count (else record, "
                            "within budget, on the bucket's record_after-th call; natively until then)",
                            SIGNATURE.code)
PADDED_GUARDS = tuple(BUCKET_RECORDED if g is SIGNATURE else g for g in REGION_GUARDS)  # its region's


def bucket(rows: int, minimum: int) -> int:
    """The padded row count: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(rows - 1, 0).bit_length())


class CapturedPairedCall(PairedCall):
    """:class:`PairedCall` that replays its one call from a recording per row bucket."""

    def __init__(self, op_id: str, method: str, *, devices: Sequence[str] = ("cuda",),
                 min_bucket: int = 1024, max_recordings: int = 8, record_after: int = 1,
                 recorder: CaptureRecorder | None = None):
        super().__init__(op_id, method)
        self.devices = tuple(devices)
        self.min_bucket = min_bucket
        self.region = CapturedRegion(f"{op_id}_graph", self._scored, max_recordings=max_recordings,
                                     record_after=record_after, recorder=recorder, counters=self.counters,
                                     input_names=("flow", "padded rows"))

    @property
    def changes(self) -> Counter:
        """What each recording of its region after the first changed (see CapturedRegion)."""
        return self.region.changes

    def _scored(self, module: nn.Module, padded: torch.Tensor) -> Any:
        return self.bound(module)(padded)

    def __call__(self, module: nn.Module, *rows: torch.Tensor) -> tuple[Any, ...]:
        if guard_failure(rows) is not None or rows[0].device.type not in self.devices:
            return super().__call__(module, *rows)
        self.count_event("paired")
        counts = [r.shape[0] for r in rows]
        total = sum(counts)
        pad = rows[0].new_zeros((bucket(total, self.min_bucket) - total, *rows[0].shape[1:]))
        out = self.region(module, torch.cat([*rows, pad]))
        return split_rows(_first_rows(out, total), counts)


def _first_rows(out: Any, total: int) -> Any:
    return pytree.tree_map(lambda leaf: leaf[:total], out)
