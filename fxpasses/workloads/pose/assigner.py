"""Task-aligned assignment of anchors to padded ground truth (TOOD, Feng et al. 2021).

The alignment metric of anchor a and ground truth g is ``score(a, class(g))**alpha *
CIoU(box(a), g)**beta``, over anchors strictly inside g. Each ground truth takes its ``topk``
anchors by metric; an anchor taken by several keeps the one it overlaps most; target scores are
the one-hot class scaled so that each ground truth's best anchor scores that ground truth's best
overlap. Follows ultralytics' ``TaskAlignedAssigner``, with every shape static (B, M, A): no
masked assignment and no Python branch on tensor values, so it traces into the loss's graph.

An anchor whose metric is zero (its prediction does not overlap the ground truth, or its class
score underflows) is never positive: ties of zero metrics would otherwise pick arbitrary anchors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .boxes import anchors_inside, box_ciou
from .inputs import PoseTargets


class Assignment(NamedTuple):
    """Per-anchor targets; ``gt_index``, ``boxes`` are meaningful only where ``foreground``."""

    foreground: Tensor  # (B, A) bool
    gt_index: Tensor  # (B, A) int64 row of the assigned ground truth
    boxes: Tensor  # (B, A, 4) assigned ground-truth boxes (padding rows read as zeros)
    scores: Tensor  # (B, A, C) normalised target scores, zero off the foreground


class TaskAlignedAssigner(nn.Module):
    """Assigns anchors to ground truth; ``forward`` runs without gradients (see module docstring).

    Pass detached predictions, as public losses do; ``forward`` also runs under ``no_grad``
    (fxpasses' tracer records the switch as a graph node).
    """

    def __init__(self, topk: int = 10, alpha: float = 0.5, beta: float = 6.0,
                 eps: float = 1e-9) -> None:
        super().__init__()
        self.topk, self.alpha, self.beta, self.eps = topk, alpha, beta, eps

    @torch.no_grad()
    def forward(self, scores: Tensor, boxes: Tensor, anchors: Tensor,
                targets: PoseTargets) -> Assignment:
        """scores (B, A, C) probabilities, boxes (B, A, 4) xyxy, anchors (A, 2)."""
        if targets.boxes.shape[1] == 0:  # no target rows at all (not even padding)
            return _nothing_assigned(scores)
        valid = targets.valid.bool()
        gt_boxes = torch.where(valid[..., None], targets.boxes, 0.0)  # padding may hold NaN
        gt_classes = torch.where(valid, targets.classes, 0)
        candidates = anchors_inside(anchors, gt_boxes) & valid[..., None]  # (B, M, A)
        metric, overlaps = self._alignment(scores, boxes, gt_classes, gt_boxes, candidates)
        positive = self._top_candidates(metric) & candidates & (metric > 0)
        positive = self._resolve_multiple(positive, overlaps)
        return self._targets(scores, positive, metric, overlaps, gt_boxes, gt_classes)

    def _alignment(self, scores: Tensor, boxes: Tensor, gt_classes: Tensor, gt_boxes: Tensor,
                   candidates: Tensor) -> tuple[Tensor, Tensor]:
        """Alignment metric and CIoU of every (ground truth, anchor) pair: two (B, M, A)."""
        class_index = gt_classes[:, None, :].expand(-1, scores.shape[1], -1)  # (B, A, M)
        class_scores = scores.gather(2, class_index).transpose(1, 2)  # (B, M, A)
        overlaps = box_ciou(gt_boxes[:, :, None], boxes[:, None]).squeeze(-1).clamp(min=0)
        overlaps = torch.where(candidates, overlaps, 0.0)
        class_scores = torch.where(candidates, class_scores, 0.0)
        return class_scores.pow(self.alpha) * overlaps.pow(self.beta), overlaps

    def _top_candidates(self, metric: Tensor) -> Tensor:
        """The ``topk`` anchors of each ground truth by metric: (B, M, A) bool."""
        index = metric.topk(self.topk, dim=-1).indices
        return torch.zeros_like(metric, dtype=torch.bool).scatter(-1, index, True)

    @staticmethod
    def _resolve_multiple(positive: Tensor, overlaps: Tensor) -> Tensor:
        """An anchor positive for several ground truths keeps only the one it overlaps most."""
        several = positive.sum(1, keepdim=True) > 1  # (B, 1, A)
        best = torch.zeros_like(positive).scatter(1, overlaps.argmax(1, keepdim=True), True)
        return torch.where(several, best, positive)

    def _targets(self, scores: Tensor, positive: Tensor, metric: Tensor, overlaps: Tensor,
                 gt_boxes: Tensor, gt_classes: Tensor) -> Assignment:
        foreground = positive.any(1)  # (B, A)
        gt_index = positive.to(metric.dtype).argmax(1)  # (B, A)
        boxes = gt_boxes.gather(1, gt_index[..., None].expand(-1, -1, 4))
        labels = gt_classes.gather(1, gt_index)
        one_hot = torch.zeros_like(scores).scatter(-1, labels[..., None], 1.0)
        metric = metric * positive
        best_metric = metric.amax(-1, keepdim=True)  # (B, M, 1)
        best_overlap = (overlaps * positive).amax(-1, keepdim=True)
        norm = (metric * best_overlap / (best_metric + self.eps)).amax(1)  # (B, A)
        return Assignment(foreground, gt_index, boxes, one_hot * norm[..., None])


def _nothing_assigned(scores: Tensor) -> Assignment:
    """The assignment of a batch without ground truths: no anchor is foreground."""
    batch, anchors = scores.shape[:2]
    return Assignment(scores.new_zeros(batch, anchors, dtype=torch.bool),
                      scores.new_zeros(batch, anchors, dtype=torch.long),
                      scores.new_zeros(batch, anchors, 4), torch.zeros_like(scores))
