"""Hypothesis strategies for the pose workload's inputs and for flow rows.

* :func:`pose_inputs`: small :class:`~fxpasses.workloads.pose.PoseLossInputs` (tiny images, few
  objects) with per-branch control of emptiness: an empty branch predicts boxes far outside the
  image, so no anchor of that branch overlaps any object and its foreground (and hence its
  keypoint and flow rows) is empty. The two branches have independent noise and top-k, so their
  visible selections differ in size; ``unlabelled`` up to 1.0 empties both selections while the
  foregrounds stay non-empty; ``poison`` puts NaN/inf in unlabelled keypoints and padding rows.
* :func:`flow_rows` / :func:`flow_row_pairs`: (N, dim) tensors with N from 0 to thousands,
  alone or as the two branches' rows of a paired flow call.

Tensor contents come from :func:`~fxpasses.workloads.pose.make_batch` and ``torch.Generator``
seeds drawn by hypothesis: drawing thousands of floats one by one would be slow, and the knobs
that matter (sizes, emptiness, poison, dtype) are drawn explicitly, so they shrink.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st
from torch import Tensor

from ..workloads.pose import BranchPrediction, PoseLossInputs, make_batch

EMPTY_CHOICES = ("none", "o2m", "o2o", "both")
FLOAT_DTYPES = (torch.float32, torch.float64)


@st.composite
def pose_inputs(draw: st.DrawFn, *, image_sizes: tuple[int, ...] = (32, 64), max_batch: int = 2,
                max_objects: int = 3, num_keypoints: int = 17,
                empty: st.SearchStrategy[str] = st.sampled_from(EMPTY_CHOICES),
                unlabelled: st.SearchStrategy[float] = st.sampled_from((0.0, 0.3, 0.7, 1.0)),
                poison: st.SearchStrategy[bool] = st.booleans(),
                dtypes: st.SearchStrategy[torch.dtype] = st.sampled_from(FLOAT_DTYPES),
                ) -> PoseLossInputs:
    """Loss inputs; ``empty`` names the branch(es) whose foreground is empty ("none", "both")."""
    image_size = draw(st.sampled_from(image_sizes))
    batch = make_batch(draw(st.integers(1, max_batch)), seed=draw(st.integers(0, 2**31 - 1)),
                       image_size=image_size, num_keypoints=num_keypoints,
                       max_objects=draw(st.integers(1, max_objects)), unlabelled=draw(unlabelled),
                       poison=draw(poison), dtype=draw(dtypes))
    which = draw(empty)
    o2m = _outside(batch.o2m, image_size) if which in ("o2m", "both") else batch.o2m
    o2o = _outside(batch.o2o, image_size) if which in ("o2o", "both") else batch.o2o
    return dataclasses.replace(batch, o2m=o2m, o2o=o2o)


def _outside(branch: BranchPrediction, image_size: int) -> BranchPrediction:
    """The branch with every predicted box moved far outside the image (a fresh leaf)."""
    moved = (branch.boxes.detach() + 4.0 * image_size).requires_grad_(branch.boxes.requires_grad)
    return dataclasses.replace(branch, boxes=moved)


def _row_count(max_rows: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(0), st.integers(1, 8), st.integers(0, max_rows))


@st.composite
def flow_rows(draw: st.DrawFn, *, max_rows: int = 4096, dim: int = 2,
              dtypes: st.SearchStrategy[torch.dtype] = st.sampled_from(FLOAT_DTYPES),
              requires_grad: bool = True) -> Tensor:
    """An (N, dim) leaf tensor, N in [0, max_rows] (0 and a few rows are drawn often)."""
    rows = draw(_row_count(max_rows))
    scale = draw(st.sampled_from((0.1, 1.0, 5.0)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64) * scale
    return x.to(draw(dtypes)).requires_grad_(requires_grad)


@st.composite
def flow_row_pairs(draw: st.DrawFn, *, max_rows: int = 4096, dim: int = 2,
                   dtypes: st.SearchStrategy[torch.dtype] = st.sampled_from(FLOAT_DTYPES),
                   same_dtype: bool = True) -> tuple[Tensor, Tensor]:
    """Two branches' rows for one flow: sizes drawn independently (either may be 0)."""
    first = draw(flow_rows(max_rows=max_rows, dim=dim, dtypes=dtypes))
    second_dtypes = st.just(first.dtype) if same_dtype else dtypes
    return first, draw(flow_rows(max_rows=max_rows, dim=dim, dtypes=second_dtypes))
