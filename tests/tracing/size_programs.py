"""Losses that read sizes from data as a real pose criterion does (Ultralytics' idioms), without
depending on it: targets packed per image to the most objects in any image
(``new_zeros((b, int(counts.max()), ...))``), their slots (``torch.arange(len(idx))``), per-row
weights (``.repeat(t.shape[0], 1)``) and a mean over selected rows (``loss /= len(loss)``).

Traced code: this module must use ``len`` and ``int`` only by calling them (its stand-ins,
:mod:`fxpasses.tracing.shadows`); the tests use them freely in their own module.
"""

from __future__ import annotations

import threading

import torch
from torch import nn


def pack(keypoints: torch.Tensor, batch_idx: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(n, k, 3) rows of images ``batch_idx`` -> (batch_size, most rows in an image, k, 3)."""
    counts = torch.bincount(batch_idx, minlength=batch_size)
    batched = keypoints.new_zeros((batch_size, int(counts.max()), *keypoints.shape[1:]))
    within = torch.arange(len(batch_idx), device=keypoints.device) - (counts.cumsum(0) - counts)[batch_idx]
    batched[batch_idx, within] = keypoints
    return batched


class PackedLoss(nn.Module):
    """Every idiom at once: padded targets scored against each anchor, per-keypoint weights
    repeated per row, a mean over the visible keypoints divided by their count. With
    ``batch_from_predictions`` the batch size is ``pred.shape[0]``, as the real criterion reads it
    (a loader's short last batch packs fewer images)."""

    def __init__(self, keypoints: int = 4, batch_size: int = 3, batch_from_predictions: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = nn.Parameter(torch.rand(keypoints, generator=g, dtype=torch.float64) + 0.5)
        self.batch_size = batch_size
        self.batch_from_predictions = batch_from_predictions

    def forward(self, pred: torch.Tensor, keypoints: torch.Tensor, batch_idx: torch.Tensor) -> torch.Tensor:
        batch_size = pred.shape[0] if self.batch_from_predictions else self.batch_size
        targets = pack(keypoints, batch_idx, batch_size)  # (b, m, k, 3)
        labelled = targets[..., 2] > 0  # (b, m, k); padding rows are zero
        distance = (pred[:, :, None, :, :2] - targets[:, None, :, :, :2]).pow(2).sum(-1)  # (b, a, m, k)
        placed = (distance * labelled[:, None]).sum((-1, -2)).mean()
        visible = keypoints[..., 2] > 0  # (n, k)
        weights = self.weights.unsqueeze(0).repeat(keypoints.shape[0], 1)[visible]
        rows = pred[batch_idx, 0][visible]  # each object's first anchor, its visible keypoints
        loss = (rows[:, :2] - keypoints[visible][:, :2]).abs().sum(-1) * weights
        loss /= len(loss)
        return placed * 1e-3 + loss.sum()


class CountedTopK(nn.Module):
    """``int()`` of arithmetic on a size and a float setting: the number of anchors kept."""

    def __init__(self):
        super().__init__()
        self.fraction = 0.5

    def forward(self, scores: torch.Tensor, batch_idx: torch.Tensor) -> torch.Tensor:
        k = int(self.fraction * len(batch_idx)) + 1
        return scores.topk(k, dim=-1).values.sum() / k


class EmptyGuarded(nn.Module):
    """A branch on a size: only its truth is a decision."""

    def forward(self, pred: torch.Tensor, batch_idx: torch.Tensor) -> torch.Tensor:
        if len(batch_idx) == 0:
            return pred.sum() * 0.0
        return (pred[batch_idx] ** 2).sum() / len(batch_idx)


class BuiltinsAsBefore(nn.Module):
    """Calls of ``len`` and ``int`` on what is not traced: the builtins' results, their errors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = [len([1, 2, 3]), int("12"), int(2.75), int("ff", 16), int(-3.5), len("four"), int()]
        try:
            len(x.sum())  # a 0-d tensor has no len(), traced or not
        except TypeError as exc:
            self.zero_d_error = str(exc)
        self.sizes = sizes
        return x.sum() * (sum(sizes) + len(x))


def meanwhile(work) -> None:
    """Run ``work`` on another thread and wait for it (inside a trace: not the tracing thread)."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


SEEN: dict = {}  # what OtherThread's other thread got (only that thread reads this global)


class OtherThread(nn.Module):
    """While its trace runs, another thread calls ``len`` and ``int`` of this module on the
    trace's own tensors and numbers: native results, nothing recorded."""

    def __init__(self, other: bool = True):
        super().__init__()
        self.other = other  # False: the same loss without the other thread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]

        def work():
            SEEN["len"], SEEN["int"] = len(x), int(x[0, 0])
            SEEN["int-size"], SEEN["len-list"] = int(n), len([x, x])
        if self.other:
            meanwhile(work)
        return x.sum() / len(x)


class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        raise RuntimeError(f"fails after reading {n} rows")


class LateDecisions(nn.Module):
    """Decisions on sizes taken long after the sizes are known, as a real loss takes them: the
    inputs' last size (front), a selection's row count (just after the selection), and one on
    tensor data (where the loss reads it)."""

    def forward(self, pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.float()
        rows = targets[targets[:, 0] >= 0]
        nl, ne = rows.shape
        work = (pred @ pred.t()).sigmoid().sum()  # work a failed decision need not wait for
        if targets.shape[-1] == 2:
            targets = torch.cat((targets, torch.ones_like(targets[:, :1])), -1)
        if nl == 0:
            return work * 0.0
        if (rows[:, 1] > 0.5).any():
            work = work * 2.0
        return work + rows.sum() / nl


class PowerOfTwo(nn.Module):
    """A method of the number ``len`` returned (Ultralytics' MPS bucket): its value, guarded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = 1 << (len(x) - 1).bit_length()
        return x.new_zeros((slots, x.shape[1])).sum() + x.sum() / len(x)
