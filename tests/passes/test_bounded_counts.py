"""``torch.bincount(x, minlength=m)`` read next by ``int(counts.max())`` (Ultralytics' keypoint
packing, loss.py:789-790): the bincount's own two host reads go, its bound is read with the
maximum; values and gradients equal native's (float64), and a value outside ``[0, m)`` abandons
the call to native (``counts-out-of-range``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.bounded_counts import COMPARED, BoundedBincount, CheckedRead


class PackedTargets(nn.Module):
    """Targets packed per image to the most in any image, as Ultralytics' ``_batch_keypoints``."""

    def forward(self, pred: torch.Tensor, keypoints: torch.Tensor, batch_idx: torch.Tensor) -> torch.Tensor:
        batch_size = pred.shape[0]
        counts = torch.bincount(batch_idx, minlength=batch_size)
        batched = keypoints.new_zeros((batch_size, int(counts.max()), *keypoints.shape[1:]))
        within = torch.arange(len(batch_idx), device=keypoints.device) - (counts.cumsum(0) - counts)[batch_idx]
        batched[batch_idx, within] = keypoints
        return ((pred[:, None] - batched) ** 2).sum(), counts


class UnboundedCounts(nn.Module):
    """A bincount without ``minlength``, and one whose counts are used before the next read."""

    def forward(self, pred: torch.Tensor, batch_idx: torch.Tensor) -> torch.Tensor:
        free = torch.bincount(batch_idx)
        used = torch.bincount(batch_idx, minlength=pred.shape[0])
        scaled = pred * used[: pred.shape[0], None]  # counts used before their maximum is read
        return scaled.sum() * int(used.max()) + free.sum()


def _capture() -> CaptureLoss:
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1)


def _inputs(counts: list[int], seed: int = 0, k: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    batch_idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    pred = torch.randn(len(counts), k, generator=g, dtype=torch.float64).requires_grad_()
    keypoints = torch.randn(len(batch_idx), k, generator=g, dtype=torch.float64).requires_grad_()
    return pred, keypoints, batch_idx


def _run(fn, inputs: tuple[torch.Tensor, ...]) -> tuple:
    pred, keypoints, batch_idx = (t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    loss, counts = fn(pred, keypoints, batch_idx)
    loss.backward()
    return loss.detach(), counts.detach(), pred.grad, keypoints.grad


def _certificates(fast) -> dict:
    """The rewrite's certificates, by bincount node."""
    return {c.site.nodes[0]: c for s in fast.specializations for c in s.certificates
            if c.checks and c.checks[0].id == "unweighted-with-minlength"}


def test_the_bincount_loses_its_reads_and_its_bound_is_read_with_the_maximum():
    native, fast = PackedTargets(), optimize(PackedTargets(), passes=[_capture()])
    inputs = _inputs([2, 0, 3, 1])
    want = _run(native, inputs)
    got = _run(fast, inputs)
    (cert,) = _certificates(fast).values()
    assert cert.applied and "in one transfer" in cert.effect["host_reads"]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    graph = fast.specializations[0].graph_module.graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.bincount not in targets and "item" not in [n.target for n in graph.nodes]
    assert [type(t).__name__ for t in targets if type(t) in (BoundedBincount, CheckedRead)] == \
        ["BoundedBincount", "CheckedRead"]
    assert fast.stats.optimized == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 2**16))
def test_values_and_gradients_equal_native_for_any_counts(counts, seed):
    """Empty images, all targets in one image, no target at all (float64, exact)."""
    inputs = _inputs(counts, seed)
    want = _run(PackedTargets(), inputs)
    fast = optimize(PackedTargets(), passes=[_capture()])
    got = _run(fast, inputs)
    for a, b in zip(want, got):
        assert (a is None and b is None) or torch.equal(a, b)
    assert fast.stats.optimized == 1


@pytest.mark.parametrize("bad", ["above", "negative"])
def test_a_value_outside_the_bound_abandons_the_call_to_native(bad):
    """An image index at the batch size (native indexes out of the buffer) or below zero (native
    bincount refuses it): the optimized call raises what native raises, from the native loss."""
    fast = optimize(PackedTargets(), passes=[_capture()])
    _run(fast, _inputs([1, 2, 1]))  # traced and rewritten
    pred, keypoints, batch_idx = _inputs([1, 2, 1], seed=3)
    batch_idx = batch_idx.clone()
    batch_idx[-1] = 3 if bad == "above" else -1
    with pytest.raises(Exception) as native:
        PackedTargets()(pred, keypoints, batch_idx)
    with pytest.raises(type(native.value), match=str(native.value)[:40].replace("[", r"\[")):
        fast(pred, keypoints, batch_idx)
    assert fast.stats.native.get("counts-out-of-range") == 1, fast.stats.native


def test_a_bincount_the_rewrite_cannot_check_keeps_its_reads():
    native, fast = UnboundedCounts(), optimize(UnboundedCounts(), passes=[_capture()])
    pred, batch_idx = torch.randn(3, 2, dtype=torch.float64), torch.tensor([0, 0, 2])
    assert torch.equal(native(pred, batch_idx), fast(pred, batch_idx))
    found = _certificates(fast)
    assert set(found) == {"bincount", "bincount_1"}
    assert not found["bincount"].applied and found["bincount"].codes == ("bincount-not-bounded",)
    assert not found["bincount"].checks[0].ok  # no minlength
    assert not found["bincount_1"].applied and not found["bincount_1"].checks[2].ok  # used before the read


@pytest.mark.parametrize("values", [100, 70_000])  # compared with each bin; an index_add_ above COMPARED
def test_the_counts_are_bincounts_and_the_bound_says_whether_every_value_was_counted(values):
    assert (values * 64 > COMPARED) == (values == 70_000)
    x = torch.randint(0, 64, (values,), generator=torch.Generator().manual_seed(values))
    counts, in_range = BoundedBincount("b")(x, 64)
    assert torch.equal(counts, torch.bincount(x, minlength=64)) and bool(in_range)
    for bad in (64, -1):
        x[values // 2] = bad
        assert not bool(BoundedBincount("b")(x, 64)[1])
