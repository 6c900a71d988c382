"""CaptureLoss never changes a number silently: what a call through captured regions guarantees.

Each runs in float64 against the native loss, on CPU with the emulated recorder (CUDA graphs'
static-buffer semantics) and, where a device is present, on CUDA with real CUDA graphs (marked
``cuda``): parameters read inside a region get their gradients, outputs the caller keeps are never
overwritten (and may be changed in place), second-order gradients are right, a stale
retain_graph backward raises. Threads sharing one captured loss: tests/runtime/test_threads.py. Besides: a flag read
inside a region, changed between a call's forward and its backward, leaves the backward the
forward's (first order) or raises (second order: the region is recomputed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.cli import import_file
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.call_reads import StateChangedError
from fxpasses.runtime.capture import StaleReplayError
from fxpasses.runtime.emulated import EmulatedRecorder

flows = import_file(Path(__file__).parents[1] / "helpers" / "float64_flows.py")

pytestmark = pytest.mark.usefixtures("float64_default")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return request.param


def capture(device: str = "cpu") -> CaptureLoss:
    if device == "cuda":
        return CaptureLoss(min_bucket=8, count_copies=False, record_after=1)  # real CUDA graphs
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_bucket=8, count_copies=False,
                       record_after=1)  # every small region, replayed from the first call


def _gradients(loss, fn, *args):
    loss.zero_grad(set_to_none=True)
    for a in args:
        a.grad = None
    value = fn(*args)
    value.backward()
    return value.detach(), {n: p.grad for n, p in loss.named_parameters()}, [a.grad for a in args]


def _assert_same_gradients(loss, fast, *args):
    value, params, inputs = _gradients(loss, loss, *args)
    got_value, got_params, got_inputs = _gradients(loss, fast, *args)
    torch.testing.assert_close(got_value, value, rtol=1e-12, atol=1e-12, equal_nan=True)
    for name, grad in params.items():
        assert got_params[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(got_params[name], grad, rtol=1e-10, atol=1e-12, equal_nan=True)
    for got, want in zip(got_inputs, inputs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, equal_nan=True)


def _region_counts(fast):
    return {k: v for k, v in fast.stats.sites.items() if v.get("replayed")}


@pytest.mark.parametrize("rows", [(64, 48), (0, 0), (5, 0)])
def test_a_shared_flow_fused_into_a_region_gets_its_gradients(rows, device):
    loss = flows.TwoBranch().to(device)
    fast = optimize(loss, passes=[PairRLE(), capture(device)])
    for step in range(3):
        a = torch.randn(rows[0], 2, requires_grad=True, device=device)
        b = torch.randn(rows[1], 2, requires_grad=True, device=device)
        _assert_same_gradients(loss, fast, a, b)
    assert _region_counts(fast), "nothing was replayed: the test would prove nothing"


class LinearWeighted(nn.Module):
    """An nn.Linear and a learnable loss weight, both read inside the captured region."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.register_buffer("shift", torch.ones(3))

    def forward(self, x):
        return ((self.lin(x) * self.weight + self.shift).tanh() * 2 + 1).exp().mean()


def test_a_linear_and_a_learnable_weight_inside_a_region_get_their_gradients(device):
    loss = LinearWeighted().to(device)
    fast = optimize(loss, passes=[capture(device)])
    for step in range(3):
        _assert_same_gradients(loss, fast, torch.randn(5, 3, requires_grad=True, device=device))
    assert _region_counts(fast)


class KeepsRows(nn.Module):
    """Returns the per-row log-probabilities besides the loss (kept for logging)."""

    def __init__(self):
        super().__init__()
        self.flow = flows.Flow()

    def forward(self, a, b, mask):
        la, lb = self.flow.log_prob(a[mask]), self.flow.log_prob(b)
        return -la.mean() - lb.mean(), la, lb


def test_paired_outputs_kept_by_the_caller_survive_the_next_call(device):
    loss = KeepsRows().to(device)
    fast = optimize(loss, passes=[PairRLE(), capture(device)])
    kept = []
    for step in range(4):
        a, b = torch.randn(16, 2, device=device), torch.randn(7, 2, device=device)
        mask = torch.rand(16, device=device) > 0.3
        out = fast(a, b, mask)
        out[0].backward()
        kept.append((out[1], out[2], out[1].detach().clone(), out[2].detach().clone(),
                     loss(a, b, mask)))
    for la, lb, la_then, lb_then, (_, want_a, want_b) in kept:
        assert torch.equal(la, la_then) and torch.equal(lb, lb_then)  # not overwritten since
        if device == "cpu":
            assert torch.equal(la, want_a) and torch.equal(lb, want_b)
        else:  # the paired flow's matmuls on stacked rows round differently on a GPU
            torch.testing.assert_close((la, lb), (want_a, want_b))
    assert any("pair" in k and v.get("replayed") for k, v in fast.stats.sites.items())


def identity(x):
    return x


class Aliases(nn.Module):
    def forward(self, x):
        y = (x * 2).tanh().exp() + 1
        return y.sum(), torch.atleast_1d(y), y.swapaxes(0, 1), identity(y), y[1:].t()


def test_outputs_reaching_the_caller_through_aliasing_ops_are_its_own(device):
    loss = Aliases()
    fast = optimize(loss, passes=[capture(device)], leaf_functions=[identity])
    kept = []
    for step in range(4):
        x = torch.randn(4, 3, requires_grad=True, device=device)
        out = fast(x)
        out[0].backward()
        kept.append((out, loss(x)))
    for got, want in kept:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert _region_counts(fast)


class Penalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 3))

    def forward(self, x):
        return ((x * self.weight).tanh().exp() * x).sum()


def _penalty_gradients(module, fn, x):
    module.zero_grad(set_to_none=True)
    x.grad = None
    (g,) = torch.autograd.grad(fn(x), x, create_graph=True)
    (g ** 2).sum().backward()
    return module.weight.grad.clone(), x.grad.clone()


def test_second_order_gradients_through_a_region_are_right(device):
    loss = Penalised().to(device)
    fast = optimize(loss, passes=[capture(device)])
    for step in range(3):
        x = torch.randn(4, 3, requires_grad=True, device=device)
        fast(x).backward()  # a first-order step: recorded and replayed
        want = _penalty_gradients(loss, loss, x)
        got = _penalty_gradients(loss, fast, x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    counts = _region_counts(fast)
    assert counts and all(v.get("double-backward-eager") for v in counts.values())


def test_a_stale_retained_backward_raises(device):
    loss = Penalised().to(device)
    fast = optimize(loss, passes=[capture(device)])
    x = torch.randn(4, 3, requires_grad=True, device=device)
    fast(x).backward()
    first = fast(x)
    first.backward(retain_graph=True)
    first.backward(retain_graph=True)  # twice before a new forward: fine
    fast(x * 2).backward()
    with pytest.raises(StaleReplayError, match="stale-backward"):
        first.backward()


def test_outputs_copied_out_of_graph_memory_can_be_changed_in_place():
    """A caller may scale a returned loss in place (``loss *= accumulation``), as natively: the
    copies are tensors of their own, never views of one shared copy (an unbind's views refuse
    in-place changes)."""
    class Terms(torch.nn.Module):
        def forward(self, x):
            y = (x * 1.5).tanh().exp()
            return y.sum(), (y * y).mean(), y.amax()

    fast = optimize(Terms(), passes=[CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(),
                                                  record_after=1, count_copies=False)])
    for seed in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        total, mean, peak = fast(x)
        want = Terms()(x)
        total *= 2  # in place, on an output that requires grad
        (total + mean + peak).backward()
        assert torch.allclose(total, 2 * want[0]) and torch.allclose(mean, want[1])
    assert any(v.get("replayed") for k, v in fast.stats.sites.items() if "capture_region" in k)


class CenteringFlow(nn.Module):
    """``log_prob`` reads a Python flag: with ``center`` its rows' mean is subtracted first."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(2, 8), nn.Linear(8, 2)
        self.center = False

    def log_prob(self, x):
        if self.center:
            x = x - x.mean(0, keepdim=True)
        return -(self.outer(torch.tanh(self.inner(x))) ** 2).sum(-1)


class TwoBranchCentering(flows.TwoBranch):
    def __init__(self):
        super().__init__()
        self.flow = CenteringFlow()


def _forwards_then_backwards(fn, loss, calls):
    """Call 0's forward, ``flow.center = True``, call 1's forward, then both backwards (the
    first call's gradients read before the second's backward)."""
    loss.zero_grad(set_to_none=True)
    loss.flow.center = False
    first = fn(*calls[0])
    loss.flow.center = True
    second = fn(*calls[1])
    first.backward()
    seen = [a.grad.clone() for a in calls[0]] + [p.grad.clone() for p in loss.parameters()]
    second.backward()
    return seen + [a.grad for a in calls[1]] + [p.grad for p in loss.parameters()]


def test_a_flag_changed_while_a_backward_is_pending_leaves_that_backward_as_recorded(device):
    """Census (the property over every caller shape, interleaved schedule): call 0 replays the
    paired call's recording; ``flow.center`` changes, call 1 traces again; call 0's backward
    then replays the recorded backward, which reads no Python. The emulated recorder re-ran the
    flow for its backward, with the new flag: call 0's gradients were wrong."""
    loss = TwoBranchCentering().to(device)
    fast = optimize(loss, passes=[PairRLE(), capture(device)])

    def calls():
        g = torch.Generator(device).manual_seed(0)
        return [tuple(torch.randn(n, 2, generator=g, device=device, requires_grad=True) for n in (5, 4))
                for _ in range(2)]

    expected = _forwards_then_backwards(loss, loss, calls())
    got = _forwards_then_backwards(fast, loss, calls())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert fast.stats.sites and any(v.get("replayed") for v in fast.stats.sites.values())


def test_a_flag_changed_before_a_second_order_backward_raises(device):
    """A second-order backward recomputes the region eagerly, its flow call reading
    ``flow.center`` again: set after the forward, the gradients were silently those of the other
    branch of the flow's code. Now it raises; with the flag as at the forward it is exact."""
    loss = TwoBranchCentering().to(device)
    fast = optimize(loss, passes=[PairRLE(), capture(device)])
    for change in (False, True):
        g = torch.Generator(device).manual_seed(0)
        a, b = (torch.randn(n, 2, generator=g, device=device, requires_grad=True) for n in (5, 4))
        loss.flow.center = False
        out = fast(a, b)
        loss.flow.center = change
        if change:
            with pytest.raises(StateChangedError, match="loss.flow.center"):
                torch.autograd.grad(out, (a, b), create_graph=True)
        else:
            grads = torch.autograd.grad(out, (a, b), create_graph=True)
            del grads
        del out  # the replay's memory is free again: the next call replays too
    (counts,) = [v for v in fast.stats.sites.values() if v.get("replayed")]
    assert counts["replayed"] == 2 and counts["double-backward-eager"] == 1
