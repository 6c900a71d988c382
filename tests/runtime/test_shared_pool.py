"""A region's recordings share one memory pool: a replay is admitted only while no tensor refers
to the static outputs of *any* of them (a later capture may hold its outputs where an earlier
one's activations were, and that earlier graph's replay writes them).

On CPU the emulated recorder garbles the other recordings' outputs at every replay (the worst
case of a shared pool); on CUDA real graphs run (whether their memory overlaps is the
allocator's choice, so there the test can only pass)."""

from __future__ import annotations

import pytest
import torch

from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return request.param


def _region(device: str) -> CapturedRegion:
    recorder = EmulatedRecorder() if device == "cpu" else None
    return CapturedRegion("r", lambda x: (x * 2).exp().cumsum(0), recorder=recorder, record_after=1)


def test_an_output_kept_from_one_recording_survives_a_replay_of_another(device):
    region = _region(device)
    for n in (4096, 64, 4096, 64):  # two signatures, each recorded then replayed
        region(torch.randn(n, device=device))
    kept = region(torch.randn(64, device=device))  # a replay of the second recording, kept
    then = kept.clone()
    other = region(torch.randn(4096, device=device))  # the first signature again
    assert torch.equal(kept, then)
    assert other.isfinite().all()
    assert region.counters["outputs-alive"] == 1  # the first signature ran natively
    del kept
    region(torch.randn(4096, device=device))
    assert region.counters["outputs-alive"] == 1  # and replays again once nothing is kept


def test_a_no_grad_output_saved_for_an_eager_backward_keeps_its_values(device):
    """Two forwards before one backward: the first call's output of a region without a backward
    (no pending replay to wait for) is saved by an eager op; the second call, another signature,
    must not replay over it."""
    region = _region(device)
    weight = torch.ones(1, device=device, requires_grad=True)
    for n in (32, 16, 32, 16):
        region(torch.randn(n, device=device))
    xs = [torch.randn(n, device=device) for n in (16, 32)]
    losses = [(region(x) * weight).sum() for x in xs]  # mul saves the region's output
    sum(losses).backward()
    want = sum(((x * 2).exp().cumsum(0)).sum() for x in xs)
    torch.testing.assert_close(weight.grad[0], want)
