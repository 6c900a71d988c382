"""The real criterion, unmodified, with all three passes over 200 fresh realistic batches.

Batch sizes 2 to 4 drawn per batch, persons per image as in real data (empty images, most 1-4, a
tail), a third of the batches with NaN/inf stored in unlabelled keypoints (the real loss's box and
keypoint terms then are NaN natively: the optimized ones must be NaN at the same places): at most 2
specializations, at least 98 % of the calls through a traced graph, at most 1 % abandoned (a
selection's capacity growing), and every call's values, prediction gradients and flow-parameter
gradients equal to native's within float32 rounding. CaptureLoss runs with the emulated recorder
(CUDA graphs' static-buffer semantics on a CPU), so its regions record and replay here too.

At 640 px (the training resolution) at most 1 % of the calls are abandoned (measured: one, a
batch without persons). At 128 px, measured: the selections' capacities (four times the largest
count seen) grow in the first call only (each growth runs that call again at once, optimized);
the loss's own branches on data (``if fg_mask.sum():`` with no foreground anchor, loss.py:894, 3
calls; a batch without persons, loss.py:790, 1 call) abandon and run natively: 2 % of the calls,
above the symbolic-sizes issue's 1 %; the test holds what is reached, so that it cannot get worse.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds

pytestmark = pytest.mark.slow  # 200 calls of each arm: minutes on two CPU cores

CALLS = 200


def _call(loss, flow, size, seed, image_size):
    preds = pose_preds(size, seed=seed, image_size=image_size)
    batch = pose_batch(size, seed=seed, image_size=image_size, poison=seed % 3 == 0)
    total, items = loss(preds, batch)
    flow.zero_grad(set_to_none=True)
    total.sum().backward()
    grads = [t.grad for t in tree_leaves(preds) if isinstance(t, torch.Tensor) and t.requires_grad]
    return total.detach(), items, grads, [p.grad for p in flow.parameters()]


@pytest.mark.parametrize("image_size", [128, 640])
def test_two_hundred_fresh_batches_run_optimized_and_equal_native(pose_model, image_size):
    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())])
    sizes = torch.randint(2, 5, (CALLS,), generator=torch.Generator().manual_seed(24))
    grew_at, abandoned_at = [], []  # the calls in which a selection's capacity grew; abandoned
    for seed, size in enumerate(sizes.tolist()):
        before = fast.stats.abandoned
        got = _call(fast, flow, size, 1000 + seed, image_size)
        want = _call(crit, flow, size, 1000 + seed, image_size)
        torch.testing.assert_close(got[0], want[0], equal_nan=True)
        for key in want[1]:
            torch.testing.assert_close(got[1][key], want[1][key], equal_nan=True)
        assert len(got[2]) == len(want[2]) == 8
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, equal_nan=True)
        # a flow parameter's gradient sums both branches' rows, paired in one call: float32 in
        # another order than native's two calls (1.8e-6 relative on one element, one CPU of two)
        for g, w in zip(got[3], want[3]):
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)
        if any(k.startswith("selection-capacity") for k in fast.stats.abandoned - before):
            grew_at.append(seed)
        if fast.stats.abandoned - before:
            abandoned_at.append(seed)
    stats = fast.stats
    assert len(fast.specializations) <= 2, fast.explain(verbose=False)
    assert stats.optimized >= 0.98 * CALLS, stats.render()
    kinds = {k.split(" at ")[0] for k in stats.abandoned}
    assert kinds <= {"selection-capacity", "guard-failed", "selection-empty"}, stats.render()
    assert len(grew_at) <= 0.01 * CALLS, grew_at  # the capacities grow in a few calls at most
    # every region's replay admitted whenever its memory is free: none held by its own constants
    # (a device constant every recording outputs once made region 0 run eagerly in 127 of 200)
    assert not any(v.get("outputs-alive") for v in stats.sites.values()), stats.render()
    grown = sum(v for k, v in stats.abandoned.items() if k.startswith("selection-capacity"))
    assert sum(stats.abandoned.values()) - grown <= 0.03 * CALLS, stats.render()
    if image_size == 640:  # the training resolution: the symbolic-sizes issue's target is met
        assert len(abandoned_at) <= 0.01 * CALLS, (abandoned_at, stats.render())
