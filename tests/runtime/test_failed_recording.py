"""A recording that raises part-way leaves the call as it found it: the region runs eagerly with
the grad mode the call had. On a GPU a capture raises where an op may not run while a stream
captures; inside the region's no-grad block (``GradOff`` ... ``GradRestore``) that left gradients
off, and the eager run then returned a loss without a ``grad_fn`` (a real fit crashed in its
backward; a loss with other terms would have lost some gradients silently)."""

from __future__ import annotations

import torch

from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder

CAPTURING = {"on": False}


class FailingCapture(EmulatedRecorder):
    """Raises inside the recorded function while it is captured, as CUDA does for a sync."""

    def _capturing(self, graph, pool, run):
        CAPTURING["on"] = True
        try:
            return super()._capturing(graph, pool, run)
        finally:
            CAPTURING["on"] = False


def region_fn(x):
    y = x * 2
    torch._C._set_grad_enabled(False)  # as a traced no-grad block runs
    if CAPTURING["on"]:
        raise RuntimeError("operation not permitted when stream is capturing")
    scale = y.detach().sum()
    torch._C._set_grad_enabled(True)
    return y * scale


def test_a_capture_raising_in_a_no_grad_block_leaves_gradients_on(caplog):
    region = CapturedRegion("r", region_fn, recorder=FailingCapture(), record_after=1)
    for _ in range(2):
        x = torch.arange(1.0, 5.0, dtype=torch.float64, requires_grad=True)
        out = region(x)
        assert torch.is_grad_enabled()
        assert out.requires_grad
        out.sum().backward()
        ref = torch.arange(1.0, 5.0, dtype=torch.float64, requires_grad=True)
        region_fn(ref).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    assert region.failure is not None and "capturing" in region.failure
    said = [r.getMessage() for r in caplog.records if r.name == "fxpasses"]
    assert len(said) == 1 and "region r could not be recorded" in said[0] and "capturing" in said[0]
