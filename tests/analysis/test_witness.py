"""fxpasses.analysis.witness: float64 comparisons that pass rounding and never pass NaN."""

import math

import torch
from torch import nn

from fxpasses.analysis.witness import padding_witness, pairing_witness, witness_holds
from fxpasses.certificates import Witness


class RowWise(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 3)

    def log_prob(self, x):
        return self.lin(x).tanh().sum(-1)


class Mixing(RowWise):
    def log_prob(self, x):  # subtracts the mean over rows: pairing changes it
        return super().log_prob(x) - super().log_prob(x).mean()


class LogAbs(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))

    def log_prob(self, x):  # infinite derivative at zero: zero rows poison the scale's gradient
        return (x * self.scale).abs().log().sum(-1)


def test_a_row_wise_method_pairs_and_pads_within_rounding():
    module = RowWise()
    pairing = pairing_witness(module, "log_prob", (2,), [(5, 3), (0, 4), (2, 0)])
    padding = padding_witness(module, "log_prob", (2,))
    assert witness_holds(pairing) and witness_holds(padding)
    assert pairing.dtype == "torch.float64" and "1 parameter gradients" not in pairing.compared


def test_a_method_that_mixes_rows_fails_the_pairing_witness():
    witness = pairing_witness(Mixing(), "log_prob", (2,), [(5, 3)])
    assert not witness_holds(witness) and witness.max_abs_value_diff > 1e-6


def test_non_finite_padding_derivatives_fail():
    witness = padding_witness(LogAbs(), "log_prob", (2,))
    assert not witness_holds(witness) and math.isinf(witness.max_abs_grad_diff)


def test_nan_never_holds():
    nan = Witness(seed=0, dtype="torch.float64", shapes={}, max_abs_value_diff=float("nan"),
                  max_abs_grad_diff=0.0)
    assert not witness_holds(nan)
    assert witness_holds(Witness(0, "torch.float64", {}, 1e-12, 1e-12))
    assert not witness_holds(Witness(0, "torch.float64", {}, 1e-3, 0.0))


def test_the_module_itself_is_never_touched():
    module = RowWise()
    before = [p.detach().clone() for p in module.parameters()]
    pairing_witness(module, "log_prob", (2,), [(3, 2)])
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert all(p.grad is None for p in module.parameters())
