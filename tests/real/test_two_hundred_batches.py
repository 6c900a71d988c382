"""The real criterion, unmodified, with all three passes over 200 fresh realistic batches.

Batch sizes 2 to 4 drawn per batch, persons per image as in real data (empty images, most 1-4, a
tail), a third of the batches with NaN/inf stored in unlabelled keypoints (the real loss's box and
keypoint terms then are NaN natively: the optimized ones must be NaN at the same places): at most 2
specializations, at least 98 % of the calls through a traced graph, at most 1 % abandoned (a
selection's capacity growing), and every call's values, prediction gradients and flow-parameter
gradients equal to native's within float32 rounding. CaptureLoss runs with the emulated recorder
(CUDA graphs' static-buffer semantics on a CPU), so its regions record and replay here too.

Values and gradients must equal native's on every call. The budget (specializations, abandons)
is the symbolic-sizes issue's; it held until the batches gained persons without a labelled
keypoint (a strict xfail now, with what was measured). Before that: at 640 px (the training
resolution) at most 1 % of the calls were abandoned (measured: one, a batch without persons). At 128 px, measured: the selections' capacities (four times the largest
count seen) grow in the first call only (each growth runs that call again at once, optimized);
the loss's own branches on data (``if fg_mask.sum():`` with no foreground anchor, loss.py:894, 3
calls; a batch without persons, loss.py:790, 1 call) abandon and run natively: 2 % of the calls,
above the symbolic-sizes issue's 1 %; the test holds what is reached, so that it cannot get worse.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpasses import optimize
from fxpasses.cli import import_file
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder

calls = import_file(Path(__file__).parents[1] / "helpers" / "real_calls.py")
pytestmark = pytest.mark.slow  # 200 calls of each arm: minutes on two CPU cores

CALLS = 200


@pytest.fixture(scope="module", params=[128, 640])
def two_hundred(request, pose_model_module):
    """The 200 calls at one image size: the optimized loss, where each call's comparison with
    native failed (none expected), and the calls in which a capacity grew or a call abandoned."""
    image_size = request.param
    crit = pose_model_module.init_criterion()
    flow = pose_model_module.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())])
    sizes = torch.randint(2, 5, (CALLS,), generator=torch.Generator().manual_seed(24))
    grew_at, abandoned_at, unequal = [], [], []  # calls where a capacity grew; abandoned; differed
    for seed, size in enumerate(sizes.tolist()):
        before = fast.stats.abandoned
        got = calls.call(fast, flow, size, 1000 + seed, image_size, poison=seed % 3 == 0)
        want = calls.call(crit, flow, size, 1000 + seed, image_size, poison=seed % 3 == 0)
        try:
            calls.assert_equal_calls(got, want)
        except AssertionError as exc:
            unequal.append((seed, str(exc)[:500]))
        if any(k.startswith("selection-capacity") for k in fast.stats.abandoned - before):
            grew_at.append(seed)
        if fast.stats.abandoned - before:
            abandoned_at.append(seed)
    return image_size, fast, grew_at, abandoned_at, unequal


@pytest.fixture(scope="module")
def pose_model_module():
    from fxpasses.workloads.ultralytics_pose import pose_model as build

    torch.manual_seed(0)
    return build()


def test_two_hundred_fresh_batches_equal_native(two_hundred):
    _, fast, _, _, unequal = two_hundred
    assert not unequal, unequal
    stats = fast.stats
    kinds = {k.split(" at ")[0] for k in stats.abandoned}
    # (largest-count-empty: a batch without persons, which natively returns early at loss.py:396)
    assert kinds <= {"selection-capacity", "guard-failed", "selection-empty", "largest-count-empty"}, stats.render()
    # every region's replay admitted whenever its memory is free: none held by its own constants
    # (a device constant every recording outputs once made region 0 run eagerly in 127 of 200)
    assert not any(v.get("outputs-alive") for v in stats.sites.values()), stats.render()


@pytest.mark.xfail(strict=True, reason=(
    "issue 24, open: with a fifth of persons without a labelled keypoint (pose_batch's default "
    "since 2026-12-06), batches of 2-4 images often hold no labelled keypoint among the "
    "foreground persons, and the loss's own branch `if not kpt_mask.any()` (loss.py:939) abandons "
    "and traces again: measured 3 specializations at 128 px, 5 abandoned calls of 200 at 640 px"))
def test_two_hundred_fresh_batches_within_the_issue_budget(two_hundred):
    image_size, fast, grew_at, abandoned_at, _ = two_hundred
    stats = fast.stats
    assert len(fast.specializations) <= 2, fast.explain(verbose=False)
    assert stats.optimized >= 0.98 * CALLS, stats.render()
    assert len(grew_at) <= 0.01 * CALLS, grew_at  # the capacities grow in a few calls at most
    grown = sum(v for k, v in stats.abandoned.items() if k.startswith("selection-capacity"))
    assert sum(stats.abandoned.values()) - grown <= 0.03 * CALLS, stats.render()
    if image_size == 640:  # the training resolution: the symbolic-sizes issue's target
        assert len(abandoned_at) <= 0.01 * CALLS, (abandoned_at, stats.render())
