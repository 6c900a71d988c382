"""A loss that reads two sizes from its targets, as Ultralytics' keypoint packing (loss.py:790)
and box packing (loss.py:405) do (outside the test modules: pytest's assertion rewriting makes a
test module's ``len`` and ``int`` loads non-calls, so a loss defined there guards its sizes exactly)."""

import torch
from torch import nn


class TwoPackings(nn.Module):
    """Keypoints packed per image through ``bincount`` and ``int(counts.max())``, boxes through
    ``unique(return_counts=True)`` and ``torch.zeros(b, counts.max(), 4)``; zero slots inert.
    ``write_between``: the boxes' image indices are written in place (``add_(0)``) after the
    first read; ``bump_after``: the boxes' size is computed before the first read and written in
    place through a view (``add_(1)``, one more slot) after it; ``guard_empty``: a batch without
    targets returns before the boxes are packed, as Ultralytics' ``preprocess`` does
    (``if nl == 0``, loss.py:396: ``counts.max()`` of no targets raises)."""

    def __init__(self, write_between: bool = False, bump_after: bool = False, guard_empty: bool = False):
        super().__init__()
        self.write_between = write_between
        self.bump_after = bump_after
        self.guard_empty = guard_empty

    def forward(self, pred, batch_idx, boxes, kpts):
        b = pred.shape[0]
        if self.bump_after:
            _, early_counts = batch_idx.unique(return_counts=True)
            slots = early_counts.max()
        counts = torch.bincount(batch_idx, minlength=b)
        packed_kpts = kpts.new_zeros((b, int(counts.max()), 3))
        within = torch.arange(len(batch_idx), device=batch_idx.device) - (counts.cumsum(0) - counts)[batch_idx]
        packed_kpts[batch_idx, within] = kpts
        if self.guard_empty and len(batch_idx) == 0:
            return (pred[:, None, :3] * packed_kpts).sum() + pred.sum() * 0
        images = batch_idx.clone()
        if self.write_between:
            images.add_(0)
        if self.bump_after:
            slots.view(1).add_(1)  # through a view: ``slots`` is still the node computed before
        else:
            _, box_counts = images.unique(return_counts=True)
            slots = box_counts.max()
        packed_boxes = torch.zeros(b, slots, 4, dtype=pred.dtype, device=pred.device)
        packed_boxes[batch_idx, within] = boxes
        return (pred[:, None, :3] * packed_kpts).sum() + (pred[:, None, 3:] * packed_boxes).sum()
