"""Box geometry on xyxy boxes (the last dimension holds x1, y1, x2, y2); shapes broadcast."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def box_area(boxes: Tensor) -> Tensor:
    """Area of each box: ``(..., 4) -> (...)``."""
    return (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])


def box_ciou(box1: Tensor, box2: Tensor, eps: float = 1e-7) -> Tensor:
    """Complete IoU (Zheng et al. 2020) of broadcast box pairs: ``(..., 4), (..., 4) -> (..., 1)``.

    IoU minus the normalised centre distance and an aspect-ratio term, as in ultralytics'
    ``bbox_iou(..., CIoU=True)``. The aspect-ratio weight is a constant for the gradient; it is
    written with ``.detach()``, as ultralytics computes it under ``torch.no_grad()``: the same
    values and gradients.
    """
    b1_x1, b1_y1, b1_x2, b1_y2 = box1.chunk(4, -1)
    b2_x1, b2_y1, b2_x2, b2_y2 = box2.chunk(4, -1)
    w1, h1 = b1_x2 - b1_x1, (b1_y2 - b1_y1).clamp(min=eps)
    w2, h2 = b2_x2 - b2_x1, (b2_y2 - b2_y1).clamp(min=eps)
    inter = ((b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp(min=0)
             * (b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)).clamp(min=0))
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    enclosing_w = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
    enclosing_h = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
    diagonal2 = enclosing_w.pow(2) + enclosing_h.pow(2) + eps
    centre2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2).pow(2) + (b2_y1 + b2_y2 - b1_y1 - b1_y2).pow(2)) / 4
    aspect = (4 / math.pi**2) * ((w2 / h2).atan() - (w1 / h1).atan()).pow(2)
    weight = (aspect / (aspect - iou + (1 + eps))).detach()
    return iou - (centre2 / diagonal2 + aspect * weight)


def anchors_inside(anchors: Tensor, boxes: Tensor, eps: float = 1e-9) -> Tensor:
    """Whether each anchor lies strictly inside each box: ``(A, 2), (B, M, 4) -> (B, M, A)``."""
    top_left, bottom_right = boxes[:, :, None, :2], boxes[:, :, None, 2:]
    deltas = torch.cat((anchors - top_left, bottom_right - anchors), dim=-1)
    return deltas.amin(-1) > eps
