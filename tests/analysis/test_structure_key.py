"""Regions that are one another's code on other nodes (a loss's two branches) are traced once:
their keys are equal exactly when code, constants and input metadata are, and the reused
analysis is the one a trace of its own gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpasses import LeafPolicy, trace
from fxpasses.analysis import selection
from fxpasses.analysis.meta import annotate
from fxpasses.analysis.selection import analyze_space, find_spaces, subgraph
from fxpasses.analysis.structure_key import structure_key
from fxpasses.ir.runtime_op import RuntimeOp


class TwoBranches(nn.Module):
    """The same method on each branch's rows, each with its own weight buffer (read outside
    the regions: a region's trace sees drawn values of its inputs, never theirs) and scale (a
    constant of the region's code)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("first", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        self.register_buffer("second", torch.tensor([4.0, 5.0, 6.0], dtype=torch.float64))

    def branch(self, x, mask, weight, scale):
        rows = x[mask]
        return (rows * weight * scale).exp().sum(1).mean() + rows.sum()

    def forward(self, xa, ma, xb, mb):
        return self.branch(xa, ma, self.first, 2.0) + self.branch(xb, mb, self.second, 2.0)


class OtherScale(TwoBranches):
    def forward(self, xa, ma, xb, mb):
        return self.branch(xa, ma, self.first, 2.0) + self.branch(xb, mb, self.second, 3.0)


def _inputs(dtype_b=torch.float64):
    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(2, 5, 3, generator=g, dtype=torch.float64), torch.randn(4, 3, 3, generator=g)
    return xa, torch.rand(2, 5, generator=g) > 0.4, xb.to(dtype_b), torch.rand(4, 3, generator=g) > 0.3


def _analyses(module, args, traces, monkeypatch):
    gm = trace(module, args, policy=LeafPolicy())
    annotate(gm, list(args))
    calls = []
    real = selection.analyze_function_rows
    monkeypatch.setattr(selection, "analyze_function_rows",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    spaces = find_spaces(gm)
    assert len(spaces) == 2
    return [analyze_space(gm, s, traces) for s in spaces], len(calls)


def test_the_other_branch_reuses_the_first_branch_trace_and_its_verdict(monkeypatch):
    shared, traced = _analyses(TwoBranches(), _inputs(), {}, monkeypatch)
    assert traced == 1
    alone, traced_alone = _analyses(TwoBranches(), _inputs(), None, monkeypatch)
    assert traced_alone == 2
    assert "traced_for_space" not in shared[0].evidence
    assert shared[1].evidence["traced_for_space"] == shared[0].space.mask  # says whose trace it is
    for reused, own in zip(shared, alone):
        assert reused.code is None and reused.code == own.code
        assert {k: v for k, v in reused.evidence.items() if k != "traced_for_space"} == own.evidence
        assert [(r.kind, r.row_dim, r.per_row) for r in reused.reductions] == \
            [(r.kind, r.row_dim, r.per_row) for r in own.reductions]
        assert reused.region == own.region and reused.exits == own.exits


@pytest.mark.parametrize("change", ["constant", "dtype"])
def test_a_region_on_other_constants_or_other_input_metadata_is_traced_again(monkeypatch, change):
    module = OtherScale() if change == "constant" else TwoBranches()
    args = _inputs(torch.float32 if change == "dtype" else torch.float64)
    _, traced = _analyses(module, args, {}, monkeypatch)
    assert traced == 2


class _Opaque(RuntimeOp):
    def __call__(self, x):
        return x

    def propagate(self, x):
        return x


def test_no_key_for_an_op_that_does_not_say_what_it_computes():
    gm = trace(TwoBranches(), _inputs(), policy=LeafPolicy())
    annotate(gm, list(_inputs()))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and not isinstance(n.target, RuntimeOp)]
    module, _, _ = subgraph(gm, nodes[:3])
    assert structure_key(module, str) is not None
    with module.graph.inserting_before(next(iter(module.graph.find_nodes(op="output")))):
        module.graph.call_function(_Opaque("opaque"), (next(iter(module.graph.nodes)),))
    assert structure_key(module, str) is None
