"""Zero buffers sized from data (the most objects in an image) become capacities (multiples of 8) in
CaptureLoss where the witness, the loss run on the traced call at both sizes, shows the extra zero
slots change nothing; a loss that reads its padding (a mean over the slots) keeps exact sizes."""

from pathlib import Path

import pytest
import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.padded_size import PaddedSize
from fxpasses.cli import import_file

pytestmark = pytest.mark.skipif(torch.__version__ < "2.5", reason="torch 2.4 has no fake kernel for "
                                "bincount: the packed buffer's size has no metadata, so no site is seen "
                                "(the shape-propagation certificate says metadata-failed)")

Packed = import_file(Path(__file__).parents[1] / "helpers" / "packed_targets.py").Packed


def _call(counts, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    preds = torch.randn(len(counts), 11, generator=g, dtype=dtype, requires_grad=True)
    batch_idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    values = torch.rand(len(batch_idx), 1, generator=g, dtype=dtype) + 0.5
    return preds, batch_idx, values


def _capture():
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1, count_copies=False)


def _padding(fast):
    return [c for c in fast.certificates if c.site.description.startswith("zero buffer")]


def _matches_native(loss, fast, counts_seq):
    """Values and prediction gradients equal native's in float64 on each call (fresh inputs)."""
    for seed, counts in enumerate(counts_seq):
        inputs, reference = _call(counts, seed), _call(counts, seed)
        got, want = fast(*inputs), loss(*reference)
        got.backward()
        want.backward()
        assert abs(float(got.detach()) - float(want)) <= 1e-10 * (1 + abs(float(want)))
        torch.testing.assert_close(inputs[0].grad, reference[0].grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("counts_seq", [
    [(2, 1, 3), (5, 0, 1), (1, 1, 1), (0, 7, 2), (3, 3, 3)],   # the largest count exceeded, an empty image
    [(1, 0, 0), (0, 0, 1), (9, 0, 0)],                          # one person, all in one image
])
def test_padded_buffers_match_native_in_float64(counts_seq):
    loss = Packed()
    fast = optimize(loss, passes=[_capture()])
    _matches_native(loss, fast, counts_seq)
    (cert,) = _padding(fast)
    assert cert.applied and cert.witness.max_abs_value_diff <= 1e-10 and cert.witness.max_abs_grad_diff <= 1e-10
    gm = fast.specializations[0].graph_module
    ops = [n.target for n in gm.graph.nodes if isinstance(n.target, PaddedSize)]
    assert len(ops) == 1 and ops[0].min_bucket == 8
    assert fast.stats.optimized == len(counts_seq) and not fast.stats.native


@pytest.mark.parametrize("mean_over_slots", [False, True])
def test_a_buffer_sized_from_a_padded_one_gets_no_capacity_of_its_own(mean_over_slots):
    """The second buffer's size is the first one's (padded) shape: its certificate follows the
    first one's, and no capacity op of its own stands between the nodes over both buffers."""
    loss = Packed(follow=True, mean_over_slots=mean_over_slots)
    fast = optimize(loss, passes=[_capture()])
    _matches_native(loss, fast, [(2, 1, 3), (5, 0, 1), (1, 1, 1), (0, 19, 2)])
    packed, scores = _padding(fast)
    assert packed.site.locations != scores.site.locations
    gm = fast.specializations[0].graph_module
    ops = [n.target for n in gm.graph.nodes if isinstance(n.target, PaddedSize)]
    if mean_over_slots:
        assert not packed.applied and not scores.applied and not ops
        assert scores.codes == packed.codes == ("padding-not-inert",)
        return
    assert packed.applied and scores.applied and len(ops) == 1
    assert scores.effect["capacity"].startswith(f"none inserted: its size is read from {packed.site.nodes[0]}")
    assert fast.stats.optimized == 4 and not fast.stats.native


@pytest.mark.parametrize("follow", [False, True])
def test_a_smaller_count_after_a_larger_one_replays_the_larger_capacity(follow):
    """The capacity only grows: after a batch of 19 objects in an image (24 slots), batches of
    at most 8 (8 slots on their own) replay the 24-slot recordings, and the 8-slot ones are
    dropped (their memory freed) in every region, the regions that take the padded buffer
    without its size included."""
    from fxpasses.runtime.capture import CapturedRegion

    loss = Packed(follow=follow)
    fast = optimize(loss, passes=[_capture()])
    seq = [(2, 1, 3), (5, 0, 1), (0, 19, 2), (1, 19, 0), (3, 3, 3), (2, 1, 1), (4, 0, 4)]
    _matches_native(loss, fast, seq)
    every = [n.target for n in fast.graph_module.graph.nodes if isinstance(n.target, CapturedRegion)]
    assert every and all(len(r.recordings) == 1 for r in every), [len(r.recordings) for r in every]

    def padded(recording):  # the packed buffers among a recording's inputs: (images, slots, 1)
        return [t for t in recording.inputs if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 3]

    # (the regions of the per-image counts alone, static since their bincount has minlength bins,
    # take no padded buffer: one recording each, nothing evicted)
    regions = [r for r in every if any(padded(rec) for rec in r.recordings.values())]
    slots = {t.shape[1] for r in regions for rec in r.recordings.values() for t in padded(rec)}
    assert regions and slots == {24}, slots
    assert all(r.counters["evicted"] >= 1 for r in regions), [dict(r.counters) for r in regions]
    assert all(r.made == 2 for r in regions), [r.made for r in regions]  # 8 slots, then 24 only
    assert fast.stats.optimized == len(seq) and not fast.stats.native


def test_a_loss_that_reads_its_padding_keeps_exact_sizes():
    loss = Packed(mean_over_slots=True)
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (5, 0, 1)]):
        inputs, reference = _call(counts, seed), _call(counts, seed)
        got, want = fast(*inputs), loss(*reference)
        assert abs(float(got.detach()) - float(want)) <= 1e-10 * (1 + abs(float(want)))
    (cert,) = _padding(fast)
    assert not cert.applied and cert.codes == ("padding-not-inert",)
    assert cert.witness.max_abs_value_diff > 1e-3  # the mean over 32 slots, not over 3
    gm = fast.specializations[0].graph_module
    assert not any(isinstance(n.target, PaddedSize) for n in gm.graph.nodes)


def test_a_witness_that_cannot_run_padded_keeps_exact_sizes():
    """Weights built at the exact count do not broadcast against a padded buffer: the padded run
    raises, so there is no evidence, and the buffers keep their exact sizes."""
    loss = Packed(exact_slot_weights=True)
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (5, 0, 1)]):
        inputs, reference = _call(counts, seed), _call(counts, seed)
        got, want = fast(*inputs), loss(*reference)
        got.backward()
        want.backward()
        assert abs(float(got.detach()) - float(want)) <= 1e-10 * (1 + abs(float(want)))
        torch.testing.assert_close(inputs[0].grad, reference[0].grad, rtol=1e-10, atol=1e-12)
    (cert,) = _padding(fast)
    assert not cert.applied and cert.codes == ("padding-witness-unavailable",)
    assert cert.witness is None
    assert "RuntimeError" in next(c for c in cert.checks if not c.ok).evidence["error"]
    gm = fast.specializations[0].graph_module
    assert not any(isinstance(n.target, PaddedSize) for n in gm.graph.nodes)


def test_capacity_buckets_only_grow_and_zero_stays_zero():
    op = PaddedSize("p", "here", 4)
    assert [op(n)[0] for n in (0, 1, 3, 8, 9, 16, 17, 24)] == [0, 8, 8, 8, 16, 16, 24, 24]
    assert [op(n)[0] for n in (5, 0, 33, 3)] == [24, 0, 40, 40]  # a smaller count: the largest bucket
    assert PaddedSize("q", "here", 4)(torch.tensor(5))[0] == 8
    assert PaddedSize("r", "here", 16)(3)[0] == 16  # at least the minimum
    op.padded = False
    assert op(5) == (5,)


def test_the_witness_leaves_the_graph_that_made_the_predictions_to_the_caller():
    """Predictions computed by a network that shares a parameter with the loss (as the YOLO26
    head shares its flow): the witness runs the loss on detached copies, so its backward never
    runs (and frees) the network's graph, whose backward the caller runs on the traced call."""
    loss = Packed()
    fast = optimize(loss, passes=[_capture()])
    weight = loss.head.weight
    for seed, counts in enumerate([(2, 1, 3), (0, 4, 1)]):
        preds, batch_idx, values = _call(counts, seed)
        got = fast((preds * weight[0, 0]).exp(), batch_idx, values)
        got.backward()  # raised "backward through the graph a second time" before
        got_grad, weight.grad = weight.grad, None
        want = loss((preds * weight[0, 0]).exp(), batch_idx, values)
        want.backward()
        torch.testing.assert_close(got_grad, weight.grad, rtol=1e-10, atol=1e-12)
        weight.grad = None
    assert _padding(fast)[0].applied
