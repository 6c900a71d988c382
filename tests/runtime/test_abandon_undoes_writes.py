"""An abandoned optimized call leaves the loss's attributes as it found them.

A loss that updates a running value (``self.ema = 0.5 * self.ema + 1``) before a data-dependent
decision (``if mask.any():``): when the decision goes the other way, the optimized call is
abandoned and the call runs natively. Were the abandoned call's write kept, the native run would
update the value again, and the loss would drift from native from then on (silently).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fxpasses import optimize


class RunningValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ema = 1.0

    def forward(self, x, mask):
        self.ema = self.ema * 0.5 + 1.0
        self.seen = x.shape[0]  # an attribute the loss makes on its first call
        if mask.any():
            return x[mask].sum() * self.ema
        return x.sum() * 0.0


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=2, max_size=8))
def test_abandoned_calls_leave_the_attributes_as_native_does(masks):
    native, optimized = RunningValue(), RunningValue()
    fast = optimize(optimized, passes=[])
    x = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64, requires_grad=True)
    for mask in masks:
        mask = torch.tensor(mask)
        expected, got = native(x, mask), fast(x, mask)
        assert torch.equal(expected, got)
        assert (native.ema, native.seen) == (optimized.ema, optimized.seen)
        (gx,) = torch.autograd.grad(got, x, allow_unused=True)
        (ex,) = torch.autograd.grad(expected, x, allow_unused=True)
        assert (gx is None and ex is None) or torch.equal(gx, ex)


def test_an_abandoned_call_removes_an_attribute_it_made():
    optimized = RunningValue()
    fast = optimize(optimized, passes=[])
    x = torch.ones(4, dtype=torch.float64)
    fast(x, torch.tensor([True, False, True, False]))  # traced on this path
    del optimized.seen
    fast(x, torch.zeros(4, dtype=torch.bool))  # abandoned (the guard fails), then native
    assert sum(fast.stats.abandoned.values()) == 1 and fast.stats.optimized == 1
    assert optimized.seen == 4 and optimized.ema == 1.75  # updated once per call: 1.5, 1.75
