"""PairRLE and SelectRows on the real Ultralytics criterion, unmodified (``E2ELoss`` of two
``PoseLoss26`` sharing the model's ``RealNVP``), on realistic batches: empty images, one person,
all persons in one image, persons without a visible keypoint (stored as zeros, as Ultralytics'
datasets store them).

Per branch the loss selects four times: the assigner's candidate (image, target, anchor) pairs
(``mask_gt.nonzero(as_tuple=True)``, tal.py:232, scored per pair and written back at their
positions, tal.py:239-240; the mask is sized by the most persons in an image, a root), the
foreground anchors (``masks``, with
``masks.nonzero(as_tuple=True)`` indexing, loss.py:1005-1008 and BboxLoss, loss.py:140), their
visible keypoints (``kpt_mask``, loss.py:942-949) and, of those, the rows the NaN/inf filter keeps
(``valid_mask``, loss.py:961-964). All three are rewritten (``RLELoss``'s ``loss /= len(loss)``,
loss.py:225, is a symbolic size, not a guard), and so are the assigner's pairs.
Values, loss items, every prediction's gradient and the flow's parameter gradients equal native
within float32 rounding; the flow's linear calls, counted by executing, are halved.

NaN/inf stored in unlabelled keypoints ("poisoned"): this criterion's assigner reads their
coordinates (``PoseTaskAlignedAssigner.pair_overlaps``, tal.py: ``exp(-d) * vis`` is NaN for a
NaN ``d``), so native's box and class terms are NaN; the optimized loss gives the same NaN
pattern and the same finite values, no more and no fewer.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxpasses import optimize
from fxpasses.passes import PairRLE, SelectRows
from fxpasses.testing.counting import CountLinear
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds

pytestmark = pytest.mark.long  # a real criterion traced and analysed per batch

IMAGE = 128


def _without_visible_keypoints(batch: dict, person: int) -> dict:
    keypoints = batch["keypoints"].clone()
    keypoints[person] = 0.0  # unlabelled, stored as (0, 0, 0)
    return {**batch, "keypoints": keypoints}


def _batch(case: str) -> tuple[dict, dict]:
    """(batch, predictions) of a named case."""
    if case in ("mixed", "poisoned"):  # empty images, one person alone, one without a visible keypoint
        batch = pose_batch(4, seed=11, image_size=IMAGE, counts=torch.tensor([0, 1, 0, 4]),
                           poison=case == "poisoned")
        return _without_visible_keypoints(batch, 2), pose_preds(4, seed=11, image_size=IMAGE)
    if case == "crowd":  # every person in one image
        return (pose_batch(3, seed=12, image_size=IMAGE, counts=torch.tensor([0, 6, 0])),
                pose_preds(3, seed=12, image_size=IMAGE))
    if case == "single":  # one person in the batch
        return (pose_batch(2, seed=13, image_size=IMAGE, counts=torch.tensor([0, 1])),
                pose_preds(2, seed=13, image_size=IMAGE))
    if case == "unlabelled":  # no visible keypoint at all: the RLE loss takes its zero path
        return (pose_batch(2, seed=14, image_size=IMAGE, counts=torch.tensor([2, 1]), unlabelled=1.0),
                pose_preds(2, seed=14, image_size=IMAGE))
    raise ValueError(case)


def _call(loss, preds, batch, params):
    """Total, loss items, and the gradients of every prediction and of ``params`` under a fixed
    random weighting of the total's entries."""
    preds = tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), preds)
    for p in params:
        p.grad = None
    total, items = loss(preds, batch)
    weights = torch.linspace(0.5, 1.5, total.numel()).view(total.shape)
    (total * weights).sum().backward()
    grads = [t.grad for t in tree_leaves(preds) if t.requires_grad]
    return total.detach(), items, grads, [p.grad.clone() for p in params]


def _assert_same(got, want, equal_nan=False):
    torch.testing.assert_close(got[0], want[0], equal_nan=equal_nan)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], equal_nan=equal_nan)
    assert len(got[2]) == len(want[2]) == 8  # boxes, scores, kpts, kpts_sigma of both branches
    for g, w in zip(got[2] + got[3], want[2] + want[3]):
        torch.testing.assert_close(g, w, equal_nan=equal_nan)


def _levels(fast) -> dict[int, list[tuple[bool, tuple]]]:
    found: dict[int, list] = {}
    for cert in fast.certificates:
        if cert.pass_name == "SelectRows":
            found.setdefault(cert.effect["level"], []).append((cert.applied, cert.codes))
    return found


@pytest.mark.parametrize("case", ["mixed", "crowd", "single", "unlabelled", "poisoned"])
def test_pair_and_select_equal_native_on_realistic_batches(pose_model, case):
    crit = pose_model.init_criterion()
    batch, preds = _batch(case)
    flow = list(crit.one2many.flow_model.parameters())
    want = _call(crit, preds, batch, flow)
    poisoned = case == "poisoned"
    assert want[0].isnan().any() == poisoned  # native's own NaN, from the assigner (see above)
    fast = optimize(crit, passes=[PairRLE(), SelectRows()])
    _assert_same(_call(fast, preds, batch, flow), want, equal_nan=poisoned)
    # again, with the capacities it grew to
    _assert_same(_call(fast, preds, batch, flow), want, equal_nan=poisoned)
    assert fast.stats.optimized == 2 and not fast.stats.native
    assert all(p.grad is not None and (p.grad.abs().sum() > 0 or poisoned) for p in flow) \
        or case == "unlabelled"
    levels = _levels(fast)
    assert levels[1] == [(True, ())] * 4  # the assigner's pairs, the foreground anchors: both branches
    if case == "unlabelled":  # kpt_mask.any() is False: nothing selected by it
        assert set(levels) == {1}
        return
    assert levels[2] == [(True, ())] * 2  # their visible keypoints
    assert levels[3] == [(True, ())] * 2  # the NaN/inf filter's rows; len(loss) symbolic
    assert 0 not in levels


def test_the_flows_linear_calls_are_halved_by_executing(pose_model):
    crit = pose_model.init_criterion()
    batch, preds = _batch("mixed")
    fast = optimize(crit, passes=[PairRLE()])
    fast(preds, batch)  # traced
    with CountLinear() as native:
        crit(preds, batch)
    with CountLinear() as paired:
        fast(preds, batch)
    assert fast.stats.optimized == 2
    (pair,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert pair.applied and pair.effect["linear_calls_before"] == native.calls == 72
    assert paired.calls == native.calls // 2 == pair.effect["linear_calls_after"]
