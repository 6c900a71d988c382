"""The real criterion's settings are never baked in: ``E2ELoss`` holds its two branch losses
(``PoseLoss26``, plain objects that define ``__call__``), and what is read through them (the
shared hyperparameters, the keypoint weights, the criterion's own branch weight) is read again
on every optimized call. After the first call one setting changes; the next optimized call
equals the native criterion, total, loss items and every prediction's gradient."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxpasses import optimize
from fxpasses.passes import PairRLE
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds

pytestmark = pytest.mark.long


def _pose_gain(crit):
    crit.one2many.hyp.pose *= 2  # the namespace both branches and the model share


def _keypoint_weights(crit):
    crit.one2many.target_weights = crit.one2many.target_weights * torch.linspace(0.25, 2.0, 17)


def _branch_weight(crit):
    crit.o2m = crit.o2m * 0.5


CHANGES = {"hyp.pose": _pose_gain, "target_weights": _keypoint_weights, "o2m": _branch_weight}


def _call(loss, preds, batch):
    preds = tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), preds)
    total, items = loss(preds, batch)
    total.sum().backward()
    grads = [t.grad for t in tree_leaves(preds) if t.requires_grad]
    return total.detach(), items, grads


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert len(got[2]) == len(want[2]) == 8  # boxes, scores, kpts, kpts_sigma of both branches
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_setting_of_the_real_criterion_is_seen(pose_model, change):
    crit = pose_model.init_criterion()
    batch = pose_batch(2, seed=3, image_size=128, counts=torch.tensor([1, 3]))
    preds = pose_preds(2, seed=3, image_size=128)
    fast = optimize(crit, passes=[PairRLE()])
    _assert_same(_call(fast, preds, batch), _call(crit, preds, batch))
    before = _call(crit, preds, batch)
    CHANGES[change](crit)
    want = _call(crit, preds, batch)
    assert not torch.allclose(want[0], before[0])  # the change moves the native loss
    _assert_same(_call(fast, preds, batch), want)
    assert fast.stats.optimized == 2 and not fast.stats.native  # both calls optimized
