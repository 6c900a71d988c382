"""RealNVP flows: shapes (empty included), linear-call counts, density, row independence."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fxpasses.workloads.pose import RealNVP, SplitRealNVP
from fxpasses.testing.counting import CountLinear

FLOWS = (RealNVP, SplitRealNVP)


def _scrambled(flow: nn.Module, std: float = 0.15) -> nn.Module:
    """The flow with weights large enough that it is far from the identity."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in flow.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return flow.double()


@pytest.mark.parametrize("flow_cls", FLOWS)
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_log_prob_maps_rows_to_rows_including_none(flow_cls, rows):
    flow = flow_cls()
    x = torch.randn(rows, 2, requires_grad=True)
    logp = flow.log_prob(x)
    assert logp.shape == (rows,)
    assert torch.isfinite(logp).all()
    logp.sum().backward()
    # zero rows still use every parameter: each gets a gradient tensor (zeros), never None
    for p in flow.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
        if rows == 0:
            assert not p.grad.any()


@pytest.mark.parametrize("flow_cls, expected", [(RealNVP, 18), (SplitRealNVP, 36)])
def test_linear_calls_per_log_prob(flow_cls, expected):
    flow = flow_cls()
    assert sum(isinstance(m, nn.Linear) for m in flow.modules()) == expected
    with CountLinear() as counter:
        flow.log_prob(torch.randn(5, 2))
    assert counter.calls == expected


@pytest.mark.parametrize("flow_cls", FLOWS)
def test_zero_conditioners_give_the_standard_normal(flow_cls):
    flow = flow_cls().double()
    with torch.no_grad():
        for p in flow.parameters():
            p.zero_()
    x = torch.randn(11, 2, dtype=torch.float64)
    expected = -0.5 * (x * x).sum(-1) - math.log(2 * math.pi)
    torch.testing.assert_close(flow.log_prob(x), expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("flow_cls", FLOWS)
def test_log_prob_is_a_normalised_density(flow_cls):
    flow = _scrambled(flow_cls())
    ticks = torch.linspace(-15.0, 15.0, 301, dtype=torch.float64)
    grid = torch.cartesian_prod(ticks, ticks)
    with torch.no_grad():
        logp = flow.log_prob(grid)
    mass = logp.exp().sum() * (ticks[1] - ticks[0]) ** 2
    assert abs(float(mass) - 1.0) < 1e-3
    # far from the base density near the origin: the test is not vacuous
    normal = -0.5 * (grid * grid).sum(-1) - math.log(2 * math.pi)
    near = grid.abs().amax(-1) < 3
    assert (logp - normal)[near].abs().max() > 0.5


@pytest.mark.parametrize("flow_cls", FLOWS)
def test_each_row_depends_on_its_row_alone(flow_cls):
    flow = _scrambled(flow_cls())
    a, b = torch.randn(6, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    together = flow.log_prob(torch.cat((a, b)))
    torch.testing.assert_close(together, torch.cat((flow.log_prob(a), flow.log_prob(b))),
                               rtol=1e-12, atol=1e-12)
