"""Two sizes read from the targets (Ultralytics' keypoint packing, loss.py:790, and box packing,
loss.py:405): CaptureLoss reads both in one transfer at the first read; values and gradients equal
native's (float64) over count vectors with empty images, one image holding every target and
the largest count growing; a read whose input a write computes, or whose argument is written
between the reads, keeps its own transfer."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings, strategies as st

from fxpasses import optimize
from fxpasses.cli import import_file
from fxpasses.ir.trace_ops import GuardOp
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.select import StartCounts
from fxpasses.testing.host_syncs import HostSyncs

TWO_PACKINGS_FILE = Path(__file__).parents[1] / "helpers" / "two_packings.py"
TwoPackings = import_file(TWO_PACKINGS_FILE).TwoPackings


def _capture() -> CaptureLoss:
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1)


def _inputs(counts: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    batch_idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    n = len(batch_idx)
    return (torch.randn(len(counts), 7, generator=g, dtype=torch.float64), batch_idx,
            torch.rand(n, 4, generator=g, dtype=torch.float64), torch.rand(n, 3, generator=g, dtype=torch.float64))


def _run(fn, inputs) -> tuple[torch.Tensor, ...]:
    pred, batch_idx, boxes, kpts = inputs
    leaves = [t.detach().requires_grad_() for t in (pred, boxes, kpts)]
    loss = fn(leaves[0], batch_idx, leaves[1], leaves[2])
    loss.backward()
    return (loss.detach(), *(t.grad for t in leaves))


def _certificate(fast):
    (cert,) = [c for s in fast.specializations for c in s.certificates
               if c.site.description.endswith("host reads of scalars")]
    return cert


def _assert_equal(native, fast, inputs) -> None:
    for want, got in zip(_run(native, inputs), _run(fast, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_both_sizes_are_read_in_one_transfer():
    native, fast = TwoPackings(), optimize(TwoPackings(), passes=[_capture()])
    for seed, counts in enumerate(([2, 1, 3, 1], [1, 4, 1, 1], [3, 3, 1, 1], [2, 2, 2, 1])):
        _assert_equal(native, fast, _inputs(counts, seed))
    cert = _certificate(fast)
    assert cert.applied and cert.effect["host_reads"].startswith("2 reads in one transfer")
    (joined,) = [c.evidence["joined"] for c in cert.checks]
    assert len(joined) == 2 and cert.checks[0].evidence["nodes_moved_before_the_first"] > 0
    graph = fast.specializations[0].graph_module.graph
    (prefetch,) = [n for n in graph.nodes if isinstance(n.target, StartCounts)]
    assert [n.kwargs["prefetched"] for n in graph.nodes if "prefetched" in n.kwargs] == [prefetch] * 2
    inputs = _inputs([1, 3, 2, 1], 9)
    with HostSyncs("cpu") as syncs:
        _run(fast, inputs)
    with HostSyncs("cpu") as natively:
        _run(native, inputs)
    assert fast.stats.optimized == 5
    # one transfer where native reads three times (bincount's bound aside: the two sizes, unique)
    assert syncs.total == 1 and natively.total > 2, (syncs.counts, natively.counts)
    (sync,) = syncs.counts
    assert sync.op == "to-host (tolist)" and "in graph checked_item" in sync.site  # at the first read


def test_a_read_whose_input_a_write_computes_keeps_its_transfer():
    native, fast = TwoPackings(write_between=True), optimize(TwoPackings(write_between=True), passes=[_capture()])
    for seed, counts in enumerate(([2, 1, 3, 1], [1, 4, 1, 1])):
        _assert_equal(native, fast, _inputs(counts, seed))
    cert = _certificate(fast)
    assert not cert.applied and cert.checks[0].code == "reads-not-joined"
    (why,) = cert.checks[0].evidence["not_joined"].values()
    assert "writes memory" in why
    assert not any(isinstance(n.target, StartCounts) for n in fast.specializations[0].graph_module.graph.nodes)


def test_a_read_whose_argument_is_written_after_the_first_keeps_its_transfer():
    """The boxes' size is computed before the first read and bumped in place after it: a
    prefetch at the first read would read the old value (one slot too few)."""
    native, fast = TwoPackings(bump_after=True), optimize(TwoPackings(bump_after=True), passes=[_capture()])
    for seed, counts in enumerate(([2, 1, 3, 1], [1, 4, 1, 1], [3, 3, 1, 1])):
        _assert_equal(native, fast, _inputs(counts, seed))
    assert fast.stats.optimized == 3
    cert = _certificate(fast)
    assert not cert.applied and cert.checks[0].code == "reads-not-joined"
    (why,) = cert.checks[0].evidence["not_joined"].values()
    assert "may write what it reads, between the reads" in why


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=4, max_size=4).filter(any), min_size=1, max_size=6))
def test_values_and_gradients_equal_native_over_count_vectors(batches):
    """Empty images, every target in one image, the largest count growing from call to call."""
    native, fast = TwoPackings(), optimize(TwoPackings(), passes=[_capture()])
    for seed, counts in enumerate(batches):
        _assert_equal(native, fast, _inputs(counts, seed))
    assert fast.stats.optimized + sum(fast.stats.native.values()) == len(batches)


def test_a_batch_without_targets_fails_its_guard_before_any_region():
    """The loss's own ``if len(batch_idx) == 0`` is host arithmetic on an input's size: never
    captured, it runs before every region (it joined the first region once, and its guard ran
    after it, after the boxes' largest count had moved before the first read and raised on no
    targets). On a batch without targets the guard fails first, nothing of the graph having run;
    the call runs natively and a specialization of its own serves the later empty batches; the
    first specialization serves the batches with targets again."""
    native, fast = TwoPackings(guard_empty=True), optimize(TwoPackings(guard_empty=True), passes=[_capture()])
    for seed, counts in enumerate([[2, 1, 3], [1, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [3, 0, 2], [1, 1, 2]]):
        _assert_equal(native, fast, _inputs(counts, seed))
    assert _certificate(fast).applied  # still one transfer
    assert not fast.stats.native.get("optimized-path-raised"), fast.stats.render()
    assert dict(fast.stats.abandoned) == {f"guard-failed at {TWO_PACKINGS_FILE}:33": 3}, fast.stats.render()
    assert fast.stats.optimized == 6 and len(fast.specializations) == 2, fast.stats.render()
    first = list(fast.specializations[0].graph_module.graph.nodes)
    guard = next(i for i, n in enumerate(first) if isinstance(n.target, GuardOp)
                 and n.target.location.endswith("two_packings.py:33"))
    assert guard < min(i for i, n in enumerate(first) if n.name.startswith("capture_region"))
