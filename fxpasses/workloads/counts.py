"""Objects per image as in real person data (COCO ``person`` images), for every batch generator.

:func:`object_counts` draws each image's count independently: about 8 % of images are empty, most
hold 1 to 4 persons, and a geometric tail reaches ``max_objects``. Nothing is pinned, so the most
persons in one image (the padded size of the targets) changes from batch to batch, as in training.
A test that needs a fixed maximum pins it itself and says so by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

EMPTY = 0.08  # share of images without a person
FEW = 0.72  # share with 1 to 4 persons; the rest draws from the tail 5..max_objects


def object_counts(g: torch.Generator, batch_size: int, max_objects: int = 20, *,
                  min_objects: int = 0) -> Tensor:
    """(batch_size,) int64 counts in [min_objects, max_objects], drawn from ``g`` (see module)."""
    if max_objects < max(min_objects, 0) or min_objects < 0:
        raise ValueError(f"need 0 <= min_objects <= max_objects, got {min_objects}, {max_objects}")
    u = torch.rand(batch_size, generator=g, dtype=torch.float64)
    few = torch.randint(1, 5, (batch_size,), generator=g)
    # tail: 5 + geometric(p=0.3), so 5..8 hold most of it, 20 stays possible
    tail = 5 + torch.floor(torch.log(torch.rand(batch_size, generator=g, dtype=torch.float64))
                           / torch.log(torch.tensor(0.7, dtype=torch.float64))).long()
    counts = torch.where(u < EMPTY, 0, torch.where(u < EMPTY + FEW, few, tail))
    return counts.clamp(min_objects, max_objects)
