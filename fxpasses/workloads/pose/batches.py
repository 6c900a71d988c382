"""Seeded synthetic batches for the dual-branch pose loss, at realistic or at tiny sizes.

:func:`make_batch` draws everything from one CPU ``torch.Generator`` in float64 and then casts, so
a seed gives the same batch on every machine, device and dtype (up to that dtype's rounding).

* anchors: strides 8, 16, 32 over a square image (640 px: 80² + 40² + 20² = 8400 anchors);
* targets: objects per image as in COCO person images (:func:`~fxpasses.workloads.counts.object_counts`:
  some images empty, most 1 to 4, a tail to ``max_objects``; nothing pinned), or ``counts`` as
  given; padded, as a data loader pads, to the most objects in any image of the batch (``M``
  changes from batch to batch, and is 0 when every image is empty); boxes are person-like
  (taller than wide) and lie inside the image; keypoints lie inside their box; about
  ``unlabelled`` of them are not visible, and with ``poison`` most of those carry NaN, +inf or
  -inf coordinates (the rest 0, COCO's convention), and padding rows have NaN boxes and keypoints;
* predictions, per branch with its own noise: anchors inside an object predict that object's box,
  keypoints and class with noise (realistic positives); the others predict a background box
  around the anchor and a low class score. Sigmas lie in (0.1, 0.9), as after a sigmoid.
  Prediction tensors are leaves that require grad.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from ..counts import object_counts
from .boxes import anchors_inside
from .inputs import BranchPrediction, PoseLossInputs, PoseTargets

STRIDES = (8, 16, 32)


def make_anchors(image_size: int, strides: tuple[int, ...] = STRIDES, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 ) -> tuple[Tensor, Tensor]:
    """Anchor centres (A, 2) in pixels and their strides (A, 1), level by level, row-major."""
    if image_size < max(strides):
        raise ValueError(f"image_size {image_size} is below the largest stride {max(strides)}")
    points, stride_rows = [], []
    for stride in strides:
        cells = image_size // stride
        centres = (torch.arange(cells, dtype=torch.float64) + 0.5) * stride
        y, x = torch.meshgrid(centres, centres, indexing="ij")
        points.append(torch.stack((x.flatten(), y.flatten()), -1))
        stride_rows.append(torch.full((cells * cells, 1), float(stride), dtype=torch.float64))
    return (torch.cat(points).to(device=device, dtype=dtype),
            torch.cat(stride_rows).to(device=device, dtype=dtype))


def make_batch(batch_size: int = 4, *, seed: int = 0, image_size: int = 640,
               num_keypoints: int = 17, max_objects: int = 20, num_classes: int = 1,
               unlabelled: float = 0.3, poison: bool = True, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, requires_grad: bool = True,
               counts: Tensor | Sequence[int] | None = None) -> PoseLossInputs:
    """A batch of loss inputs; see the module docstring for what is drawn and how.

    ``counts`` (batch_size,) fixes the objects per image instead of drawing them (a test that
    needs a pinned maximum passes it and says so); ValueError on a count outside [0, max_objects].
    """
    g = torch.Generator().manual_seed(seed)
    anchors, strides = make_anchors(image_size, dtype=torch.float64)
    targets = make_targets(g, batch_size, image_size, num_keypoints, max_objects, num_classes,
                       unlabelled, poison, counts)
    o2m, o2o = (_predictions(g, targets, anchors, strides, num_classes) for _ in range(2))

    def cast(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)

    def leaf(t: Tensor) -> Tensor:
        return cast(t).requires_grad_(requires_grad)

    return PoseLossInputs(tree_map(leaf, o2m), tree_map(leaf, o2o), tree_map(cast, targets),
                          cast(anchors), cast(strides))


def _counts(g: torch.Generator, batch_size: int, max_objects: int,
            counts: Tensor | Sequence[int] | None) -> Tensor:
    """Objects per image: drawn as in COCO person images, or ``counts`` checked."""
    if counts is None:
        return object_counts(g, batch_size, max_objects)
    counts = torch.as_tensor(counts, dtype=torch.long)
    if counts.shape != (batch_size,) or (counts < 0).any() or (counts > max_objects).any():
        raise ValueError(f"counts must be {batch_size} integers in [0, {max_objects}], "
                         f"got {counts.tolist()}")
    return counts


def make_targets(g: torch.Generator, batch_size: int, size: int, num_keypoints: int,
             max_objects: int, num_classes: int, unlabelled: float, poison: bool,
             counts: Tensor | Sequence[int] | None = None) -> PoseTargets:
    counts = _counts(g, batch_size, max_objects, counts)
    rows = int(counts.max()) if batch_size else 0  # padded as a data loader pads the batch
    shape = (batch_size, rows)
    valid = torch.arange(rows)[None] < counts[:, None]
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    wh = size * torch.stack((0.08 + 0.3 * rand(shape), 0.15 + 0.45 * rand(shape)), -1)
    top_left = rand(*shape, 2) * (size - wh)
    boxes = torch.cat((top_left, top_left + wh), -1)
    keypoints = top_left[:, :, None] + rand(*shape, num_keypoints, 2) * wh[:, :, None]
    visible = (rand(*shape, num_keypoints) >= unlabelled) & valid[..., None]
    classes = torch.randint(0, num_classes, shape, generator=g) * valid
    fills = torch.tensor([0.0, math.nan, math.inf, -math.inf] if poison else [0.0],
                         dtype=torch.float64)
    fill = fills[torch.randint(0, len(fills), keypoints.shape, generator=g)]
    keypoints = torch.where(visible[..., None], keypoints, fill)
    boxes = torch.where(valid[..., None], boxes, math.nan if poison else 0.0)
    return PoseTargets(boxes, classes, keypoints, visible, valid)


def _predictions(g: torch.Generator, targets: PoseTargets, anchors: Tensor, strides: Tensor,
                 num_classes: int) -> BranchPrediction:
    if targets.valid.shape[1] == 0:  # every image empty: one padding row that owns no anchor
        targets = tree_map(lambda t: torch.cat((t, t.new_zeros(t.shape[0], 1, *t.shape[2:])), 1),
                           targets)
    (batch_size, _), num_anchors = targets.valid.shape, anchors.shape[0]
    num_keypoints = targets.keypoints.shape[2]
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    valid = targets.valid[..., None]
    gt_boxes = torch.where(valid, targets.boxes, 0.0)
    inside = anchors_inside(anchors, gt_boxes) & valid  # (B, M, A)
    owner = (inside * rand(inside.shape)).argmax(1)  # (B, A): a random object containing the anchor
    owned = inside.any(1)[..., None]  # (B, A, 1)
    owner_box = gt_boxes.gather(1, owner[..., None].expand(-1, -1, 4))
    wh = owner_box[..., 2:] - owner_box[..., :2]
    jittered = owner_box + 0.1 * wh.repeat(1, 1, 2) * randn(batch_size, num_anchors, 4)
    half = strides * (1 + 3 * rand(batch_size, num_anchors, 1))
    boxes = torch.where(owned, jittered, torch.cat((anchors - half, anchors + half), -1))
    first, second = boxes[..., :2], boxes[..., 2:]
    boxes = torch.cat((first.minimum(second), first.maximum(second)), -1)
    labels = targets.classes.gather(1, owner)[..., None]
    scores = randn(batch_size, num_anchors, num_classes) - 6.0
    scores = scores + 6.0 * owned * torch.zeros_like(scores).scatter(-1, labels, 1.0)
    centre = (gt_boxes[..., :2] + gt_boxes[..., 2:])[:, :, None] / 2
    clean = torch.where(targets.visible[..., None], targets.keypoints, centre)
    index = owner[..., None, None].expand(-1, -1, num_keypoints, 2)
    kpt_shape = (batch_size, num_anchors, num_keypoints, 2)
    near = clean.gather(1, index) + 0.03 * wh[:, :, None] * randn(*kpt_shape)
    far = anchors[:, None] + 2 * strides[:, None] * randn(*kpt_shape)
    return BranchPrediction(
        scores=scores,
        boxes=boxes,
        keypoints=torch.where(owned[..., None], near, far),
        visibility=2 * randn(batch_size, num_anchors, num_keypoints),
        sigmas=0.1 + 0.8 * rand(*kpt_shape))
