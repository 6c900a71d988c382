"""Seeded synthetic image batches for training :class:`PoseNetwork`: images and their targets.

    batch = make_image_batch(16, seed=step, image_size=640, device="cuda")
    out = network(batch.images)
    loss(loss_inputs(out, batch.targets))

Targets come from the generator :func:`make_batch` uses (same seed, same sizes: the same
targets). Images are drawn at 1/8 resolution on a CPU ``torch.Generator`` in float64 — noise,
with each object's box painted brighter and its visible keypoints as bright cells — and then
cast, moved and upsampled (nearest) on the target device: a seed gives the same images on every
device up to the dtype's rounding, and a fresh batch costs little host time at 640 px.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

from .batches import make_targets
from .inputs import PoseTargets

CELL = 8  # pixels per drawn cell


class ImageBatch(NamedTuple):
    images: Tensor  # (B, 3, S, S)
    targets: PoseTargets


def make_image_batch(batch_size: int = 4, *, seed: int = 0, image_size: int = 640,
                     num_keypoints: int = 17, max_objects: int = 20, num_classes: int = 1,
                     unlabelled: float = 0.3, poison: bool = True,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     ) -> ImageBatch:
    """A batch of images and targets; see the module docstring. ValueError on a bad size."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if image_size < 32 or image_size % 32:
        raise ValueError(f"image_size must be a positive multiple of 32, got {image_size}")
    g = torch.Generator().manual_seed(seed)
    targets = make_targets(g, batch_size, image_size, num_keypoints, max_objects, num_classes,
                       unlabelled, poison)
    cells = image_size // CELL
    images = 0.1 * torch.randn(batch_size, 3, cells, cells, generator=g, dtype=torch.float64)
    images = images + _painted(targets, cells)[:, None]
    images = images.to(device=device, dtype=dtype)
    images = F.interpolate(images, scale_factor=CELL, mode="nearest")

    def cast(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)

    return ImageBatch(images, tree_map(cast, targets))


def _painted(targets: PoseTargets, cells: int) -> Tensor:
    """(B, cells, cells): 0.5 inside each object's box, 1 on each visible keypoint's cell."""
    centres = (torch.arange(cells, dtype=torch.float64) + 0.5) * CELL
    x, y = centres[None, None, None, :], centres[None, None, :, None]
    boxes = torch.where(targets.valid[..., None], targets.boxes, -1.0)  # padding: no cell inside
    x1, y1, x2, y2 = (boxes[..., i, None, None] for i in range(4))
    inside = (x >= x1) & (x <= x2) & (y >= y1) & (y <= y2)  # (B, M, cells, cells)
    image = 0.5 * inside.any(1).to(torch.float64)
    points = targets.keypoints[targets.visible]  # (V, 2) finite pixels
    owner = torch.arange(targets.visible.shape[0])[:, None, None].expand_as(targets.visible)
    cell = (points / CELL).long().clamp(0, cells - 1)
    image[owner[targets.visible], cell[:, 1], cell[:, 0]] = 1.0
    return image
