"""``x.unique(return_counts=True)`` read only for ``counts.max()`` (Ultralytics' target packing,
loss.py:400): the largest count without unique, no host read (each element compared with each,
or the longest run of the sorted input); values and gradients equal native's (float64), integer
counts exact on both paths, an empty input abandoning (native then raises)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fxpasses import optimize, trace
from fxpasses.ir.abandon import Abandon
from fxpasses.analysis.meta import annotate
from fxpasses.passes import CaptureLoss
from fxpasses.passes.unique_counts import unique_count_max
from fxpasses.runtime import max_multiplicity
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.max_multiplicity import MaxMultiplicity


class PackedTargets(nn.Module):
    """Boxes packed per image to the most in any image, as Ultralytics' ``preprocess``."""

    def forward(self, pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch_idx = targets[:, 0].long()
        _, counts = batch_idx.unique(return_counts=True)
        counts = counts.to(dtype=torch.int32)
        out = torch.zeros(pred.shape[0], counts.max(), 4, dtype=pred.dtype)
        offsets = torch.zeros(pred.shape[0] + 1, dtype=torch.long)
        offsets.scatter_add_(0, batch_idx + 1, torch.ones_like(batch_idx))
        within = torch.arange(len(batch_idx)) - offsets.cumsum(0)[batch_idx]
        out[batch_idx, within] = targets[:, 1:]
        return ((pred[:, None] - out) ** 2).sum()


class ValuesUsed(nn.Module):
    """A unique whose values are read too, and one of floats: both keep their read."""

    def forward(self, pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        images, counts = targets[:, 0].long().unique(return_counts=True)
        _, float_counts = targets[:, 1].unique(return_counts=True)
        return pred.sum() * counts.max() + images.sum() + float_counts.max()


def _capture() -> CaptureLoss:
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1)


def _inputs(counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch_idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    targets = torch.cat([batch_idx[:, None].double(), torch.rand(len(batch_idx), 4, generator=g,
                                                                 dtype=torch.float64)], 1)
    return torch.randn(len(counts), 4, generator=g, dtype=torch.float64), targets


def _run(fn, inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pred, targets = (t.detach().requires_grad_() for t in inputs)
    loss = fn(pred, targets)
    loss.backward()
    return loss.detach(), pred.grad, targets.grad


def _certificates(fast) -> list:
    return [c for s in fast.specializations for c in s.certificates if c.site.description.startswith("unique ")]


def test_the_largest_count_is_read_without_unique():
    native, fast = PackedTargets(), optimize(PackedTargets(), passes=[_capture()])
    for seed, counts in enumerate(([2, 1, 3, 1], [1, 4, 1, 1], [3, 3, 0, 1])):  # 7 targets: len() is
        # a traced constant in a test module (the tracer keeps it symbolic in the loss's libraries)
        inputs = _inputs(counts, seed)
        for a, b in zip(_run(native, inputs), _run(fast, inputs)):
            assert torch.equal(a, b)
    (cert,) = _certificates(fast)
    assert cert.applied and "most frequent" in cert.effect["host_reads"]
    assert cert.site.locations and "test_unique_counts.py" in cert.site.locations[0]
    graph = fast.specializations[0].graph_module.graph
    assert "unique" not in [n.target for n in graph.nodes]
    assert fast.stats.optimized == 3, fast.stats.exceptions


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 6), min_size=1, max_size=40), st.sampled_from([torch.int64, torch.int32, torch.uint8]))
def test_the_rewrite_gives_the_largest_count_of_any_integers(values, dtype):
    if dtype is torch.uint8:
        values = [abs(v) for v in values]

    def largest(x):
        _, counts = x.unique(return_counts=True)
        return counts.to(torch.int32).max(), counts.max()

    x = torch.tensor(values, dtype=dtype)
    gm = trace(largest, (x,))
    annotate(gm, [x])
    (cert,) = unique_count_max(gm, "CaptureLoss")
    gm.recompile()
    assert cert.applied and "unique" not in [n.target for n in gm.graph.nodes]
    for a, b in zip(largest(x), gm(x)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    shuffled = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(len(values)))]
    assert [int(v) for v in gm(shuffled)] == [int(v) for v in largest(shuffled)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=60), st.sampled_from([torch.int64, torch.int32, torch.uint8]),
       st.sampled_from([0, 1 << 12]))
def test_both_ways_of_counting_give_uniques_largest_count(values, dtype, pairwise):
    x = torch.tensor(values, dtype=dtype).reshape(-1, 1) if len(values) % 2 else torch.tensor(values, dtype=dtype)
    original = max_multiplicity.PAIRWISE
    max_multiplicity.PAIRWISE = pairwise  # 0: the sorted input's longest run
    try:
        got = MaxMultiplicity("largest")(x)
    finally:
        max_multiplicity.PAIRWISE = original
    assert got.dtype == torch.int64 and got.dim() == 0
    assert int(got) == int(x.unique(return_counts=True)[1].max())


def test_an_empty_input_abandons_and_the_call_raises_as_native_does():
    """No values have no largest count: the graph abandons (``largest-count-empty``) and the call
    runs natively, which raises here (a loss that returns early on no values gets its value:
    tests/passes/test_prefetch_reads.py)."""
    def largest(x):
        _, counts = x.unique(return_counts=True)
        return counts.max()

    x = torch.tensor([3, 1, 3])
    gm = trace(largest, (x,))
    annotate(gm, [x])
    assert unique_count_max(gm, "CaptureLoss")[0].applied
    gm.recompile()
    empty = torch.tensor([], dtype=torch.long)
    with pytest.raises(Abandon, match="largest-count-empty"):
        gm(empty)
    fast = optimize(largest, passes=[_capture()])
    assert int(fast(x)) == 2
    for fn in (largest, fast):
        with pytest.raises(RuntimeError):
            fn(empty)


def test_a_unique_whose_values_are_used_or_of_floats_keeps_its_read():
    native, fast = ValuesUsed(), optimize(ValuesUsed(), passes=[_capture()])
    inputs = _inputs([2, 1, 3])
    for a, b in zip(_run(native, inputs), _run(fast, inputs)):
        assert a is b is None or torch.equal(a, b)  # the targets get no gradient here
    certs = {c.site.nodes[0]: c for c in _certificates(fast)}
    assert len(certs) == 2 and not any(c.applied for c in certs.values())
    failed = {c.site.nodes[0]: [k.id for k in c.checks if not k.ok] for c in certs.values()}
    assert sorted(failed.values()) == [["integer-input"], ["read-for-its-largest-count"]], failed
    assert all(c.codes == ("unique-not-count-max",) for c in certs.values())
