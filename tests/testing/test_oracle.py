"""The float64 equivalence oracle: it passes equal callables, detects a planted difference in a
value and in a single parameter gradient, compares NaN positions, and leaves the originals alone."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from fxpasses.testing import assert_equivalent, compare
from fxpasses.workloads.pose import DualBranchPoseLoss, DualLossOutput, make_batch


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.first(x))
        return {"out": self.second(hidden), "aux": hidden.sum()}


class ScaledGradient(Tiny):
    """Same values as Tiny; the gradient of ``second.bias`` alone is scaled by 1 + 1e-6."""

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        bias = self.second.bias
        bias = bias.detach() + (bias - bias.detach()) * (1 + 1e-6)
        return {"out": nn.functional.linear(hidden, self.second.weight, bias), "aux": hidden.sum()}


class ShiftedValue(Tiny):
    def forward(self, x):
        out = super().forward(x)
        return {"out": out["out"], "aux": out["aux"] + 1e-6}


class UnusedParameter(Tiny):
    """``first.bias`` outside the autograd graph (Tiny gives it a gradient)."""

    def forward(self, x):
        hidden = torch.tanh(nn.functional.linear(x, self.first.weight, self.first.bias.detach()))
        return {"out": self.second(hidden), "aux": hidden.sum()}


def _x() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()


def test_equal_callables_are_equivalent():
    report = compare(Tiny(), Tiny(), (_x(),))
    assert report.ok and report.worst.ratio == 0.0
    wheres = {c.where for c in report.comparisons}
    assert {"output ['out']", "output ['aux']", "grad args[0]", "grad param first.weight",
            "grad param second.bias"} <= wheres


def test_planted_value_difference_is_found():
    report = compare(Tiny(), ShiftedValue(), (_x(),))
    assert not report.ok
    assert [c.where for c in report.failures] == ["output ['aux']"]
    assert report.worst.kind == "value" and report.worst.max_abs == pytest.approx(1e-6, rel=1e-6)
    with pytest.raises(AssertionError):
        assert_equivalent(Tiny(), ShiftedValue(), (_x(),))


def test_planted_single_parameter_gradient_difference_is_found():
    report = compare(Tiny(), ScaledGradient(), (_x(),))
    assert [c.where for c in report.failures] == ["grad param second.bias"]
    assert report.worst.where == "grad param second.bias"
    assert report.worst.max_rel == pytest.approx(1e-6, rel=1e-3)


def test_parameter_outside_the_graph_differs_from_a_zero_gradient():
    report = compare(Tiny(), UnusedParameter(), (_x(),))
    assert [(c.where, c.kind) for c in report.failures] == [("grad param first.bias", "missing")]


def test_nan_positions_are_compared_not_crashed_on():
    x = torch.tensor([1.0, math.nan, math.inf, -2.0])
    same = compare(lambda t: t * 1.0, lambda t: t + 0.0, (x,))
    assert same.ok
    moved = compare(lambda t: t * 1.0, lambda t: t.flip(0).flip(0).nan_to_num(nan=0.0), (x,))
    assert not moved.ok and moved.worst.kind == "nan" and moved.worst.index == (1,)
    signed = compare(lambda t: t * 1.0, lambda t: t.abs() * t.sign().clamp(min=-1), (-x,))
    assert signed.ok
    flipped = compare(lambda t: t * 1.0, lambda t: torch.where(t.isinf(), -t, t), (x,))
    assert not flipped.ok and flipped.worst.index == (2,) and flipped.worst.ratio == math.inf


def test_structure_and_type_differences_are_reported():
    report = compare(lambda t: (t, t), lambda t: [t, t], (torch.ones(2),))
    assert report.worst.kind == "structure" and not report.ok
    report = compare(lambda t: {"a": t.sum()}, lambda t: {"a": 1.0}, (torch.ones(2),))
    assert report.worst.kind == "type"
    report = compare(lambda t: t.reshape(2, 1), lambda t: t, (torch.ones(2),))
    assert report.worst.kind == "shape"


def test_runs_in_float64_on_copies_and_leaves_originals_alone():
    seen = []

    class Spy(Tiny):
        def forward(self, x):
            seen.append((x.dtype, self.first.weight.dtype))
            return super().forward(x)

    model, x = Spy(), _x()
    before = model.first.weight.detach().clone()
    assert compare(model, Tiny(), (x,)).ok
    assert seen == [(torch.float64, torch.float64)]
    assert model.first.weight.dtype == torch.float32 and torch.equal(model.first.weight, before)
    assert model.first.weight.grad is None and x.grad is None and x.dtype == torch.float32


def test_a_tensor_shared_by_two_inputs_stays_shared():
    x = _x()
    report = compare(lambda a, b: a * b, lambda a, b: a * a, (x, x))
    assert report.ok and {c.where for c in report.comparisons} == {"output ", "grad args[0]"}


def test_pose_loss_outputs_and_tensor_alpha():
    inputs = make_batch(1, seed=0, image_size=64, max_objects=2)
    torch.manual_seed(0)
    reference = DualBranchPoseLoss()
    torch.manual_seed(0)
    report = compare(reference, DualBranchPoseLoss(), (inputs,), {"alpha": torch.tensor(0.4)})
    assert report.ok
    assert "output .alpha" in {c.where for c in report.comparisons}
    assert "grad args[0].o2o.sigmas" in {c.where for c in report.comparisons}

    class Perturbed(DualBranchPoseLoss):
        def forward(self, inputs, alpha=None):
            out = super().forward(inputs, alpha)
            o2o = {**out.branches["o2o"], "rle": out.branches["o2o"]["rle"] * (1 + 1e-5)}
            return DualLossOutput(out.total, {**out.branches, "o2o": o2o}, out.alpha)

    torch.manual_seed(0)
    report = compare(reference, Perturbed(), (inputs,))
    failed = {c.where for c in report.failures}
    assert "output .branches['o2o']['rle']" in failed and "output .total" not in failed
    assert "grad args[0].o2o.sigmas" in failed and "grad args[0].o2m.sigmas" not in failed


class _TanhToSin:
    """A pass that changes numbers: every ``torch.tanh`` becomes ``torch.sin``."""

    name = "TanhToSin"

    def run(self, gm):
        from fxpasses.pipeline import PassResult

        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.tanh]
        for node in nodes:
            node.target = torch.sin
        return PassResult(gm, bool(nodes))


def test_an_optimized_loss_is_compared_on_its_optimized_path():
    """The copy of an OptimizedLoss must not fall back to its native loss (its guards hold the
    object ids of the original's submodules): a pass that changes numbers is caught."""
    from fxpasses import optimize

    torch.manual_seed(0)
    model = Tiny()
    fast = optimize(model, passes=[_TanhToSin()])
    report = compare(model, fast, (_x(),))
    assert not report.ok and "output ['out']" in {c.where for c in report.failures}
    assert fast.stats.calls == 0  # the original was not called


def test_comparing_an_optimized_loss_warns_nothing(two_branch_loss, two_branch_inputs):
    """The oracle copies the candidate; an OptimizedLoss that ran once holds pytree specs, whose
    deep copy torch 2.13 warns about (FutureWarning on LeafSpec): only the loss and its options
    are copied, so nothing warns."""
    from fxpasses import optimize
    from fxpasses.passes import PairRLE

    fast = optimize(two_branch_loss, passes=[PairRLE()])
    fast(*two_branch_inputs).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_equivalent(two_branch_loss, fast, two_branch_inputs)
