"""The selection analysis: spaces, levels and parents; the region walk of a function of several
inputs (per-input row dims, per-output row dims); the rules it relies on; regions planned after
SelectRows never form a cycle when contracted."""

from __future__ import annotations

import networkx as nx
import torch
import torch.nn.functional as F
from torch import nn

from fxpasses import LeafPolicy, optimize, trace
from fxpasses.analysis.capture import plan_regions
from fxpasses.analysis.graph import to_digraph
from fxpasses.analysis.meta import annotate
from fxpasses.analysis.rows import analyze_function_rows
from fxpasses.analysis.selection import analyze_space, find_spaces
from fxpasses.passes import SelectRows


class Nested(nn.Module):
    def forward(self, x, table, fg, keep):
        rows = x[fg]  # (F, K)
        index = torch.zeros(rows.shape[0], dtype=torch.long, device=x.device)
        looked_up = table[index, index]  # (F,): a row-free table read at the rows' own indices
        child = keep[fg]  # (F, K) bool: carries the anchors' rows
        loss = F.binary_cross_entropy_with_logits(rows, child.to(rows.dtype), reduction="mean")
        return loss + rows[child].sum() + looked_up.sum()


def _traced(module, *args):
    gm = trace(module, args, policy=LeafPolicy())
    annotate(gm, list(args))
    return gm


def _args():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    return x, torch.randn(4, 4, generator=g), torch.rand(2, 5, generator=g) > 0.4, \
        torch.rand(2, 5, 3, generator=g) > 0.5


def test_spaces_levels_and_parents():
    gm = _traced(Nested(), *_args())
    spaces = {s.mask: s for s in find_spaces(gm)}
    (child,) = [s for s in spaces.values() if s.parent is not None]
    parent = spaces[child.parent]
    assert (parent.level, child.level, parent.rank, child.rank) == (1, 2, 2, 2)
    assert len(parent.sites) == 2 and len(child.sites) == 1


def test_region_boundaries_and_masked_reductions():
    gm = _traced(Nested(), *_args())
    parent = next(s for s in find_spaces(gm) if s.level == 1)
    analysis = analyze_space(gm, parent)
    assert analysis.code is None, analysis.evidence
    kinds = sorted((r.kind, r.argument) for r in analysis.reductions)
    assert kinds == [("mean", True), ("sum", False)]  # the BCE's reduction= and looked_up.sum()
    (mean,) = [r for r in analysis.reductions if r.kind == "mean"]
    assert (mean.row_dim, mean.per_row) == (0, 3)  # a mean divides by count * 3
    assert [dim for _, dim in analysis.child_masks] == [0]


def test_function_rows_per_input_and_output():
    def fn(state, rows, weight):  # rows on dim 1, weight row-free
        moved = rows.transpose(0, 1) * weight
        return moved, moved.sum(1), weight.sum()

    def inputs(count):
        return [torch.randn(3, count), torch.randn(3)]

    found = analyze_function_rows(fn, inputs, [1, None], nn.Module())
    assert found.ok
    assert [v.rows for v in found.outputs] == [0, 0, None]
    mixed = analyze_function_rows(lambda s, r, w: (r.cumsum(1),), inputs, [1, None], nn.Module())
    assert not mixed.ok and mixed.code == "rows-mixed"
    assert mixed.evidence["op"].startswith("aten.cumsum")


def test_a_row_count_used_as_a_value_is_shape_dependent():
    found = analyze_function_rows(lambda s, r: (r * r.shape[0],), lambda n: [torch.randn(n, 2)],
                                  [0], nn.Module())
    assert not found.ok and found.code == "rows-shape-dependent"


def test_regions_after_select_rows_contract_without_cycles():
    from fxpasses.passes import CaptureLoss
    from fxpasses.runtime.emulated import EmulatedRecorder
    module = Nested()
    fast = optimize(module, passes=[SelectRows(min_bucket=4)])
    fast(*_args())
    gm = fast.graph_module
    plan = plan_regions(gm, ("cpu",), min_region_ops=1)
    g = to_digraph(gm.graph)
    owner = {n: i for i, region in enumerate(plan.regions) for n in region}
    quotient = nx.DiGraph()
    for a, b in g.edges():
        if owner.get(a, a) != owner.get(b, b):
            quotient.add_edge(owner.get(a, a), owner.get(b, b))
    assert nx.is_directed_acyclic_graph(quotient)
    captured = optimize(module, passes=[SelectRows(min_bucket=4), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1)])
    torch.testing.assert_close(captured(*_args()), module(*_args()), rtol=1e-12, atol=1e-12)
    assert all(c.decision != "failed" for c in captured.certificates)


def test_a_witness_difference_of_nan_against_a_number_is_infinite():
    import math

    from fxpasses.analysis.witness import _max_abs
    nan, inf = math.nan, math.inf
    assert _max_abs([torch.tensor([1.0, nan, inf])], [torch.tensor([1.0, nan, inf])]) == 0.0
    assert _max_abs([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, nan])]) == inf
    assert _max_abs([torch.tensor([inf])], [torch.tensor([-inf])]) == inf
