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
    rows = t.valid.shape[1]
    assert t.keypoints.shape == (4, rows, 17, 2) and t.boxes.shape == (4, rows, 4)
    assert t.valid.sum(1).max() == rows  # padded to the most objects in one image, as a loader pads
    labelled = t.visible[t.valid]
    assert 0.25 < 1 - labelled.float().mean().item() < 0.35  # about 30 % unlabelled
    hidden = t.keypoints[t.valid][~labelled]
    assert hidden.isnan().any() and hidden.isposinf().any() and hidden.isneginf().any()
    assert torch.isfinite(t.keypoints[t.visible]).all()
    assert t.boxes[~t.valid].isnan().all() and torch.isfinite(t.boxes[t.valid]).all()


def test_objects_per_image_are_realistic_and_the_most_is_not_pinned():
    batches = [make_batch(4, seed=seed, image_size=32).targets.valid for seed in range(100)]
    counts = torch.cat([valid.sum(1) for valid in batches])
    assert (counts == 0).any() and counts.max() > 4 and counts.max() <= 20
    assert 0.6 < ((counts >= 1) & (counts <= 4)).float().mean() < 0.9  # most hold 1 to 4
    padded = {valid.shape[1] for valid in batches}
    assert len(padded) > 5  # the padded size changes from batch to batch
    first_two = {tuple(valid.sum(1)[:2].tolist()) for valid in batches}
    assert len(first_two) > 10  # no image is pinned to a count


def test_pinned_counts_fix_objects_per_image_and_the_padded_maximum():
    batch = make_batch(3, seed=0, image_size=64, max_objects=20, counts=torch.tensor([1, 20, 0]))
    assert batch.targets.valid.sum(1).tolist() == [1, 20, 0] and batch.targets.valid.shape == (3, 20)
    for bad in ([1, 2], [1, 21, 0], [-1, 2, 0]):
        with pytest.raises(ValueError, match="counts"):
            make_batch(3, seed=0, image_size=64, counts=bad)


@pytest.mark.parametrize("counts", [[0, 0, 0], [0, 3, 0], [0]], ids=["all-empty", "some-empty", "one-empty"])
def test_images_without_objects_give_finite_values_and_gradients(counts):
    batch = make_batch(len(counts), seed=2, image_size=64, dtype=torch.float64, counts=counts)
    assert batch.targets.valid.shape == (len(counts), max(counts))  # all empty: zero target rows
    loss = DualBranchPoseLoss().double()
    out = loss(batch)
    out.total.backward()
    assert torch.isfinite(out.total)
    leaves = [p.grad for p in loss.parameters()] + [batch.o2m.scores.grad, batch.o2o.boxes.grad]
    assert all(g is not None and torch.isfinite(g).all() for g in leaves)
    if not any(counts):  # nothing to assign: only the classification term, every anchor background
        for branch in out.branches.values():
            assert all(branch[k] == 0 for k in ("box", "kpt", "kobj", "rle")) and branch["cls"] > 0


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
def test_small_images_and_batch_of_one_with_one_pinned_object(image_size, anchors):
    batch = make_batch(1, seed=5, image_size=image_size, max_objects=3, counts=[1])
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
