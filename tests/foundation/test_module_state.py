"""Runs made for analysis leave the modules as they found them: buffers, parameters, attributes.

The trace runs the loss once, shape propagation runs its modules on fake tensors, the row proofs,
witnesses and SelectRows' witness run copies; a BatchNorm in training updates its running
statistics in each real run (without moving every version counter), a forward may count its
calls in an attribute. After N optimized calls every buffer and attribute is what N native
calls leave, bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.isolation import ModuleState
from fxpasses.passes import CaptureLoss, PairCalls, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder

from ..passes.test_pair_rle import NormalisedFlow, SelectedRowsLoss, make_inputs


def _passes(name):
    capture = lambda: CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())  # noqa: E731
    return {"pair": lambda: [PairRLE()], "select": lambda: [SelectRows()], "capture": lambda: [capture()],
            "all": lambda: [PairRLE(), SelectRows(), capture()]}[name]()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _assert_same_state(module: nn.Module, native: nn.Module) -> None:
    for (name, got), (_, expected) in zip([*module.named_buffers(), *module.named_parameters()],
                                          [*native.named_buffers(), *native.named_parameters()],
                                          strict=True):
        assert _same_bits(got, expected), name


@pytest.mark.parametrize("passes", ["pair", "select", "capture", "all"])
def test_batchnorm_statistics_move_as_natively(passes):
    torch.manual_seed(0)
    loss = SelectedRowsLoss(NormalisedFlow()).double()
    native = copy.deepcopy(loss)
    fast = optimize(loss, passes=_passes(passes))
    for step in range(3):
        args = make_inputs(40, step, 0.5, 0.5, False)
        torch.testing.assert_close(fast(*args), native(*args), rtol=0, atol=0)
    if passes in ("pair", "all"):
        assert "rows-mixed" in next(c for c in fast.certificates if c.pass_name == "PairRLE").codes
    assert int(loss.flow.norm.num_batches_tracked) == int(native.flow.norm.num_batches_tracked) == 6
    _assert_same_state(loss, native)


class Counted(nn.Module):
    """A leaf module that counts its calls and keeps a history."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.calls = 0
        self.seen = []

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape[0])
        return self.linear(x).squeeze(-1)


class CountedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Counted()

    def forward(self, pred_a, pred_b, target, visible_a, visible_b, sigma):
        a = self.head(pred_a[visible_a] - target[visible_a])
        b = self.head(pred_b[visible_b] - target[visible_b])
        return a.sum() + b.sum()


def test_a_counter_in_a_leaf_module_counts_as_natively():
    torch.manual_seed(0)
    loss = CountedLoss().double()
    native = copy.deepcopy(loss)
    fast = optimize(loss, passes=[PairCalls("forward"), SelectRows()], leaf_modules=[Counted])
    for step in range(3):
        args = make_inputs(40, step, 0.5, 0.5, False)
        torch.testing.assert_close(fast(*args), native(*args), rtol=1e-12, atol=1e-12)
    assert next(c for c in fast.certificates if c.pass_name == "PairCalls").codes == ("pair-state-written",)
    assert {c.codes for c in fast.certificates if c.pass_name == "SelectRows"} == {("select-state-written",)}
    assert loss.head.calls == native.head.calls == 6
    assert loss.head.seen == native.head.seen


def test_module_state_puts_back_attributes_containers_and_tensor_bits():
    module = nn.BatchNorm1d(2).double()
    module.note, module.items = "kept", [1, 2]
    with torch.no_grad():
        module.running_mean.fill_(math.nan)
    weight, mean = module.weight, module.running_mean
    state = ModuleState([module])
    module(torch.randn(4, 2, dtype=torch.float64))  # running statistics updated in place
    module.note, module.extra = "changed", 1
    module.items.append(3)
    with torch.no_grad():
        module.weight.mul_(2)
    module.running_var = torch.zeros(2, dtype=torch.float64)  # a buffer slot rebound
    changed = state.restore()
    assert changed
    assert module.note == "kept" and not hasattr(module, "extra") and module.items == [1, 2]
    assert module.weight is weight and module.running_mean is mean
    assert bool(module.weight.eq(1).all()) and bool(module.running_mean.isnan().all())
    assert bool(module.running_var.eq(1).all()) and int(module.num_batches_tracked) == 0
    assert state.restore() == []  # nothing changed since: nothing written (version counters kept)
