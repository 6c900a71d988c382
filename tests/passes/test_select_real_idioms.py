"""SelectRows on the idioms of the real Ultralytics pose loss, written small and dependency-free:
an assigner that writes an attribute before the masks, ``fg.nonzero(as_tuple=True)`` indexing,
``kpt_mask.any()`` and ``error.numel()`` branches, a weight table repeated to
``kpt_mask.shape[0]``, the NaN/inf filter ``~(isnan(e) | isinf(e)).any(-1)``, a mean by the
rows' own size, and two branches scoring their rows with one flow. Every level is rewritten; the
values and every gradient (inputs, parameters) equal native in float64 over drawn batches (empty,
full, capacity reached and exceeded, NaN/inf where nothing selects). Then what must stay refused:
a decision on a size of the rows, an exact size (``len()``), an attribute keeping rows.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.passes import PairRLE, SelectRows

B, A, G, K = 2, 6, 3, 4  # images, anchors, targets per image, keypoints


class Flow(nn.Module):
    """Scores (N, 2) rows, each from itself alone."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(2, 8), nn.Linear(8, 1)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x))).squeeze(-1) - 0.5 * (x * x).sum(-1)


class Assigner:
    """A plain object that keeps what it was given, as Ultralytics' assigner keeps its strides."""

    def __call__(self, scores: torch.Tensor, strides: torch.Tensor) -> torch.Tensor:
        self.anc_strides = strides
        return scores.detach().sigmoid() > 0.5


class Branch:
    """One branch, callable: the per-branch loss objects of the real criterion are too."""

    def __init__(self, flow: Flow, size_of_rows=lambda rows: rows.shape[0]):
        self.flow, self.assigner, self.size_of_rows = flow, Assigner(), size_of_rows
        self.target_weights = torch.linspace(0.5, 1.5, K, dtype=torch.float64)

    def __call__(self, pred, scores, table, gt_idx, strides):
        fg = self.assigner(scores, strides)  # (B, A)
        if not fg.any():
            return pred.sum() * 0
        gt = table[fg.nonzero(as_tuple=True)[0], gt_idx[fg]]  # (F, K, 3)
        weight = scores[fg.nonzero(as_tuple=True)].sigmoid()  # (F,)
        rows = pred[fg]  # (F, K, 4): x, y and two sigma logits
        kpt_mask = gt[..., 2] != 0  # (F, K)
        spread = ((rows[..., :2] - gt[..., :2].nan_to_num()).pow(2).sum(-1) * kpt_mask).mean()
        if not kpt_mask.any():
            return spread + weight.sum()
        target_weights = self.target_weights.unsqueeze(0).repeat(kpt_mask.shape[0], 1)[kpt_mask]
        visible, target = rows[kpt_mask], gt[kpt_mask]  # (V, 4), (V, 3)
        sigma = visible[:, 2:].sigmoid()
        error = (visible[:, :2] - target[:, :2]) / (sigma + 1e-9)
        if not error.numel():
            return spread
        valid = ~(torch.isnan(error) | torch.isinf(error)).any(dim=-1)
        if not valid.any():
            return spread
        error, sigma, target_weights = error[valid].clamp(-100, 100), sigma[valid], target_weights[valid]
        nll = (sigma.log() - self.flow.log_prob(error).unsqueeze(1)) * target_weights[:, None]
        return spread + weight.sum() + (nll / self.size_of_rows(nll)).sum()


class RealIdioms(nn.Module):
    """Two branches over one flow, weighted as the real end-to-end loss weighs them."""

    def __init__(self, size_of_rows=lambda rows: rows.shape[0]):
        super().__init__()
        self.flow = Flow()
        self.one2many, self.one2one = Branch(self.flow, size_of_rows), Branch(self.flow, size_of_rows)

    def forward(self, pa, sa, pb, sb, table, gt_idx, strides):
        return 0.8 * self.one2many(pa, sa, table, gt_idx, strides) + \
            0.2 * self.one2one(pb, sb, table, gt_idx, strides)


def inputs(seed: int, mode: str = "random") -> list[torch.Tensor]:
    """Predictions of both branches (scores decide the foreground: ``mode`` sets how many),
    targets with unlabelled keypoints holding NaN/+inf/-inf, per-anchor target indices."""
    g = torch.Generator().manual_seed(seed)
    share = {"empty": 0.0, "few": 0.05, "full": 1.0, "random": float(torch.rand((), generator=g))}[mode]

    def scores() -> torch.Tensor:
        chosen = torch.rand(B, A, generator=g) < share
        return torch.where(chosen, 2.0, -2.0).double() + 0.1 * torch.randn(B, A, generator=g).double()

    table = torch.randn(B, G, K, 3, generator=g, dtype=torch.float64)
    labelled = torch.rand(B, G, K, generator=g) > 0.35
    table[..., 2] = labelled.double()
    bad = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    table[..., 0][~labelled] = bad[torch.arange(int((~labelled).sum())) % 3]
    pa, pb = (torch.randn(B, A, K, 4, generator=g, dtype=torch.float64) for _ in range(2))
    gt_idx = torch.randint(0, G, (B, A), generator=g)
    strides = torch.rand(A, generator=g, dtype=torch.float64) + 1
    return [pa, scores(), pb, scores(), table, gt_idx, strides]


def _values_and_grads(fn, args: list[torch.Tensor], params: list[torch.Tensor]):
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    wrt = [x for x in leaves if x.requires_grad] + params
    return out.detach(), torch.autograd.grad(out, wrt, allow_unused=True)


def assert_same(loss: nn.Module, fast, args: list[torch.Tensor]) -> None:
    params = list(loss.parameters())
    expected, expected_grads = _values_and_grads(loss, args, params)
    got, got_grads = _values_and_grads(fast, args, params)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, equal_nan=True)
    for want, have in zip(expected_grads, got_grads):
        if want is None or have is None:  # not reached (a branch's zero path): zero, or None
            assert (want if have is None else have) is None or \
                not (want if have is None else have).any()
            continue
        torch.testing.assert_close(have, want, rtol=1e-10, atol=1e-12, equal_nan=True)


def _optimized(loss: nn.Module, passes, seed: int = 0, mode: str = "random"):
    fast = optimize(loss, passes=passes)
    fast(*inputs(seed, mode))
    return fast


def _check(cert, name: str) -> dict:
    (check,) = [c for c in cert.checks if c.id == name]
    return check.evidence


def _levels(fast) -> dict[int, list]:
    found: dict[int, list] = {}
    for cert in fast.certificates:
        if cert.pass_name == "SelectRows":
            found.setdefault(cert.effect["level"], []).append(cert)
    return found


_SHARED: dict[str, tuple] = {}


def shared(name: str):
    if name not in _SHARED:
        torch.manual_seed(0)
        loss = RealIdioms().double()
        passes = [SelectRows(min_bucket=4)] if name == "select" else \
            [PairRLE(), SelectRows(min_bucket=4)]
        _SHARED[name] = loss, _optimized(loss, passes)
    return _SHARED[name]


@pytest.mark.parametrize("name", ["select", "pair-then-select"])
def test_every_level_of_both_branches_is_rewritten(name):
    _, fast = shared(name)
    levels = _levels(fast)
    assert sorted(levels) == [1, 2, 3]
    assert all(c.applied for certs in levels.values() for c in certs), \
        [(c.effect["level"], c.codes) for certs in levels.values() for c in certs]
    assert [len(levels[k]) for k in (1, 2, 3)] == [2, 2, 2]
    first = levels[1][0]
    assert len(first.site.nodes) == 1 + 4  # the mask, two fg.nonzero(as_tuple=True), two x[fg]
    assert any(r.startswith("any at") for r in first.effect["masked_reductions"])  # kpt_mask.any()
    (count,) = levels[3][0].effect["counts_as_values"]  # nll / nll.shape[0]: the true count
    assert count.startswith("1 x the count")
    if name == "pair-then-select":
        (pair,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
        assert pair.applied


def _indexed_by_tensors(gm, source: str) -> list:
    """``x[(i, j)]`` nodes (``aten.index`` with tensor indices) traced from the line ``source``."""
    return [n for n in gm.graph.nodes if n.target is operator.getitem and isinstance(n.args[1], tuple)
            and any(isinstance(a, torch.fx.Node) for a in n.args[1])
            and source in n.meta.get("stack_trace", "")]


def test_a_gather_by_nonzero_as_tuple_is_the_index_select_of_the_mask():
    """``scores[fg.nonzero(as_tuple=True)]`` gathers as ``scores[fg]`` does, by ``index_select``
    of the flattened rows, whose backward adds the padding rows' zero gradients in parallel, not
    by ``aten.index``, whose backward passes over every padding row's repeated position one after
    another (0.3 ms a gather on a GPU). ``table[fg.nonzero(as_tuple=True)[0], gt_idx[fg]]``, an
    index of other tensors, stays as written."""
    loss, fast = shared("select")
    gm = fast.specializations[0].graph_module
    traced = _optimized(loss, []).specializations[0].graph_module  # no pass: as the loss wrote it
    assert _indexed_by_tensors(traced, "scores[fg.nonzero(as_tuple=True)]")
    assert not _indexed_by_tensors(gm, "scores[fg.nonzero(as_tuple=True)]")
    assert [n for n in gm.graph.nodes if n.target is torch.index_select
            and "scores[fg.nonzero(as_tuple=True)]" in n.meta.get("stack_trace", "")]
    assert _indexed_by_tensors(gm, "table[fg.nonzero(as_tuple=True)[0], gt_idx[fg]]")
    assert_same(loss, fast, inputs(3, "random"))


@pytest.mark.parametrize("name", ["select", "pair-then-select"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["empty", "full", "random", "random"]), seed=st.integers(0, 10_000))
def test_equal_to_native_in_float64(name, mode, seed):
    loss, fast = shared(name)
    assert_same(loss, fast, inputs(seed, mode))
    assert not fast.stats.exceptions


def test_the_attribute_written_before_the_masks_holds_this_calls_value_after_a_grown_capacity():
    torch.manual_seed(0)
    loss = RealIdioms().double()
    fast = _optimized(loss, [SelectRows(min_bucket=4)], mode="few")  # capacities for few anchors
    before = sum(fast.stats.abandoned.values())
    for seed in (1, 2, 3):
        args = inputs(seed, "full")  # every anchor: the capacity grows, the call runs again
        fast(*args)
        for branch in (loss.one2many, loss.one2one):
            assert torch.equal(branch.assigner.anc_strides, args[-1])
        assert_same(loss, fast, args)
    assert sum(fast.stats.abandoned.values()) > before  # capacities grew: calls ran again
    assert fast.stats.optimized >= 2 and not fast.stats.exceptions


def test_an_exact_size_refuses_its_level_and_the_refused_level_selects_real_rows_only():
    # len() is traced as an exact size (a guard): the last level stays native, selecting from
    # rows the level above padded, by masks and-ed with those rows' validity. (Paired first, as
    # in the real pipeline: else the first branch's flow call, user code, precedes the second's
    # masks.)
    torch.manual_seed(0)
    loss = RealIdioms(size_of_rows=len).double()
    fast = _optimized(loss, [PairRLE(), SelectRows(min_bucket=4)])
    levels = _levels(fast)
    assert all(c.applied for k in (1, 2) for c in levels[k])
    assert [c.codes for c in levels[3]] == [("rows-shape-dependent",)] * 2
    assert _check(levels[3][0], "rows-independent")["guard"].startswith("expect_size")
    before = fast.stats.optimized
    assert_same(loss, fast, inputs(0))  # the traced batch: len() is the traced size
    assert fast.stats.optimized == before + 1 and not fast.stats.exceptions


class DecidesOnASize(nn.Module):
    """A branch on how many rows were selected: padded, the size is the capacity."""

    def forward(self, x, mask):
        rows = x[mask]
        if rows.shape[0] > 3:
            return rows.sin().sum()
        return rows.cos().sum()


def test_a_decision_on_a_size_of_the_rows_is_refused():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=g, dtype=torch.float64)
    mask = torch.arange(12) % 2 == 0  # 6 rows: the branch taken is "> 3"
    loss = DecidesOnASize()
    fast = optimize(loss, passes=[SelectRows(min_bucket=8)])
    fast(x, mask)
    (cert,) = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert cert.codes == ("rows-shape-dependent",)
    assert _check(cert, "rows-independent")["source"] == f"{__file__}:{_line('if rows.shape[0] > 3')}"
    few = torch.arange(12) < 2  # 2 rows: natively the other branch
    torch.testing.assert_close(fast(x, few), loss(x, few))


class KeepsRows(nn.Module):
    """Selected rows kept in an attribute: padded, the attribute would hold padding rows."""

    def forward(self, x, mask):
        rows = x[mask]
        self.last = rows.detach()
        return rows.sum()


def test_an_attribute_that_keeps_rows_is_refused():
    x = torch.randn(12, 2, dtype=torch.float64)
    mask = torch.arange(12) % 3 == 0
    loss = KeepsRows()
    fast = optimize(loss, passes=[SelectRows(min_bucket=8)])
    fast(x, mask)
    (cert,) = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert cert.codes == ("select-boundary",)
    assert "attribute" in _check(cert, "rows-leave-through-boundaries")["reason"]
    assert torch.equal(loss.last, x[mask])


class Positions(nn.Module):
    """The positions of a mask in each form: nonzero() rows, torch.nonzero(as_tuple=True) parts,
    and a mask over rows picked by flat positions (a second level)."""

    def forward(self, x, table, mask):
        stacked = mask.nonzero()  # (F, 2)
        i, j = torch.nonzero(mask, as_tuple=True)
        picked = x.flatten(0, 1)[torch.nonzero(mask.flatten()).squeeze(-1)]  # (F, 3)
        keep = picked[:, 0] > 0
        return (table[stacked[:, 0], stacked[:, 1]] * x[i, j, 1]).sum() + picked[keep].sum() \
            + (x[mask][:, 2] * j).sum()


def test_every_form_of_positions_is_rewritten_and_equal_to_native():
    g = torch.Generator().manual_seed(1)
    table = torch.randn(B, A, generator=g, dtype=torch.float64)
    loss = Positions()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4)])
    for seed, share in enumerate((0.5, 1.0, 0.2, 0.9)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, A, 3, generator=g, dtype=torch.float64)
        x[..., 0][torch.rand(B, A, generator=g) < 0.3] = math.nan  # unselected NaN never matter
        mask = torch.rand(B, A, generator=g) < share
        x = x.where(mask[..., None], torch.full_like(x, math.inf))
        assert_same(loss, fast, [x, table, mask])
    certs = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert certs and all(c.applied for c in certs), [c.codes for c in certs]
    assert sorted(c.effect["level"] for c in certs) == [1, 1, 2]
    assert fast.stats.optimized >= 3 and not fast.stats.exceptions  # (an empty `keep`: native)


class GathersByCoordinates(nn.Module):
    """The assigner's mask over (image, target, anchor) read by its coordinates, as the real loss
    reads its predictions: ``pred[b, a]`` (dims 0 and 2), ``table[b, g]`` (dims 0 and 1); ``seen``
    is also summed whole, outside the selection level."""

    def forward(self, pred, table, seen, scores):
        fg = scores > 0.5  # (B, G, A)
        b, g, a = fg.nonzero(as_tuple=True)
        rows = pred[b, a] * seen[b, a, None]  # (F, 2)
        return ((rows - table[b, g]) ** 2).sum() + seen.sum()


def test_the_witness_draws_what_is_gathered_by_coordinates_at_the_masks_positions():
    """The float64 witness shrinks the mask (B, G, A); a tensor read only at its coordinates is
    drawn at the shrunk mask's dims and poisoned where the mask selects nothing there, so a
    rewrite reading an unselected position would show. What counts is the level's reads: the
    whole sum of ``seen`` is computed outside it and reaches it as an input of its own."""
    g = torch.Generator().manual_seed(0)
    big = (4, 3, 200)  # more positions than the witness keeps (256): it shrinks them
    loss = GathersByCoordinates()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4)])
    for _ in range(3):
        pred = torch.randn(big[0], big[2], 2, generator=g, dtype=torch.float64)
        table = torch.randn(big[0], big[1], 2, generator=g, dtype=torch.float64)
        seen = torch.rand(big[0], big[2], generator=g, dtype=torch.float64)
        scores = torch.rand(big, generator=g, dtype=torch.float64)
        assert_same(loss, fast, [pred, table, seen, scores])
    (cert,) = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert cert.applied, cert.codes
    shapes = cert.witness.shapes
    (mask,) = shapes["masks"]
    assert math.prod(shapes["masks"][mask]) <= 256 < math.prod(shapes["traced_masks"][mask])
    drawn = shapes["drawn_at_masks"]
    assert {name: d["dims"] for name, d in drawn.items()} == {"pred": (0, 2), "seen": (0, 2),
                                                                "table": (0, 1)}


def test_the_shrunk_gather_witness_still_catches_a_sum_over_padding(monkeypatch):
    from fxpasses.passes import select_rewrite
    monkeypatch.setattr(select_rewrite, "_mask_reduction", lambda *args: None)  # padding summed
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, 200, 2, generator=g, dtype=torch.float64),
            torch.randn(4, 3, 2, generator=g, dtype=torch.float64),
            torch.rand(4, 200, generator=g, dtype=torch.float64),
            torch.rand(4, 3, 200, generator=g, dtype=torch.float64)]
    loss = GathersByCoordinates()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4)])
    assert_same(loss, fast, args)  # refused: the native level runs
    (cert,) = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert cert.codes == ("select-witness-mismatch",)


def _line(text: str) -> int:
    import inspect
    lines, start = inspect.getsourcelines(DecidesOnASize)
    return start + next(k for k, line in enumerate(lines) if text in line)
