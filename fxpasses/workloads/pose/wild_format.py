"""The reference's inputs in the public format of :mod:`.wild`, and a stand-in model to build it.

``public_format(inputs) -> (preds, batch)`` encodes each branch's decoded predictions as the raw
head outputs that :class:`~.wild.WildPoseLoss` decodes (the inverse of its decoding), and the
padded targets as a dict batch of the batch's objects (the valid rows, image by image):

* box distances ``(anchor - x1y1, x2y2 - anchor) / stride``; keypoints
  ``(xy / stride - anchor + 0.5) / 2`` (anchor centres in grid units); sigmas ``logit(sigma)``;
  class and visibility logits as they are;
* ``bboxes`` normalised xywh, ``keypoints`` normalised x, y (unlabelled ones keep whatever they
  hold, NaN and inf included) with visibility 2.0 (labelled) or 0.0.

The encoding is differentiable, so gradients of the public loss reach the reference's prediction
tensors through it. Decoding what is encoded gives the reference's values up to rounding.

:class:`StandInModel` is the least a model needs for :class:`~.wild.WildPoseLoss`: ``args`` and a
``model`` list whose last module (:class:`StandInHead`) has ``nc``, ``kpt_shape``, ``stride``
and ``flow_model``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .batches import STRIDES, make_anchors
from .inputs import BranchPrediction, PoseLossInputs, PoseTargets
from .wild import pose_args


class StandInHead(nn.Module):
    """A pose head's attributes that the public loss reads; ``flow_model`` is the shared flow."""

    def __init__(self, flow: nn.Module, *, num_keypoints: int = 17, num_classes: int = 1,
                 strides: tuple[int, ...] = STRIDES) -> None:
        super().__init__()
        self.nc = num_classes
        self.kpt_shape = (num_keypoints, 5)  # x, y, visibility logit, two sigma logits
        self.stride = torch.tensor(strides, dtype=torch.float32)
        self.flow_model = flow


class StandInModel(nn.Module):
    """``model.args`` (:func:`~.wild.pose_args`) and ``model.model[-1]``, a :class:`StandInHead`."""

    def __init__(self, flow: nn.Module, *, num_keypoints: int = 17, num_classes: int = 1,
                 strides: tuple[int, ...] = STRIDES, **args) -> None:
        super().__init__()
        self.model = nn.ModuleList([StandInHead(flow, num_keypoints=num_keypoints,
                                                num_classes=num_classes, strides=strides)])
        self.args = pose_args(**args)


def public_format(inputs: PoseLossInputs) -> tuple[dict, dict]:
    """``(preds, batch)`` for :class:`~.wild.WildPoseLoss`; see the module docstring."""
    image_size, cells = anchor_grid(inputs.anchors, inputs.strides)
    preds = {name: encode_branch(getattr(inputs, branch), inputs.anchors, inputs.strides, cells)
             for name, branch in (("one2many", "o2m"), ("one2one", "o2o"))}
    return preds, public_batch(inputs.targets, image_size)


def anchor_grid(anchors: Tensor, strides: Tensor) -> tuple[int, list[int]]:
    """Image size and cells per side of each level, for the square grid of :func:`make_anchors`."""
    levels, counts = strides.squeeze(-1).unique_consecutive(return_counts=True)
    cells = [math.isqrt(int(count)) for count in counts]
    image_size = cells[0] * int(levels[0])
    expected, _ = make_anchors(image_size, tuple(int(s) for s in levels), dtype=anchors.dtype,
                               device=anchors.device)
    if expected.shape != anchors.shape or not torch.equal(expected, anchors):
        raise ValueError("public_format needs the square anchor grid of make_anchors (levels "
                         f"{levels.tolist()} with {counts.tolist()} anchors)")
    return image_size, cells


def encode_branch(pred: BranchPrediction, anchors: Tensor, strides: Tensor,
                  cells: list[int]) -> tuple[list[Tensor], Tensor]:
    """One branch as raw head outputs: per-level maps (B, 4 + C, H, W) and keypoints (B, 5K, A)."""
    grid = anchors / strides  # anchor centres in grid units
    distances = torch.cat((grid - pred.boxes[..., :2] / strides,
                           pred.boxes[..., 2:] / strides - grid), -1)
    maps = torch.cat((distances, pred.scores), -1).transpose(1, 2)  # (B, 4 + C, A)
    levels = maps.split([n * n for n in cells], -1)
    feats = [level.reshape(*level.shape[:2], n, n) for level, n in zip(levels, cells)]
    xy = (pred.keypoints / strides[:, None] - grid[:, None] + 0.5) / 2
    kpts = torch.cat((xy, pred.visibility[..., None], torch.logit(pred.sigmas)), -1)
    return feats, kpts.flatten(2).transpose(1, 2)


def public_batch(targets: PoseTargets, image_size: int) -> dict[str, Tensor]:
    """The valid rows of the padded targets as ultralytics' dict batch (normalised xywh)."""
    image, row = targets.valid.bool().nonzero(as_tuple=True)
    dtype = targets.boxes.dtype
    boxes = targets.boxes[image, row]
    xywh = torch.cat(((boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]), -1)
    visible = targets.visible[image, row].bool()
    labels = torch.where(visible, 2.0, 0.0).to(dtype)[..., None]
    return {"batch_idx": image.to(dtype),
            "cls": targets.classes[image, row][:, None].to(dtype),
            "bboxes": xywh / image_size,
            "keypoints": torch.cat((targets.keypoints[image, row] / image_size, labels), -1)}
