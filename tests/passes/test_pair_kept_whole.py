"""What the code of a call kept whole reads and writes: assumptions of the rewrites that rely on it.

A flow's ``log_prob`` (or a leaf module's ``forward``) runs as one node; the row proof and the
witness ran its code for the values it read then. Those reads are guarded before every call of
the pairing specialization (a change traces again, and the proof runs again), and a method that
writes the loss's Python state is not paired.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import PairCalls, PairRLE, SelectRows

from .test_pair_rle import SelectedRowsLoss, SmallFlow, make_inputs

CENTRED = {"on": False}  # a global the flow reads


class CentredFlow(nn.Module):
    """Centres its rows (a row-mixing path) when ``center`` is set."""

    def __init__(self):
        super().__init__()
        self.inner = SmallFlow()
        self.center = False

    def log_prob(self, x):
        if self.center:
            x = x - x.mean(0, keepdim=True)
        return self.inner.log_prob(x)


class GlobalCentredFlow(nn.Module):
    """Centres its rows when the global ``CENTRED["on"]`` is set."""

    def __init__(self):
        super().__init__()
        self.inner = SmallFlow()

    def log_prob(self, x):
        if CENTRED["on"]:
            x = x - x.mean(0, keepdim=True)
        return self.inner.log_prob(x)


class CentringHead(nn.Module):
    """A leaf module with a Python flag read in its forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.center = False

    def forward(self, x):
        if self.center:
            x = x - x.mean(0, keepdim=True)
        return self.linear(x).squeeze(-1)


class HeadLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow = CentringHead()

    def forward(self, pred_a, pred_b, target, visible_a, visible_b, sigma):
        a = self.flow((pred_a[visible_a] - target[visible_a]) / sigma[visible_a])
        b = self.flow((pred_b[visible_b] - target[visible_b]) / sigma[visible_b])
        return 0.7 * a.sum() + 0.3 * b.sum()


def _native_and_fast(loss, fast, args):
    """Loss values and the gradients of every input and parameter, native and optimized, from
    the same state (native on a copy made before the optimized call)."""
    results = []
    for fn, module in ((copy.deepcopy(loss), None), (fast, loss)):
        module = module if module is not None else fn
        inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
        out = fn(*inputs)
        params = [p for p in module.parameters()]
        grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad] + params, allow_unused=True)
        results.append((out.detach(), grads))
    return results


def _assert_native(loss, fast, args):
    (out_n, grads_n), (out_f, grads_f) = _native_and_fast(loss, fast, args)
    torch.testing.assert_close(out_f, out_n, rtol=1e-12, atol=1e-12)
    for g_f, g_n in zip(grads_f, grads_n, strict=True):
        assert (g_f is None) == (g_n is None)
        if g_n is not None:
            torch.testing.assert_close(g_f, g_n, rtol=1e-10, atol=1e-12)


def _pair_certificates(fast, name="PairRLE"):
    return [c for c in fast.certificates if c.pass_name == name]


@pytest.mark.parametrize("flow_class", [CentredFlow, GlobalCentredFlow])
def test_a_flag_read_inside_the_paired_flow_is_guarded(flow_class):
    torch.manual_seed(0)
    loss = SelectedRowsLoss(flow_class()).double()
    fast = optimize(loss, passes=[PairRLE()])
    _assert_native(loss, fast, make_inputs(48, 0, 0.5, 0.5, True))
    (cert,) = _pair_certificates(fast)
    assert cert.applied
    read = "loss.flow.center" if flow_class is CentredFlow else "global CENTRED"
    guard = next(g for g in cert.guards if g.evidence.get("reads") == read)
    assert guard.code == "assumption-changed" and guard.evidence["read_by"] == "flow.log_prob"

    def centre(on):
        if flow_class is CentredFlow:
            loss.flow.center = on
        else:
            CENTRED["on"] = on

    try:
        for step, on in enumerate([True, False, True], start=1):
            centre(on)
            _assert_native(loss, fast, make_inputs(48, step, 0.5, 0.5, True))
    finally:
        CENTRED["on"] = False
    later = _pair_certificates(fast)[1]  # the trace made with the flag set refuses the pairing
    assert later.codes == ("rows-mixed",)
    assert fast.stats.retraced and fast.stats.optimized == 4


def test_a_flag_read_inside_a_leaf_module_is_guarded():
    torch.manual_seed(0)
    loss = HeadLoss().double()
    fast = optimize(loss, passes=[PairCalls("forward")], leaf_modules=[CentringHead])
    _assert_native(loss, fast, make_inputs(48, 0, 0.5, 0.5, True))
    (cert,) = _pair_certificates(fast, "PairCalls")
    assert cert.applied and any(g.evidence.get("reads") == "loss.flow.center" for g in cert.guards)
    loss.flow.center = True
    _assert_native(loss, fast, make_inputs(48, 1, 0.5, 0.5, True))
    assert _pair_certificates(fast, "PairCalls")[1].codes == ("rows-mixed",)


def test_a_read_inside_an_unpaired_call_is_no_assumption():
    """Refused pairings rely on nothing: changing the flag of an unpaired flow retraces nothing."""
    torch.manual_seed(0)
    loss = SelectedRowsLoss(CentredFlow()).double()
    loss.flow.center = True
    fast = optimize(loss, passes=[PairRLE()])
    _assert_native(loss, fast, make_inputs(48, 0, 0.5, 0.5, True))
    assert _pair_certificates(fast)[0].codes == ("rows-mixed",)
    loss.flow.center = False
    _assert_native(loss, fast, make_inputs(48, 1, 0.5, 0.5, True))
    assert len(fast.specializations) == 1 and not fast.stats.retraced


class CountingFlow(SmallFlow):
    """Counts its calls in a Python attribute."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def log_prob(self, x):
        self.calls += 1
        return SmallFlow.log_prob(self, x)


def test_a_flow_that_writes_its_python_state_is_not_paired():
    torch.manual_seed(0)
    loss = SelectedRowsLoss(CountingFlow()).double()
    native = copy.deepcopy(loss)
    fast = optimize(loss, passes=[PairRLE(allow_overrides=[CountingFlow])])
    for step in range(3):
        args = make_inputs(40, step, 0.5, 0.5, False)
        torch.testing.assert_close(fast(*args), native(*args), rtol=1e-12, atol=1e-12)
    (cert,) = _pair_certificates(fast)
    assert cert.codes == ("pair-state-written",)
    assert loss.flow.calls == native.flow.calls == 6


def test_a_flag_read_inside_a_leaf_module_in_a_selection_region_is_guarded():
    torch.manual_seed(0)
    loss = HeadLoss().double()
    fast = optimize(loss, passes=[SelectRows()], leaf_modules=[CentringHead])
    _assert_native(loss, fast, make_inputs(48, 0, 0.5, 0.5, True))
    first = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert first and all(c.applied for c in first)
    assert all(any(g.evidence.get("reads") == "loss.flow.center" for g in c.guards) for c in first)
    loss.flow.center = True
    _assert_native(loss, fast, make_inputs(48, 1, 0.5, 0.5, True))
    later = [c for c in fast.certificates if c.pass_name == "SelectRows"][len(first):]
    assert later and all(c.codes == ("rows-mixed",) for c in later)
