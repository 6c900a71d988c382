"""A tensor that a conversion makes from the inputs is recorded, never replayed as the first call's
constant. ``t.type(dtype)`` is a conversion and ``t.type()`` metadata (the type's name); the trace
once took both for metadata, so ``(pred.detach() * s).type(torch.float32)`` on half-precision
predictions (the real criterion's assigner under autocast, loss.py:454) ran once and its result
was held by reference: every later call saw the first call's boxes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.tracing.recorder import Recorder, Unsupported

CONVERSIONS = {
    "type(dtype)": lambda t: t.type(torch.float64),
    "type(dtype=)": lambda t: t.type(dtype=torch.float64),
    "type(name)": lambda t: t.type("torch.DoubleTensor"),
    "to(dtype)": lambda t: t.to(torch.float64),
    "double()": lambda t: t.double(),
}


class Converting(nn.Module):
    def __init__(self, convert):
        super().__init__()
        self.convert = convert

    def forward(self, pred, target):
        weight = self.convert(pred.detach() * 2.0)  # as the assigner's boxes: no gradient
        assert pred.type().endswith("Tensor")  # metadata: the type's name
        assert pred.type(dtype=None) == pred.type()
        return ((pred.double() - target) ** 2 * weight).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_a_converted_tensor_follows_the_inputs(conversion, dtype):
    loss = Converting(CONVERSIONS[conversion])
    fast = optimize(loss, passes=[])
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        pred = torch.randn(5, 3, generator=g).to(dtype).requires_grad_()
        target = torch.randn(5, 3, generator=g, dtype=torch.float64)
        got_pred = pred.detach().clone().requires_grad_()
        got, want = fast(got_pred, target), loss(pred, target)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_pred.grad, pred.grad, rtol=0, atol=0)
    assert fast.stats.optimized == 3 and not fast.stats.native
    assert len(fast.specializations) == 1


def test_a_metadata_read_that_gives_a_tensor_is_refused():
    """The recorder's metadata path runs a call unrecorded: were a tensor to come out of it, the
    trace stops (the loss then runs natively) instead of holding it as a constant."""
    recorder = Recorder(nn.Module(), 0)
    with pytest.raises(Unsupported, match="returned a tensor"):
        recorder._metadata(lambda t: t + 1, (torch.ones(2),), {})
    assert recorder._metadata(torch.Tensor.dim, (torch.ones(2),), {}) == 1
