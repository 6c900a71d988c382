"""Host-made tensors copied to the device (``torch.arange(w).type_as(x)``,
``torch.tensor(x.shape, device=...)``) are made once by CaptureLoss: values and gradients equal
native, the steady call waits for no copy (HostSyncs, the CPU standing in for a GPU), and a
tensor the loss writes afterwards keeps its copy (``device-constant-written``)."""

from __future__ import annotations

import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.testing.host_syncs import HostSyncs


def grid_loss(x):
    sx = torch.arange(x.shape[1]).type_as(x) + 0.5
    size = torch.tensor(x.shape, device=x.device, dtype=x.dtype)
    return ((x * sx).sum(1) / size[1]).exp().mean()


def written_loss(x):
    sx = torch.arange(x.shape[1]).type_as(x)
    sx += 0.5  # the loss writes the tensor it made: one kept tensor would grow every call
    return (x * sx).exp().mean()


def sized_loss(x):
    size = torch.tensor(x.shape[1:], device=x.device, dtype=x.dtype)  # kept: a region's output
    y = (x.sum(1) / size[0]).exp()
    kept = y[y > 1]  # a data-dependent count: the regions end here, the next reads size
    return y.mean() + (kept * size).sum()


def _fast(loss):
    return optimize(loss, passes=[CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(),
                                              min_region_ops=1, count_copies=False)])


def _constants(fast):
    return [(c.applied, c.codes) for c in fast.certificates if "copied to the device" in c.site.description]


def _check(loss, fast, x):
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = loss(x1), fast(x2)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)


def test_host_made_tensors_are_made_once_and_the_call_waits_for_no_copy():
    fast = _fast(grid_loss)
    for seed in range(3):
        _check(grid_loss, fast, torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    x = torch.randn(4, 6, dtype=torch.float64)
    with HostSyncs("cpu") as native:
        grid_loss(x)
    with HostSyncs("cpu") as optimized:
        fast(x)
    assert native.total == 2 and optimized.total == 0, (native.counts, optimized.counts)
    assert _constants(fast) == [(True, ())] * 2
    assert fast.stats.optimized == 4 and not fast.stats.native


def test_a_kept_tensor_that_leaves_a_region_does_not_hold_its_recordings():
    """Every recording of the region outputs the same kept tensor; replays never write it, so
    it is not a recording's memory: with two row counts alternating, each replays (before, a
    recording saw the other's reference to the kept tensor as a caller's, and ran eagerly)."""
    fast = _fast(sized_loss)
    for rows in (4, 5) * 4:
        _check(sized_loss, fast, torch.randn(rows, 6, dtype=torch.float64))
    regions = {k: v for k, v in fast.stats.sites.items() if "capture_region" in k}
    assert len(regions) == 2 and all(v == {"awaiting-repeat": 2, "recorded": 2, "replayed": 6}
                                     for v in regions.values()), regions


def test_a_new_dtype_gets_its_own_tensor():
    fast = _fast(grid_loss)
    for dtype in (torch.float64, torch.float32, torch.float64, torch.float32):
        _check(grid_loss, fast, torch.randn(4, 6, dtype=dtype))


def test_a_tensor_the_loss_writes_keeps_its_copy():
    fast = _fast(written_loss)
    for _ in range(3):
        _check(written_loss, fast, torch.randn(4, 6, dtype=torch.float64))
    assert _constants(fast) == [(False, ("device-constant-written",))]
