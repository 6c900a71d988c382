"""A loss that decodes its predictions, then packs its targets by in-place writes whose index is
as long as the batch's persons (a barrier no region holds), then scores the decoded predictions
against the packed targets, as the real criterion does (loss.py:919, :786-793): CaptureLoss moves
the decode after the packing, into the scoring region, so that the decoded tensor stops crossing
between two regions. Values and gradients equal native's (float64) over person counts with empty
images; work the packing itself needs, or that reads memory the packing writes, stays where it is,
and the certificate says why."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder

pytestmark = pytest.mark.skipif(torch.__version__ < "2.5", reason="torch 2.4 has no fake kernel for "
                                "bincount: the packed buffer's size has no metadata, nothing is captured")


class DecodeThenPack(nn.Module):
    """``decode`` the predictions (a chain of pointwise work), pack the targets per image, score.
    ``packing_reads_decode``: the packing scales the targets by the decoded mean (the decode is
    needed before the barrier); ``decode_reads_packed``: the decode reads a buffer the packing then
    writes in place (moving it after the write would change what it reads); ``no_grad_first``:
    the scoring starts without gradients (the decode, with them, must not move into that mode)."""

    def __init__(self, packing_reads_decode: bool = False, decode_reads_packed: bool = False,
                 no_grad_first: bool = False):
        super().__init__()
        self.packing_reads_decode, self.decode_reads_packed = packing_reads_decode, decode_reads_packed
        self.no_grad_first = no_grad_first

    def forward(self, preds: torch.Tensor, batch_idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        images = preds.shape[0]
        counts = torch.bincount(batch_idx, minlength=images)
        packed = values.new_zeros((images, int(counts.max()), values.shape[1]))
        source = packed[:, :1] if self.decode_reads_packed else preds.new_zeros(1)
        decoded = (preds * 2.0 + 0.5).tanh() * (preds.exp() + 1.0).log() + source.sum()
        decoded = decoded.clone() * 1.5 - preds.sigmoid()
        within = torch.arange(len(batch_idx)) - (counts.cumsum(0) - counts)[batch_idx]
        scale = decoded.mean() if self.packing_reads_decode else 1.0
        packed[batch_idx, within] = values * scale  # a write as long as the persons: a barrier
        with torch.set_grad_enabled(not self.no_grad_first):
            present = (packed != 0).any(-1).to(preds.dtype) * (preds.detach().abs() + 1).log1p().mean()
        error = (decoded.unsqueeze(1) - packed).square().sum(-1) * present
        return error.sum() / present.sum().clamp_min(1) + decoded.square().mean()


def _capture():
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1)


def _inputs(counts, seed):
    g = torch.Generator().manual_seed(seed)
    preds = torch.randn(len(counts), 2, generator=g, dtype=torch.float64, requires_grad=True)
    batch_idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    values = torch.rand(len(batch_idx), 2, generator=g, dtype=torch.float64) + 0.5
    return preds, batch_idx, values


def _sunk(fast):
    return [c for c in fast.certificates if c.checks and c.checks[0].id == "work-moved-into-later-region"]


def _equal_native(loss, fast, calls):
    for seed, counts in enumerate(calls):
        inputs = _inputs(counts, seed)
        reference = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        got, want = fast(*inputs), loss(*reference)
        got.backward()
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(inputs[0].grad, reference[0].grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("no_grad_first", [False, True])
def test_the_decode_moves_into_the_scoring_region_and_values_and_gradients_are_native(no_grad_first):
    """(``no_grad_first``: the decode moves before the scoring's no_grad block, in its own mode.)"""
    loss = DecodeThenPack(no_grad_first=no_grad_first)
    fast = optimize(loss, passes=[_capture()])
    _equal_native(loss, fast, [(2, 1, 3), (1, 4, 0), (3, 3, 3), (0, 2, 5)])
    moved = [c for c in _sunk(fast) if c.applied]
    assert moved, [c.checks[0].evidence for c in _sunk(fast)]
    evidence = moved[0].checks[0].evidence
    assert evidence["buffers_after"] < evidence["buffers_before"]  # the decoded tensor no longer crosses
    assert fast.stats.optimized == 4 and not fast.stats.native
    # the decode runs in the region that scores it: no region hands the decoded tensor to another
    regions = [n for n in fast.graph_module.graph.nodes if n.name.startswith("capture_region")]
    inner = [fast.graph_module.get_submodule(n.target.op_id) for n in regions]
    tanh_in = [i for i, g in enumerate(inner) if any(n.target is torch.tanh or n.target == "tanh"
                                                      for n in g.graph.nodes)]
    square_in = [i for i, g in enumerate(inner) if any(n.target == "square" for n in g.graph.nodes)]
    assert tanh_in and tanh_in == square_in[:1]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=1, max_size=4))
def test_moved_decode_equals_native_over_person_counts(batches):
    """Empty images, all persons in one image, one person, the largest count exceeded: float64
    values and prediction gradients equal native's."""
    loss = DecodeThenPack()
    fast = optimize(loss, passes=[_capture()])
    _equal_native(loss, fast, [(2, 1, 3), *[tuple(b) for b in batches]])


@pytest.mark.parametrize("variant, reason", [("packing_reads_decode", "used before the later region"),
                                             ("decode_reads_packed", "one writes memory the other reads")])
def test_work_the_packing_needs_or_that_reads_what_it_writes_stays(variant, reason):
    """The node the packing needs, or that reads the packed buffer, is held back with its reason
    (the rest of the decode may still move); values and gradients stay native's."""
    loss = DecodeThenPack(**{variant: True})
    fast = optimize(loss, passes=[_capture()])
    _equal_native(loss, fast, [(2, 1, 3), (1, 4, 0)])
    held = [why for c in _sunk(fast) for why in c.checks[0].evidence["held_back"].values()]
    assert any(reason in why for why in held), [c.checks[0].evidence for c in _sunk(fast)]
    assert all(c.codes == ("work-not-moved-into-region",) for c in _sunk(fast) if not c.applied)
