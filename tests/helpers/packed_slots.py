"""A loss that packs rows per image into slots sized from data and reads them back at the selected
rows' (image, slot) (outside the test modules, as ``packed_targets.py`` is: there ``int`` stays
symbolic)."""

import torch
from torch import nn


class IndexesPackedSlots(nn.Module):
    """Rows packed per image into slots sized by the most rows of an image (``int(counts.max())``,
    as the real loss packs its keypoints), read back at the selected rows' (image, slot) (as
    ``keypoints[masks.nonzero(as_tuple=True)[0], target_gt_idx[masks]]``)."""

    def forward(self, x, mask, image, slot):
        counts = torch.bincount(image, minlength=3)
        packed = x.new_zeros((3, int(counts.max()), 2))
        packed[image, slot] = x.detach()
        rows = x[mask]
        return (packed[image[mask], slot[mask]] * rows).sum() + rows.pow(2).sum()
