"""One call of the real criterion on a realistic batch, and its comparison with native's."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds


def call(loss, flow, size: int, seed: int, image_size: int, poison: bool):
    """The total, the items, every prediction's gradient and the flow parameters' gradients."""
    preds = pose_preds(size, seed=seed, image_size=image_size)
    batch = pose_batch(size, seed=seed, image_size=image_size, poison=poison)
    total, items = loss(preds, batch)
    flow.zero_grad(set_to_none=True)
    total.sum().backward()
    grads = [t.grad for t in tree_leaves(preds) if isinstance(t, torch.Tensor) and t.requires_grad]
    return total.detach(), items, grads, [p.grad for p in flow.parameters()]


def assert_equal_calls(got, want) -> None:
    """Values and gradients equal within float32 rounding (NaN where native's are)."""
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
