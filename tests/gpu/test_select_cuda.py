"""On a CUDA device: SelectRows with PairRLE and CaptureLoss on the reference loss, in float64
against native (values and every gradient), one host read per run of a call, the loss replayed."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch

pytestmark = pytest.mark.cuda


def _values_and_grads(fn, batch, params):
    leaves, spec = pytree.tree_flatten(batch)
    fresh = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
             for x in leaves]
    out = fn(pytree.tree_unflatten(fresh, spec))
    wrt = [x for x in fresh if isinstance(x, torch.Tensor) and x.requires_grad] + params
    return out.total.detach(), torch.autograd.grad(out.total, wrt, allow_unused=True)


def check_reference_loss(device: str, capture: CaptureLoss, calls: int = 4) -> None:
    """Float64 equality with native over ``calls`` fresh batches, one read per run of a call (a
    call whose capacity grew runs again), every selection rewritten and the regions replayed
    (the body of the CUDA test, runnable anywhere)."""
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().double().to(device)
    fast = optimize(loss, passes=[PairRLE(), SelectRows(min_bucket=8), capture])
    params = list(loss.parameters())
    for seed in range(calls):
        batch = make_batch(4, seed=seed, image_size=128, device=device, dtype=torch.float64)
        want, want_grads = _values_and_grads(loss, batch, params)
        got, got_grads = _values_and_grads(fast, batch, params)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        for have, expected in zip(got_grads, want_grads):
            expected = torch.zeros_like(have) if expected is None else expected
            assert have is not None
            torch.testing.assert_close(have, expected, rtol=1e-9, atol=1e-11)
    stats = fast.stats
    assert stats.optimized == calls and not stats.native and not stats.exceptions, stats.render()
    select = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert len(select) == 4 and all(c.applied for c in select)
    reads = [v["read"] for k, v in stats.sites.items() if "check_counts" in k]
    again = sum(n for k, n in stats.abandoned.items() if k.startswith("selection-capacity"))
    assert reads == [calls + again]
    regions = [v for k, v in stats.sites.items() if "capture_region" in k]
    assert regions and all("capture-failed" not in v and v.get("replayed", 0) for v in regions)


def test_reference_loss_with_every_pass_matches_native_in_float64():
    check_reference_loss("cuda", CaptureLoss(max_recordings=64, record_after=1))
