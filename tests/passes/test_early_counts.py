"""Two branches, each selecting rows by a mask its own assigner makes (without gradients, writing
an attribute and memory it made, as Ultralytics' assigner does): SelectRows reads each branch's
count where that branch needs it, two waits a call; CaptureLoss moves the second branch's count
work before the first read, in the grad mode each node ran in, and reads both counts at once.
Values and gradients equal native's (float64) over row masks with empty and full selections; the
attribute ends as native leaves it. Work that needs the first branch's rows, or a write of memory
made before the read, stays: two reads, and the certificate says why."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.select import CheckCounts
from fxpasses.testing.host_syncs import HostSyncs


class Assigner(nn.Module):
    """Marks the rows to score, without gradients, keeping how many it saw (an attribute write)
    and its scores in memory it makes and then writes."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale, self.seen = scale, 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        self.seen = x.shape[0]
        score = torch.empty_like(x[:, 0])
        score.copy_(x[:, 0] * self.scale)
        if shift is not None:
            score.add_(shift)
        return score > 0


class TwoBranches(nn.Module):
    """Each branch's rows by its assigner's mask; the first indexes a table with its rows (its
    count is read before that index). ``needs_first``: the second mask is shifted by the first
    branch's loss (needs its rows);
    ``writes_between``: after the first read, the memory the second assigner reads (through a
    view taken before the read) is written."""

    def __init__(self, needs_first: bool = False, writes_between: bool = False):
        super().__init__()
        self.first, self.second = Assigner(1.0), Assigner(-0.5)
        self.table = nn.Parameter(torch.linspace(0, 1, 5, dtype=torch.float64))
        self.needs_first, self.writes_between = needs_first, writes_between

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scratch = y.detach().clone()
        view = scratch.view(-1, 3)  # what the second assigner reads: the memory written below
        rows = x[self.first(x.detach())]
        # an index made from the rows (a check point: the first read comes before it)
        loss = (rows * rows).mean() + self.table[(rows[:, 0].abs() * 3).long().clamp(0, 4)].sum()
        if self.writes_between:
            scratch.mul_(-2.0)
        shift = loss.detach() if self.needs_first else None
        picked = y[self.second(view, shift)]
        return loss + picked.sin().mean()


def _optimized(loss: nn.Module):
    return optimize(loss, passes=[SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1, count_copies=False)])


def _inputs(n: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(m, 3, generator=g, dtype=torch.float64)


def _run(loss, inputs):
    x, y = (t.clone().requires_grad_() for t in inputs)
    value = loss(x, y)
    value.backward()
    return value.detach(), x.grad, y.grad, loss.table.grad, loss.first.seen, loss.second.seen


def _reads(fast) -> list:
    return [n for s in fast.specializations for n in s.graph_module.graph.nodes if isinstance(n.target, CheckCounts)]


def _moved(fast):
    return [c for s in fast.specializations for c in s.certificates
            if c.checks and c.checks[0].id == "count-work-moved"]


def _equal(native, fast, inputs) -> None:
    for want, got in zip(_run(native, inputs), _run(fast, inputs)):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
        else:
            assert got == want


def test_the_second_branch_counts_are_read_with_the_first():
    native, fast = TwoBranches(), _optimized(TwoBranches())
    for seed in range(4):
        _equal(native, fast, _inputs(9 + seed, 7 - seed, seed))
    (cert,) = _moved(fast)
    assert cert.applied and cert.checks[0].evidence["nodes_moved_before_the_first"] > 0
    (read,) = _reads(fast)
    assert len(read.target.selections) == 2
    inputs = _inputs(11, 6, 9)
    with HostSyncs("cpu") as syncs:
        _run(fast, inputs)
    assert fast.stats.optimized >= 4 and syncs.total == 1, syncs.counts


def test_a_count_over_its_capacity_runs_the_call_again():
    """The merged read finds a count over its capacity (64 rows at first), after the attribute
    writes moved before it: the call is abandoned and run again with grown capacities; values,
    gradients and the attributes equal native's."""
    native, fast = TwoBranches(), _optimized(TwoBranches())
    for seed, (n, m) in enumerate([(9, 7), (10, 8), (300, 280), (12, 9), (3, 400)]):
        _equal(native, fast, _inputs(n, m, seed))
    grown = [k for k in fast.stats.abandoned if k.startswith("selection-capacity")]
    assert grown and fast.stats.optimized == 5 and not fast.stats.native, fast.stats.render()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 12), st.integers(0, 12), st.integers(0, 2**31 - 1))
def test_values_and_gradients_equal_native_over_selections(n, m, seed):
    native, fast = TwoBranches(), _optimized(TwoBranches())
    for k in range(3):  # the first call traces; the later ones read once
        _equal(native, fast, _inputs(n, m, seed + k))


def test_work_that_needs_the_first_branch_rows_stays_after_its_read():
    """The second mask needs the first branch's loss, computed from its rows past the index op
    the first read must precede (a check point): moved, it would run on rows a count cut off."""
    native, fast = TwoBranches(needs_first=True), _optimized(TwoBranches(needs_first=True))
    for seed in range(3):
        _equal(native, fast, _inputs(9, 8, seed))
    (cert,) = _moved(fast)
    assert not cert.applied and cert.codes == ("count-work-not-moved",)
    assert cert.checks[0].evidence["why"].endswith("is a check point")
    assert len(_reads(fast)) == 2


def test_work_that_needs_a_write_of_older_memory_stays():
    """The second assigner reads memory made before the first read and written after it (the
    trace orders the reader after the write, through the view): the write would move before
    the read, over memory a node that stays may see."""
    native, fast = TwoBranches(writes_between=True), _optimized(TwoBranches(writes_between=True))
    for seed in range(3):
        _equal(native, fast, _inputs(9, 8, seed))
    (cert,) = _moved(fast)
    assert not cert.applied and cert.checks[0].evidence["why"].endswith("writes memory")
    assert len(_reads(fast)) == 2
