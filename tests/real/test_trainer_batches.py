"""The real criterion on the batches its trainer makes: one specialization for a whole epoch.

The batches come from a real ``PoseTrainer`` (its dataloader with mosaic and its
``preprocess_batch``, on a generated dataset whose persons per image vary as in COCO, empty
images included), so besides the tensors they hold what a trainer adds: the image tensor, file
names, original and resized shapes, padding ratios (tuples of Python values). The criterion reads
none of those; file names differ in every batch, and as constants of the trace they made every
batch a specialization of its own (8 traces, then native calls). Unread, they are free in the
signature: one specialization serves the epoch, every call runs optimized (where a selection's
count outgrows its capacity, the call runs again with it grown), and values and gradients equal
native's (the criterion computes in float32: compared within float32 rounding, scaled to each
tensor's max).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.testing.torchvision_stand_in import ensure_torchvision
from fxpasses.workloads.pose_dataset import write_dataset
from fxpasses.workloads.ultralytics_pose import model_preds, trainer_batches

pytestmark = pytest.mark.long  # an epoch of 44 batches at 160 px: about 35 s here

IMAGES, BATCH = 176, 4


def _call(loss, preds, batch):
    preds = tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), preds)
    total, items = loss(preds, batch)
    total.sum().backward()
    return [total.detach(), *tree_leaves(items), *(t.grad for t in tree_leaves(preds) if t.requires_grad)]


def _assert_close_to_scale(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:  # no gradient natively (the feature maps): none here either
            assert g is None
            continue
        scale = w.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((g - w).abs().max() / scale).item() <= 2e-6


def test_one_specialization_serves_an_epoch_of_the_trainers_batches(tmp_path):
    ensure_torchvision()
    data = write_dataset(tmp_path / "data", train=IMAGES, val=4, image_size=160, seed=1)
    model, batches = trainer_batches(data, tmp_path / "runs", imgsz=160, batch=BATCH)
    crit = model.init_criterion()
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss()])
    most, empty, calls = set(), 0, 0
    for batch in batches:
        counts = torch.bincount(batch["batch_idx"].long(), minlength=BATCH)
        most.add(int(counts.max()))
        empty += int((counts == 0).sum())
        assert isinstance(batch["im_file"], tuple) and isinstance(batch["ratio_pad"], tuple)
        preds = model_preds(model, batch["img"])
        _assert_close_to_scale(_call(fast, preds, batch), _call(crit, preds, batch))
        calls += 1
    assert calls == IMAGES // BATCH and len(most) >= 5 and empty >= 2  # the counts did vary
    assert len(fast.specializations) == 1
    stats = fast.stats
    assert stats.optimized == calls and not stats.native, stats.render()  # capacity growth: runs again
    trace = fast.specializations[0].certificates[0].checks[0].evidence
    assert set(trace["inputs_not_read"]["values"]) == {
        "batch['im_file']", "batch['img']", "batch['ori_shape']", "batch['ratio_pad']",
        "batch['resized_shape']"}
