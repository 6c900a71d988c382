"""A loss that packs its targets per image into a zero buffer sized from data (outside the test
modules: pytest's assertion rewriting makes a test module's ``len`` and ``int`` loads non-calls,
so a loss defined there keeps the builtins and guards its sizes exactly)."""

import torch
from torch import nn


class Packed(nn.Module):
    """Targets packed per image (as Ultralytics' ``_batch_keypoints``), then a loss over
    (images, slots, anchors) that masks the empty slots; ``mean_over_slots`` reads them;
    ``exact_slot_weights`` multiplies by weights built at the exact count (padded, the shapes
    do not broadcast); ``follow`` packs as Ultralytics' ``preprocess`` does (the size a 0-dim
    tensor, ``torch.zeros(b, counts.max(), k)``) and adds a second zero buffer sized from the
    first one's shape, as its assigner does (``torch.zeros((b, gt_bboxes.shape[1], anchors))``)."""

    def __init__(self, mean_over_slots: bool = False, exact_slot_weights: bool = False,
                 follow: bool = False):
        super().__init__()
        self.mean_over_slots = mean_over_slots
        self.exact_slot_weights = exact_slot_weights
        self.follow = follow
        self.head = nn.Linear(1, 1, dtype=torch.float64)  # a module a network may share

    def forward(self, preds, batch_idx, values):
        images = preds.shape[0]
        counts = torch.bincount(batch_idx, minlength=images)
        if self.follow:
            packed = torch.zeros(images, counts.max(), 1, dtype=values.dtype)
        else:
            packed = values.new_zeros((images, int(counts.max()), 1))
        within = torch.arange(len(batch_idx)) - (counts.cumsum(0) - counts)[batch_idx]
        packed[batch_idx, within] = values
        present = (packed != 0).float()
        if self.exact_slot_weights:
            present = present * values.new_ones((images, int(counts.max()), 1))
        error = ((preds.unsqueeze(1) - packed).square() * present).sigmoid()
        error = self.head(error.unsqueeze(-1)).squeeze(-1)
        if self.follow:
            scores = torch.zeros((images, packed.shape[1], preds.shape[1]), dtype=values.dtype)
            scores += error.detach() * present
            error = error + scores.exp() * present
        if self.mean_over_slots:
            return error.mean() + preds.tanh().sum()
        return (error * present).sum() / present.sum().clamp_min(1) + preds.tanh().sum()
