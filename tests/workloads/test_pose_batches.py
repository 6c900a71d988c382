"""Synthetic batches: realistic sizes, poisoned unlabelled keypoints, determinism, tiny sizes."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fxpasses.workloads.pose import DualBranchPoseLoss, input_order, make_anchors, make_batch

PREDICTIONS = [name for name in input_order() if name.startswith(("o2m.", "o2o."))]


def test_anchor_grid_at_640_px():
    anchors, strides = make_anchors(640)
    assert anchors.shape == (8400, 2) and strides.shape == (8400, 1)
    assert strides.flatten().unique().tolist() == [8.0, 16.0, 32.0]
    assert torch.equal(anchors[0], torch.tensor([4.0, 4.0]))
    assert torch.equal(anchors[-1], torch.tensor([624.0, 624.0]))


def test_realistic_batch_at_640_px():
    batch = make_batch(4, seed=0)
    t = batch.targets
    assert batch.o2m.scores.shape == (4, 8400, 1) and batch.o2o.keypoints.shape == (4, 8400, 17, 2)
    assert t.keypoints.shape == (4, 20, 17, 2) and t.valid.shape == (4, 20)
    counts = t.valid.sum(1).tolist()
    assert counts[0] == 1 and counts[1] == 20 and all(1 <= c <= 20 for c in counts)
    labelled = t.visible[t.valid]
    assert 0.25 < 1 - labelled.float().mean().item() < 0.35  # about 30 % unlabelled
    hidden = t.keypoints[t.valid][~labelled]
    assert hidden.isnan().any() and hidden.isposinf().any() and hidden.isneginf().any()
    assert torch.isfinite(t.keypoints[t.visible]).all()
    assert t.boxes[~t.valid].isnan().all() and torch.isfinite(t.boxes[t.valid]).all()


def test_predictions_are_leaves_that_require_grad_and_targets_are_not():
    batch = make_batch(1, seed=0, image_size=64)
    leaves = dict(zip(input_order(), pytree.tree_leaves(batch)))
    for name, leaf in leaves.items():
        assert leaf.is_leaf
        assert leaf.requires_grad == (name in PREDICTIONS), name
        if name in PREDICTIONS:
            assert torch.isfinite(leaf).all(), name
    assert (batch.o2m.sigmas > 0).all() and (batch.o2m.sigmas < 1).all()


@pytest.mark.parametrize("image_size, anchors", [(32, 21), (64, 84), (96, 189)])
def test_small_images_and_batch_of_one(image_size, anchors):
    batch = make_batch(1, seed=5, image_size=image_size, max_objects=3)
    assert batch.anchors.shape == (anchors, 2) and batch.targets.valid.sum() == 1
    out = DualBranchPoseLoss()(batch)
    assert torch.isfinite(out.total)


def test_seed_determines_the_batch_and_dtype_only_rounds_it():
    first, again = make_batch(2, seed=3, image_size=64), make_batch(2, seed=3, image_size=64)
    wide = make_batch(2, seed=3, image_size=64, dtype=torch.float64)
    other = make_batch(2, seed=4, image_size=64)
    for a, b, w, o in zip(*map(pytree.tree_leaves, (first, again, wide, other))):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
        assert torch.equal(a.nan_to_num(), w.to(a.dtype).nan_to_num())
    assert not torch.equal(first.o2m.boxes, other.o2m.boxes)
    assert wide.o2m.boxes.dtype == torch.float64 and wide.targets.classes.dtype == torch.int64


def test_without_poison_every_value_is_finite():
    batch = make_batch(2, seed=0, image_size=64, poison=False)
    for leaf in pytree.tree_leaves(batch):
        if leaf.is_floating_point():
            assert torch.isfinite(leaf).all()


def test_each_branch_has_realistic_positives():
    batch = make_batch(4, seed=1, image_size=96, max_objects=4)
    loss = DualBranchPoseLoss()
    objects = int(batch.targets.valid.sum())
    pairs = ((batch.o2m, loss.assign_o2m, 10), (batch.o2o, loss.assign_o2o, 1))
    for branch, assigner, topk in pairs:
        assigned = assigner(branch.scores.detach().sigmoid(), branch.boxes.detach(), batch.anchors,
                            batch.targets)
        positives = int(assigned.foreground.sum())
        assert objects <= positives * 2 and positives <= topk * objects
