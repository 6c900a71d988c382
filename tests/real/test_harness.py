"""The harness itself: the criterion is the real one, and batches vary as real data does."""

from __future__ import annotations

import torch

from fxpasses.workloads.counts import object_counts
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds


def test_the_criterion_is_ultralytics_e2e_pose_loss_sharing_the_models_flow(pose_model):
    from ultralytics.utils.loss import E2ELoss, PoseLoss26

    crit = pose_model.init_criterion()
    assert isinstance(crit, E2ELoss)
    assert isinstance(crit.one2many, PoseLoss26) and isinstance(crit.one2one, PoseLoss26)
    assert crit.one2many.flow_model is crit.one2one.flow_model is pose_model.model[-1].flow_model


def test_counts_vary_with_empty_images_and_a_moving_maximum():
    g = torch.Generator().manual_seed(0)
    counts = torch.stack([object_counts(g, 16) for _ in range(50)])
    assert (counts == 0).any() and counts.max() <= 20 and counts.min() >= 0
    assert len(set(counts.max(1).values.tolist())) >= 4  # the padded size changes batch to batch
    few = ((counts >= 1) & (counts <= 4)).float().mean()
    assert 0.6 < few < 0.85


def test_some_persons_have_no_labelled_keypoint_and_the_rest_about_seventy_percent():
    batches = [pose_batch(4, seed=seed, image_size=64) for seed in range(40)]
    labelled = torch.cat([b["keypoints"][..., 2] != 0 for b in batches])  # persons x 17
    none = ~labelled.any(1)
    assert 0.12 < none.float().mean() < 0.28  # about 20 % of persons
    assert 0.65 < labelled[~none].float().mean() < 0.75  # the others: about 30 % unlabelled
    off = pose_batch(4, seed=0, image_size=64, unlabelled_persons=0.0)["keypoints"]
    assert (off[..., 2] != 0).any(1).all()  # off: every person keeps a labelled keypoint


def test_a_batch_calls_the_real_criterion_with_gradients(pose_model):
    crit = pose_model.init_criterion()
    batch = pose_batch(3, seed=1, image_size=128, counts=torch.tensor([0, 2, 5]))
    assert batch["batch_idx"].tolist() == [1, 1, 2, 2, 2, 2, 2]
    assert (batch["keypoints"][..., 2] == 0).any()  # unlabelled keypoints, stored as (0, 0, 0)
    hidden = batch["keypoints"][..., 2] == 0
    assert batch["keypoints"][hidden][:, :2].abs().sum() == 0
    preds = pose_preds(3, seed=1, image_size=128)
    loss, items = crit(preds, batch)
    loss.sum().backward()
    assert preds["one2many"]["kpts"].grad is not None and torch.isfinite(loss).all()
