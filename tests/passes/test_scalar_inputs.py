"""A float the loss reads each call and multiplies into a tensor reaches the captured region as a
0-dim tensor (``scalar_inputs``): one recording serves every value, and values and gradients are
native's bit for bit (float64 and float32: the float rounded to the tensor's dtype either way),
for any weight (signed zeros, infinities, NaN) and any rows (none among them)."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.cli import import_file
from fxpasses.runtime.scalar_tensor import ScalarTensor

same_bits = import_file(Path(__file__).parents[1] / "helpers" / "bits.py").same_bits
ArgumentWeighted = import_file(Path(__file__).parents[1] / "helpers" / "weighted.py").ArgumentWeighted


class Weighted(nn.Module):
    """Two terms, the second scaled by a weight the training loop sets between calls (as
    ``E2ELoss.o2m``), in both operand orders."""

    def __init__(self, weight: float = 0.8):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = (x.sin() * y).sum(-1)
        b = (x.cos() + y).pow(2).sum(-1)
        return a * self.weight + (1.0 - self.weight) * b


def _capture():
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1, count_copies=False)


def _inputs(rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, generator=g, dtype=dtype).requires_grad_()
    y = torch.randn(rows, 5, generator=g, dtype=dtype).requires_grad_()
    return x, y


def _run(loss, fn, rows, dtype, seed):
    x, y = _inputs(rows, dtype, seed)
    out = fn(x, y)
    out.sum().backward()
    return out.detach(), x.grad, y.grad


weights = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                    st.sampled_from([0.0, -0.0, 0.1, 0.45000000000000007, 1e-45, 3.4e38]))


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.float64, torch.float32]), rows=st.sampled_from([0, 1, 3]),
       values=st.lists(weights, min_size=1, max_size=5))
def test_a_changing_weight_replays_one_recording_and_matches_native_to_the_bit(dtype, rows, values):
    loss = Weighted()
    fast = optimize(loss, passes=[_capture()])
    for call, weight in enumerate([0.8, 0.8, *values]):  # two calls at the first weight: recorded
        loss.weight = weight
        got, want = _run(loss, fast, rows, dtype, call), _run(loss, loss, rows, dtype, call)
        for g, w in zip(got, want):
            assert same_bits(g, w), (weight, g, w)
    gm = fast.specializations[0].graph_module
    scalars = [n for n in gm.graph.nodes if isinstance(n.target, ScalarTensor)]
    regions = [n.target for n in gm.graph.nodes if isinstance(n.target, CapturedRegion)]
    assert len(scalars) == 2 and regions
    assert all(r.made == 1 for r in regions), [dict(r.changes) for r in regions]
    assert fast.stats.optimized == len(values) + 2


@settings(max_examples=15, deadline=None)
@given(dtype=st.sampled_from([torch.float64, torch.float32]), rows=st.sampled_from([0, 3]),
       values=st.lists(weights, min_size=1, max_size=4))
def test_a_float_argument_replays_one_recording_and_matches_native_to_the_bit(dtype, rows, values):
    loss = ArgumentWeighted()
    fast = optimize(loss, passes=[_capture()])
    for call, weight in enumerate([0.8, 0.8, *values, 1]):  # (last: an int, where a float was traced)
        got = _run(loss, lambda a, b: fast(a, b, weight), rows, dtype, call)
        want = _run(loss, lambda a, b: loss(a, b, weight), rows, dtype, call)
        for g, w in zip(got, want):
            assert same_bits(g, w), (weight, g, w)
    gm = fast.specializations[0].graph_module
    scalars = [n for n in gm.graph.nodes if isinstance(n.target, ScalarTensor)]
    regions = [n.target for n in gm.graph.nodes if isinstance(n.target, CapturedRegion)]
    assert len(scalars) == 2 and regions  # the argument's, and 1.0 - weight's
    assert all(r.made == 1 for r in regions), [dict(r.changes) for r in regions]
    assert fast.stats.optimized >= len(values) + 2


def test_a_half_precision_factor_keeps_the_float_a_constant():
    """CUDA multiplies a float16 tensor by a float in float32 arithmetic; a float16 0-dim tensor
    would round the float first: the float stays a constant of the recording."""
    loss = Weighted()
    fast = optimize(loss, passes=[_capture()])
    x, y = (t.detach().half().requires_grad_() for t in _inputs(3, torch.float32, 0))
    fast(x, y)
    certs = [c for c in fast.certificates if c.site.description.startswith("float ")]
    assert len(certs) == 2 and all(not c.applied and c.codes == ("scalar-stays-constant",) for c in certs)
    gm = fast.specializations[0].graph_module
    assert not any(isinstance(n.target, ScalarTensor) for n in gm.graph.nodes)


def test_a_weight_set_to_a_tensor_keeps_its_gradient():
    """A weight the loop sets to a tensor (a learned weight) passes through as it came: its
    gradient is native's, not lost to a copy."""
    loss = Weighted()
    fast = optimize(loss, passes=[_capture()])
    for call in range(2):
        _run(loss, fast, 3, torch.float64, call)
    grads = []
    for fn in (fast, loss):
        loss.weight = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        out = _run(loss, fn, 3, torch.float64, 7)
        grads.append((out, loss.weight.grad))
    (got, got_w), (want, want_w) = grads
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert want_w is not None
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)


def test_the_scalar_is_made_again_only_when_its_bits_change():
    op = ScalarTensor("s", torch.float32, torch.device("cpu"))
    first = op(0.5)
    assert op(0.5) is first and first.dtype == torch.float32 and first.dim() == 0
    zero = op(0.0)
    assert op(-0.0) is not zero and torch.signbit(op(-0.0))
    nan = op(float("nan"))
    assert op(float("nan")) is nan
    assert op(3) == 3 and op(True) is True  # not a float: as it came


class TwiceWeighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = 0.25

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = self.weight  # read once, used twice
        return (x.sin() * w).sum(-1) + (w * y.cos()).sum(-1)


def test_one_float_multiplying_two_tensors_of_one_kind_is_one_tensor():
    loss = TwiceWeighted()
    fast = optimize(loss, passes=[_capture()])
    for call, weight in enumerate([0.25, 0.25, -3.5]):
        loss.weight = weight
        got, want = _run(loss, fast, 3, torch.float64, call), _run(loss, loss, 3, torch.float64, call)
        assert all(same_bits(g, w) for g, w in zip(got, want))
    gm = fast.specializations[0].graph_module
    assert len([n for n in gm.graph.nodes if isinstance(n.target, ScalarTensor)]) == 1
    assert len([c for c in fast.certificates if c.site.description.startswith("float ") and c.applied]) == 2
