"""A paired call's shape propagation: the stacked form (one flow run on both branches' rows, as
the call itself runs) gives each branch's result the metadata the per-branch form gives, on
data-dependent row counts; torch 2.4 keeps the per-branch form."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxpasses.runtime import paired
from fxpasses.runtime.paired import PairedCall


class Density(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 3)

    def log_prob(self, x):
        return -(self.linear(x) ** 2).sum(-1), self.linear(x)


def _propagate(monkeypatch, stacked: bool):
    monkeypatch.setattr(paired, "_STACKED_PROPAGATION", stacked)
    torch.manual_seed(0)
    module = Density()
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        first = torch.empty(10, 2)[torch.empty(10, dtype=torch.bool)]  # an unbacked row count
        second = torch.empty(7, 2)[torch.empty(7, dtype=torch.bool)]
        out = PairedCall("pair", "log_prob").propagate(module, first, second)
        return [(tuple(str(s) for s in t.shape), t.dtype, t.requires_grad)
                for branch in out for t in branch], (first.shape[0], second.shape[0])


@pytest.mark.skipif(not paired._STACKED_PROPAGATION, reason="torch < 2.11 propagates per branch")
def test_the_stacked_propagation_gives_each_branch_its_rows_metadata(monkeypatch):
    stacked, (u, v) = _propagate(monkeypatch, True)
    per_branch, (u2, v2) = _propagate(monkeypatch, False)
    assert [m[1:] for m in stacked] == [m[1:] for m in per_branch]
    assert [m[0] for m in stacked] == [(str(u),), (str(u), "3"), (str(v),), (str(v), "3")]
    assert [m[0] for m in per_branch] == [(str(u2),), (str(u2), "3"), (str(v2),), (str(v2), "3")]


def test_the_form_follows_the_torch_version():
    major_minor = tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert paired._STACKED_PROPAGATION == (major_minor >= (2, 11))
