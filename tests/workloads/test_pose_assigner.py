"""Task-aligned assignment: static shapes, top-k, candidates inside boxes, padding ignored."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxpasses.workloads.pose import TaskAlignedAssigner, make_batch
from fxpasses.workloads.pose.boxes import anchors_inside, box_ciou


def _assign(batch, branch, topk):
    return TaskAlignedAssigner(topk)(branch.scores.detach().sigmoid(), branch.boxes.detach(),
                                     batch.anchors, batch.targets)


@pytest.mark.parametrize("topk", [1, 10])
def test_assignment_contract(topk):
    batch = make_batch(3, seed=2, image_size=96, max_objects=4)
    t = batch.targets
    a = _assign(batch, batch.o2m, topk)
    (b, n), m = batch.o2m.scores.shape[:2], t.valid.shape[1]
    assert a.foreground.shape == (b, n) and a.gt_index.shape == (b, n)
    assert a.boxes.shape == (b, n, 4) and a.scores.shape == (b, n, 1)
    fg = a.foreground
    assert fg.any()
    # each foreground anchor is assigned a real (not padding) object that contains it
    image = torch.arange(b)[:, None].expand_as(fg)[fg]
    gt = a.gt_index[fg]
    assert t.valid[image, gt].all()
    inside = anchors_inside(batch.anchors, torch.where(t.valid[..., None], t.boxes, 0.0))
    assert inside.permute(0, 2, 1)[fg].gather(1, gt[:, None]).all()
    assert torch.equal(a.boxes[fg], t.boxes[image, gt])
    # at most topk anchors per object
    per_object = torch.zeros(b, m, dtype=torch.long).index_put_((image, gt), torch.ones_like(gt),
                                                                 accumulate=True)
    assert per_object.max() <= topk
    # scores: zero off the foreground; each object's best score is its best overlap (CIoU)
    assert not a.scores[~fg].any() and (a.scores[fg] > 0).all()
    overlap = box_ciou(batch.o2m.boxes.detach()[fg], a.boxes[fg]).squeeze(-1).clamp(min=0)
    slot = image * m + gt
    best_score = torch.zeros(b * m).scatter_reduce(0, slot, a.scores[fg][:, 0], "amax")
    best_overlap = torch.zeros(b * m).scatter_reduce(0, slot, overlap, "amax")
    torch.testing.assert_close(best_score, best_overlap, rtol=1e-5, atol=1e-6)


def test_padding_content_does_not_change_the_assignment():
    batch = make_batch(2, seed=4, image_size=64, max_objects=5)  # padding rows hold NaN boxes
    t = batch.targets
    zeros = dataclasses.replace(t, boxes=torch.where(t.valid[..., None], t.boxes, 0.0),
                                classes=torch.where(t.valid, t.classes, 0))
    poisoned = _assign(batch, batch.o2m, 10)
    clean = _assign(dataclasses.replace(batch, targets=zeros), batch.o2m, 10)
    assert not t.boxes[~t.valid].isfinite().any()
    for x, y in zip(poisoned, clean):
        assert torch.equal(x, y)


def test_predictions_that_overlap_nothing_are_never_positive():
    batch = make_batch(2, seed=0, image_size=64, max_objects=3)
    far = dataclasses.replace(batch.o2o, boxes=batch.o2o.boxes.detach() + 1000.0)
    a = _assign(batch, far, 10)
    assert not a.foreground.any() and not a.scores.any()


def test_runs_without_gradients():
    batch = make_batch(1, seed=0, image_size=64)
    a = TaskAlignedAssigner(10)(batch.o2m.scores.sigmoid(), batch.o2m.boxes, batch.anchors,
                                batch.targets)
    assert not any(x.requires_grad for x in a)
