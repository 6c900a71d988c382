"""A call whose optimized path raises: native's exception when native raises too, native's result
(counted) when it does not, and later calls optimized again; three such in a row disable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fxpasses import PassResult, optimize
from fxpasses.certificates import Certificate, Site
from fxpasses.cli import import_file
from fxpasses.passes import PairRLE
from fxpasses.ir.runtime_op import RuntimeOp

flows = import_file(Path(__file__).parents[1] / "helpers" / "float64_flows.py")

pytestmark = pytest.mark.usefixtures("float64_default")


def _inputs(seed: int = 0, width: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(10, width, generator=g, requires_grad=True),
            torch.randn(7, 2, generator=g, requires_grad=True), torch.rand(10, generator=g) > 0.3)


def _gradients(loss, fn, args):
    value = fn(*args)
    return value.detach(), torch.autograd.grad(value, [*args[:2], *loss.parameters()])


def _assert_native(loss, fast, args):
    before = loss.total
    value, grads = _gradients(loss, fast, args)
    after, loss.total = loss.total, before
    want_value, want_grads = _gradients(loss, loss, args)
    assert torch.equal(value, want_value)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(after, loss.total)  # the total updated once, as natively


def test_an_error_native_raises_too_propagates_as_natives_and_later_calls_run_optimized():
    loss = flows.MaskedWithTotal()
    fast = optimize(loss, passes=[PairRLE()])
    _assert_native(loss, fast, _inputs(0))
    wrong = _inputs(1, width=3)  # the flow takes 2 columns: natively an error as well
    with pytest.raises(RuntimeError) as native:
        loss(*wrong)
    total = loss.total
    with pytest.raises(type(native.value)) as raised:
        fast(*wrong)
    assert str(raised.value) == str(native.value)
    assert raised.value.__cause__ is None and raised.value.__context__ is None  # raised once
    assert loss.total is total  # nothing written by the failed call
    for seed in (2, 3):
        _assert_native(loss, fast, _inputs(seed))
    stats = fast.stats
    assert stats.native == {"native-raised": 1} and not stats.exceptions, stats.render()
    assert stats.optimized == 3 and all(fast.disabled(s) is None for s in fast.specializations)


class _Swapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        y = self.lin(x)
        return (y * y).sum() + y.swapaxes(0, 1).sum()


def test_an_error_inside_a_captured_region_is_not_printed_before_natives_propagates(capfd):
    from fxpasses.passes import CaptureLoss
    from fxpasses.runtime.emulated import EmulatedRecorder

    fast = optimize(_Swapped(), passes=[CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(),
                                                    record_after=1)])
    for _ in range(3):
        fast(torch.randn(5, 2, requires_grad=True)).backward()
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fast(torch.randn(5, 3, requires_grad=True))  # the linear takes 2 columns: natively too
    assert "FX-traced" not in capfd.readouterr().err  # torch.fx's print of its generated code
    assert fast.stats.native == {"native-raised": 1}, fast.stats.render()


class Scaled(flows.MaskedWithTotal):
    """The same with an int setting the trace reads (an exponent): a change traces again."""

    power = 1

    def forward(self, a, b, mask):
        return super().forward(a, b, mask) ** self.power


def test_an_error_on_a_call_that_traces_again_leaves_later_calls_optimized():
    """Census (mutations and a bad call): the setting changes right before a call that raises
    natively. That call is traced (no trace holds for the new setting); the trace raises; its
    refusal matched every later call of the same structure, valid ones too, which all ran
    natively (``trace-failed``). Now the refusal is dropped: native's error was the call's."""
    loss = Scaled()
    fast = optimize(loss, passes=[PairRLE()])
    _assert_native(loss, fast, _inputs(0))
    loss.power = 2
    with pytest.raises(RuntimeError) as raised:
        fast(*_inputs(1, width=3))
    assert raised.value.__context__ is None
    for seed in (2, 3):
        _assert_native(loss, fast, _inputs(seed))
    stats = fast.stats
    assert stats.native == {"native-raised": 1}, stats.render()
    assert stats.optimized == 3 and all(fast.disabled(s) is None for s in fast.specializations)


class _RaiseOnce(RuntimeOp):
    """Raises an out-of-memory error on its ``at``-th call (counting from 0), else passes its
    value on."""

    def __init__(self, op_id: str, at: set[int]):
        super().__init__(op_id)
        self.at, self.calls = at, 0

    def propagate(self, value):
        return value

    def __call__(self, value):
        self.calls += 1
        if self.calls - 1 in self.at:
            raise torch.OutOfMemoryError("injected: out of memory")
        return value


class RaiseAt:
    """Test pass: the loss's value goes through a _RaiseOnce just before the output (after the
    attribute write)."""

    name = "raise-at"

    def __init__(self, *at: int):
        self.op = _RaiseOnce("raise_at", set(at))

    def run(self, gm: fx.GraphModule) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        (value,) = output.args[0]
        with gm.graph.inserting_before(output):
            raised = gm.graph.call_function(self.op, (value,))
        output.args = ((raised,),)
        return PassResult(gm, True, [Certificate("raise-at", Site((value.name,)), "applied")])


def test_a_transient_failure_returns_natives_result_counted_and_later_calls_run_optimized():
    loss = flows.MaskedWithTotal()
    fast = optimize(loss, passes=[PairRLE(), RaiseAt(1)])
    for seed in range(4):  # the second call's optimized run raises once
        _assert_native(loss, fast, _inputs(seed))
    stats = fast.stats
    assert stats.native == {"optimized-path-raised": 1} and stats.optimized == 3, stats.render()
    (exc,) = stats.exceptions
    assert exc.type == "OutOfMemoryError" and exc.node == "raise_at"
    assert fast.disabled(fast.specializations[0]) is None


def test_failures_that_native_survives_disable_the_specialization_only_three_in_a_row():
    loss = flows.MaskedWithTotal()
    fast = optimize(loss, passes=[PairRLE(), RaiseAt(1, 2, 4, 5, 6)])
    for seed in range(8):  # optimized, 2 failures, optimized (the count starts again), 3 failures
        _assert_native(loss, fast, _inputs(seed))
    stats = fast.stats
    assert stats.optimized == 2 and len(stats.exceptions) == 5
    assert stats.native == {"optimized-path-raised": 5, "optimized-path-disabled": 1}, stats.render()
    assert fast.disabled(fast.specializations[0]) == "optimized-path-disabled"
