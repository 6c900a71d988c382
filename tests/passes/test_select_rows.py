"""SelectRows on a small two-level, two-branch selection loss: float64 equality with native over
drawn masks (empty, full, one branch empty, capacity reached and exceeded, NaN/inf in unselected
rows), with and without PairRLE and CaptureLoss, the host reads per call, and every code."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.passes import select_rewrite
from fxpasses.runtime.emulated import EmulatedRecorder

B, A, K = 2, 6, 3  # images, anchors, points per anchor


class Flow(nn.Module):
    """Scores (N, 2) rows, each from itself alone."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(2, 8), nn.Linear(8, 1)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x))).squeeze(-1) - 0.5 * (x * x).sum(-1)


class TwoLevelLoss(nn.Module):
    """Per branch: anchors by ``fg``, then their points by ``visible``; a BCE with
    reduction="sum", a mean over the anchors, sums over the points scored by a shared flow."""

    def __init__(self, alpha: float = 0.7):
        super().__init__()
        self.flow = Flow()
        self.alpha = alpha

    def branch(self, points, logits, weight, fg, visible):
        vis = visible[fg]  # (F, K): a mask carrying the anchors' rows
        kobj = F.binary_cross_entropy_with_logits(logits[fg], vis.to(logits.dtype), reduction="sum")
        spread = weight[fg].pow(2).mean()
        selected = points[fg][vis]  # (V, 2)
        nll = -self.flow.log_prob(selected * 0.5)
        return (kobj / fg.sum().clamp(min=1) + spread
                + nll.sum() / vis.sum().clamp(min=1) + selected.abs().sum() / 10)

    def forward(self, pa, la, wa, fa, va, pb, lb, wb, fb, vb):
        return self.alpha * self.branch(pa, la, wa, fa, va) + \
            (1 - self.alpha) * self.branch(pb, lb, wb, fb, vb)


def _mask(shape: tuple[int, ...], mode: str, generator: torch.Generator) -> torch.Tensor:
    n = math.prod(shape)
    count = {"empty": 0, "full": n, "reached": 4, "exceeded": 5}.get(mode)
    if count is None:
        count = int(torch.randint(1, n + 1, (1,), generator=generator))
    flat = torch.zeros(n, dtype=torch.bool)
    flat[torch.randperm(n, generator=generator)[:count]] = True
    return flat.view(shape)


def branch_inputs(fg_mode: str, seed: int, poison: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fg = _mask((B, A), fg_mode, g)
    visible = torch.rand(B, A, K, generator=g, dtype=torch.float64) < 0.6
    visible[..., 0] = True  # every anchor has a point: the point count follows the anchors'
    points = torch.randn(B, A, K, 2, generator=g, dtype=torch.float64)
    logits = torch.randn(B, A, K, generator=g, dtype=torch.float64)
    weight = torch.randn(B, A, generator=g, dtype=torch.float64)
    if poison:  # what no selection reads must never matter, NaN and inf included
        bad = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
        hidden = ~(fg[..., None] & visible)
        points[hidden] = bad[torch.arange(int(hidden.sum()) * 2) % 3].view(-1, 2)
        logits[~fg] = math.nan
        weight[~fg] = math.inf
    return [points, logits, weight, fg, visible]


def inputs(mode_a: str, mode_b: str, seed: int, poison: bool = True) -> list[torch.Tensor]:
    return branch_inputs(mode_a, seed, poison) + branch_inputs(mode_b, seed + 1, poison)


def _values_and_grads(fn, args: list[torch.Tensor], params: list[torch.Tensor]):
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    wrt = [x for x in leaves if x.requires_grad] + params
    return out.detach(), torch.autograd.grad(out, wrt, allow_unused=True)


def assert_same(loss: nn.Module, fast, args: list[torch.Tensor]) -> None:
    """Values and every gradient (inputs, parameters) equal in float64, finite where native is."""
    params = list(loss.parameters())
    expected, expected_grads = _values_and_grads(loss, args, params)
    got, got_grads = _values_and_grads(fast, args, params)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, equal_nan=True)
    for want, have in zip(expected_grads, got_grads):
        want = torch.zeros_like(have) if want is None else want
        assert have is not None
        assert torch.equal(want.isfinite(), have.isfinite())
        torch.testing.assert_close(have, want, rtol=1e-10, atol=1e-12, equal_nan=True)


PIPELINES = {
    "select": lambda: [SelectRows(min_bucket=4)],
    "pair-then-select": lambda: [PairRLE(), SelectRows(min_bucket=4)],
    "select-then-pair": lambda: [SelectRows(min_bucket=4), PairRLE()],
    "all": lambda: [PairRLE(), SelectRows(min_bucket=4),
                    CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1,
                                max_recordings=64, count_copies=False, record_after=1)],
}
_OPTIMIZED: dict[str, tuple] = {}


def optimized(name: str):
    """One optimized loss per pipeline, shared by the drawn examples (shapes do not change)."""
    if name not in _OPTIMIZED:
        torch.manual_seed(0)
        loss = TwoLevelLoss().double()
        fast = optimize(loss, passes=PIPELINES[name]())
        fast(*inputs("random", "random", 0))
        _OPTIMIZED[name] = (loss, fast)
    return _OPTIMIZED[name]


MODES = st.sampled_from(["empty", "full", "random", "reached", "exceeded"])


@pytest.mark.parametrize("name", list(PIPELINES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode_a=MODES, mode_b=MODES, seed=st.integers(0, 10_000))
def test_equal_to_native_in_float64(name, mode_a, mode_b, seed):
    loss, fast = optimized(name)
    before = fast.stats
    assert_same(loss, fast, inputs(mode_a, mode_b, seed))
    after = fast.stats
    if "empty" in (mode_a, mode_b):  # no real row to pad with: that call ran natively, counted
        assert after.native["selection-empty"] == before.native["selection-empty"] + 1
    else:
        assert after.optimized == before.optimized + 1


def test_every_selection_rewritten_with_one_host_read_per_call():
    _, fast = optimized("all")
    certificates = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert len(certificates) == 4 and all(c.applied for c in certificates)
    assert {c.effect["level"] for c in certificates} == {1, 2}
    assert len({c.effect["host_read"]["reads"] for c in certificates}) == 1
    assert all(len(c.effect["host_read"]["reads"]) == 1 for c in certificates)
    assert all(c.witness is not None for c in certificates)
    cases = certificates[0].witness.shapes["cases"]
    assert set(cases) == {"full", "asymmetric", "capacity-reached", "capacity-exceeded",
                          "capacity-above", "capacity-short", "one-empty"}
    assert cases["one-empty"]["outcome"] == "abandoned (selection-empty)"
    assert cases["capacity-short"]["outcome"] == "abandoned (selection-capacity)"
    assert cases["capacity-above"]["outcome"] == "compared"

    def reads():
        return sum(v.get("read", 0) for k, v in fast.stats.sites.items() if "check_counts" in k)

    calls, before = fast.stats.optimized, reads()
    fast(*inputs("random", "random", 1))
    assert reads() - before in (1, 2)  # once per run of the call (twice: a capacity grew)
    assert fast.stats.optimized == calls + 1


def test_a_count_above_its_capacity_runs_the_call_again_with_the_capacity_grown():
    loss = TwoLevelLoss().double()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4)])
    assert_same(loss, fast, inputs("reached", "reached", 0))  # capacities 4
    grown = fast.stats.abandoned
    assert_same(loss, fast, inputs("full", "reached", 1))  # 12 anchors: the capacity grows
    after = fast.stats
    retried = {k: v - grown.get(k, 0) for k, v in after.abandoned.items()}
    assert any(k.startswith("selection-capacity") and v >= 1 for k, v in retried.items())
    assert not after.native  # ran again at once, optimized: never natively
    assert_same(loss, fast, inputs("full", "full", 2))


class FiveLevels(nn.Module):
    """Five nested selections: each level selects from the rows of the one before."""

    def forward(self, x):
        for k in range(5):
            x = x[x[:, k] > -0.5]
        return (x ** 2).mean()


def test_a_call_that_outgrows_five_nested_levels_runs_again_until_all_fit():
    # a level above one that was cut off counts rows of a cut-off set (zero too): only the
    # lowest short level grows each time (to twice its count: a level above may then fit), so
    # this call needs at most five runs again, none of them an empty selection
    loss = FiveLevels().double()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4)])
    rows = lambda n, seed: [torch.randn(n, 6, dtype=torch.float64,  # noqa: E731
                                        generator=torch.Generator().manual_seed(seed))]
    def grown():
        return sum(n for k, n in fast.stats.abandoned.items() if k.startswith("selection-capacity"))

    assert_same(loss, fast, rows(64, 0))
    assert fast.stats.optimized == 1
    before = grown()
    assert_same(loss, fast, rows(4096, 1))  # every level's count above its capacity
    stats = fast.stats
    assert stats.optimized == 2 and not stats.native, stats.render()
    assert 1 <= grown() - before <= 5
    after = grown()
    assert_same(loss, fast, rows(4096, 2))  # room for it now: no run again
    assert grown() == after and fast.stats.optimized == 3
    assert not [k for k in stats.abandoned if k.startswith("selection-empty")]


def test_empty_selections_run_natively_without_new_traces():
    loss, fast = optimized("select")
    traced = len(fast.specializations)
    for seed in range(3):  # a new trace would abandon them again: none is made
        assert_same(loss, fast, inputs("empty", "random", seed))
    assert len(fast.specializations) == traced


def test_everything_is_captured_in_two_regions():
    _, fast = optimized("all")
    capture = [c for c in fast.certificates if c.pass_name == "CaptureLoss"]
    # what the counts need, then the rest while their copy to the host travels
    assert sum(c.applied and "region" in c.effect for c in capture) == 2
    eager = [ch for c in capture for ch in c.checks if not ch.ok]
    assert not [ch for ch in eager if ch.code != "region-too-small"], eager
    graph = fast.graph_module.graph
    assert not any(n.target is torch.nonzero for n in graph.nodes)


def test_numeric_class_and_capacity_in_the_certificate():
    _, fast = optimized("select")
    (first, *_) = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert first.effect["numeric_class"].startswith("reduction order changes")
    assert "power of two" in first.effect["capacity"]
    assert first.guards[0].code == "selection-empty"


# -- refusals ------------------------------------------------------------------------------

class Mixing(nn.Module):
    """The anchors' rows are mixed (a cumulative sum over them) before their reduction."""

    def forward(self, points, fg, visible):
        rows = points[fg]
        mixed = rows.cumsum(0).sum()
        return mixed + rows[visible[fg]].sum()


def _select_certificates(module, *args):
    fast = optimize(module, passes=[SelectRows(min_bucket=4)])
    fast(*args)
    return fast, {c.site.nodes[0]: c for c in fast.certificates if c.pass_name == "SelectRows"}


def test_rows_mixed_names_the_op_and_line_and_the_child_is_refused():
    points, _, _, fg, visible = branch_inputs("random", 3, poison=False)
    module = Mixing()
    fast, certs = _select_certificates(module, points, fg, visible)
    parent, child = sorted(certs.values(), key=lambda c: c.effect["level"])
    assert parent.codes == ("rows-mixed",)
    (walk,) = [ch for ch in parent.checks if ch.id == "rows-independent"]
    assert walk.evidence["op"].startswith("aten.cumsum") and "test_select_rows.py" in walk.evidence["source"]
    assert child.codes == ("select-parent-refused",)
    torch.testing.assert_close(fast(points, fg, visible), module(points, fg, visible))


class Transposed(nn.Module):
    """Rows read through a selection that does not index them (a boundary the rewrite refuses)."""

    def forward(self, points, fg, keep):
        rows = points[fg].sum(-1)  # (F, K)
        return rows.t()[keep].sum()  # keep: (K,) indexes the points, not the rows


def test_rows_leaving_through_an_unknown_boundary_are_refused():
    points, _, _, fg, _ = branch_inputs("random", 4, poison=False)
    keep = torch.tensor([True, False, True])
    module = Transposed()
    fast, certs = _select_certificates(module, points, fg, keep)
    assert certs["fg"].codes == ("select-boundary",)
    (check,) = [ch for ch in certs["fg"].checks if ch.code == "select-boundary"]
    assert "does not index the dim of the rows" in check.evidence["reason"]
    torch.testing.assert_close(fast(points, fg, keep), module(points, fg, keep))


class FromUnique(nn.Module):
    """A mask whose size comes from unique, not from a selection."""

    def forward(self, points, fg):
        ids = torch.unique(fg.flatten().long() * torch.arange(fg.numel()))  # 0 and fg's positions
        picked = points.flatten(0, 1)[ids]  # (U, K, 2)
        keep = picked[:, 0, 0] > 0
        return picked[keep].sum()


def test_a_mask_sized_by_other_data_is_a_root_and_rewritten():
    points, _, _, fg, _ = branch_inputs("random", 5, poison=False)
    module = FromUnique()
    fast, certs = _select_certificates(module, points, fg)
    assert certs["gt"].codes == () and certs["gt"].effect["level"] == 1  # U is the same for every row
    for seed in range(3):
        points, _, _, fg, _ = branch_inputs("random", 5 + seed, poison=False)
        assert_same(module, fast, [points, fg])


class PairsOfTwoSelections(nn.Module):
    """A mask over every pair of two selections' rows: its shape holds both counts."""

    def forward(self, x, m1, m2):
        a, b = x[m1][:, 0], x[m2][:, 1]
        pairs = a[:, None] * b[None, :]  # (u1, u2)
        return pairs[pairs > 1].sum()


def test_a_mask_over_two_selections_rows_is_refused():
    torch.manual_seed(0)
    x = torch.rand(12, 2, dtype=torch.float64) * 2
    m1, m2 = torch.rand(12) > 0.4, torch.rand(12) > 0.6
    module = PairsOfTwoSelections()
    fast, certs = _select_certificates(module, x, m1, m2)
    (pair,) = [c for c in certs.values() if c.effect["level"] == 0]
    assert "select-mask-shape" in pair.codes
    torch.testing.assert_close(fast(x, m1, m2), module(x, m1, m2))


def test_the_witness_catches_an_unmasked_reduction(monkeypatch):
    monkeypatch.setattr(select_rewrite, "_mask_reduction", lambda *args: None)  # padding summed
    torch.manual_seed(0)
    loss = TwoLevelLoss().double()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4)])
    fast(*inputs("random", "random", 0))
    certificates = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert {c.codes for c in certificates if c.effect["level"] == 1} == {("select-witness-mismatch",)}
    # (the second branch's also follow the first's flow call, user code: select-effect-before-read)
    assert all("select-parent-refused" in c.codes for c in certificates if c.effect["level"] == 2)
    assert not any(n.target is torch.nonzero_static for n in fast.graph_module.graph.nodes)


class ReturnsRows(nn.Module):
    """Selected rows handed to the caller: sliced back to the real rows, bit for bit."""

    def forward(self, points, fg):
        return (points[fg] * 2).tanh()


def test_rows_returned_to_the_caller_are_the_real_rows_exactly():
    points, _, _, fg, _ = branch_inputs("random", 6, poison=True)
    module = ReturnsRows()
    fast, certs = _select_certificates(module, points, fg)
    (cert,) = certs.values()
    assert cert.applied and cert.effect["numeric_class"] == "exact"
    for mode in ("full", "reached", "exceeded", "random"):
        points, _, _, fg, _ = branch_inputs(mode, 7, poison=True)
        got, want = fast(points, fg), module(points, fg)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


class SingularRows(nn.Module):
    """A square root of the selected rows and a scale shared by every row (a parameter): at a row
    of zeros its gradient is infinite."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, points, fg):
        rows = points[fg]
        return (rows * self.scale).sqrt().sum() + rows.sum()


def test_an_infinite_gradient_stays_where_native_has_it_and_finite_ones_are_exact():
    """Padding rows copy the last real row; with that row's gradient infinite, their masked-out
    share is 0 * inf = NaN, added to it and to the shared parameter's: non-finite where native's
    is (its kind may differ: NaN for inf), every finite gradient bit for bit."""
    torch.manual_seed(0)
    module = SingularRows()
    g = torch.Generator().manual_seed(3)
    fg = torch.zeros(B, A, dtype=torch.bool)
    fg[0, 1] = fg[1, 2] = fg[1, 4] = True  # 3 rows in a capacity of 4: one padding row
    points = torch.rand(B, A, 2, generator=g, dtype=torch.float64) + 0.5
    fast, certs = _select_certificates(module, points, fg)
    (cert,) = certs.values()
    assert cert.applied, cert.codes
    points[1, 4] = 0.0  # the last real row: the one the padding copies
    grads = []
    for fn in (fast, module):
        x = points.clone().requires_grad_(True)
        module.scale.grad = None
        value = fn(x, fg)
        value.backward()
        grads.append((float(value.detach()), x.grad, module.scale.grad.clone()))
    (got, got_x, got_scale), (want, want_x, want_scale) = grads
    assert got == want
    assert not want_x[1, 4].isfinite().any() and not want_scale.isfinite()  # native: inf
    for a, b in ((got_x, want_x), (got_scale, want_scale)):
        assert torch.equal(a.isfinite(), b.isfinite())
        assert torch.equal(a[a.isfinite()], b[b.isfinite()])


@pytest.mark.cuda
def test_on_cuda_the_selections_run_inside_cuda_graphs_and_match_native():
    torch.manual_seed(0)
    loss = TwoLevelLoss().double().cuda()
    fast = optimize(loss, passes=[PairRLE(), SelectRows(min_bucket=4), CaptureLoss(max_recordings=64)])
    for seed, modes in enumerate([("random", "random"), ("full", "reached"), ("exceeded", "random"),
                                  ("random", "empty"), ("random", "random")]):
        assert_same(loss, fast, [a.cuda() for a in inputs(*modes, seed)])
    counters = [v for k, v in fast.stats.sites.items() if "capture_region" in k]
    assert counters and all("capture-failed" not in v and v.get("replayed", 0) for v in counters)
    assert fast.stats.native == {"selection-empty": 1}


class CastsToFloat32(nn.Module):
    """A float32 value cast with a dtype written in the graph, then summed over selected rows."""

    def forward(self, x, mask):
        return (x[mask].to(torch.float32) * 1.1).exp().sum()


def test_the_witness_computes_in_float64_through_a_dtype_written_in_the_graph():
    # in float32 the masked sum over padded rows and the native sum round differently; the
    # witness must compare in float64 (it once kept the float32 cast: a 1e-7 "mismatch")
    g = torch.Generator().manual_seed(0)
    x, mask = torch.rand(4096, 3, generator=g), torch.rand(4096, generator=g) > 0.3
    fast = optimize(CastsToFloat32(), passes=[SelectRows()])
    torch.testing.assert_close(fast(x, mask), CastsToFloat32()(x, mask))
    (cert,) = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert cert.applied, cert.codes
    assert cert.witness.max_abs_value_diff <= 1e-12


def test_a_recording_made_for_a_capacity_since_grown_is_dropped(monkeypatch):
    """Capacities only grow: a region's recording made for a smaller one cannot be replayed
    again, and is evicted when the region records for the grown one, before capturing it (its
    memory freed then, for that capture to take in the region's pool, not after max_recordings
    newer recordings)."""
    from fxpasses.runtime.capture import CapturedRegion

    from fxpasses.runtime.capture import _size

    outgrown_at_capture = []  # (region, recordings it held for a capacity below the call's)
    record = CapturedRegion._record

    def spy(self, flat, starts, *args, **kwargs):
        places = [(k, d) for i, dims in self.growing.items() for k in range(starts[i], starts[i + 1])
                  for d in (dims or (None,))]
        now = [_size(flat[k], d) for k, d in places]
        outgrown_at_capture.append((self, sum(
            any(type(a) is int and type(b) is int and a < b
                for a, b in zip([_size(r.inputs[k], d) for k, d in places], now))
            for r in self.recordings.values())))
        return record(self, flat, starts, *args, **kwargs)

    monkeypatch.setattr(CapturedRegion, "_record", spy)
    loss = FiveLevels().double()
    fast = optimize(loss, passes=[SelectRows(min_bucket=4), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1, record_after=1)])
    rows = lambda n, seed: [torch.randn(n, 6, dtype=torch.float64,  # noqa: E731
                                        generator=torch.Generator().manual_seed(seed))]
    for n, seed in ((64, 0), (64, 1), (4096, 2), (4096, 3), (4096, 4)):
        assert_same(loss, fast, rows(n, seed))
    regions = [n.target for n in fast.graph_module.graph.nodes if isinstance(n.target, CapturedRegion)]
    growing = [r for r in regions if r.growing]
    assert growing and all(r.counters["evicted"] >= 1 for r in growing), [dict(r.counters) for r in growing]
    # what is held: the current capacities' recording alone (one shape of rows per call here)
    assert all(len(r.recordings) == 1 for r in growing), [len(r.recordings) for r in growing]
    assert len(outgrown_at_capture) > len(growing)  # captures after a capacity grew
    assert not any(n for _, n in outgrown_at_capture), [(r.op_id, n) for r, n in outgrown_at_capture]
    assert not fast.stats.native
