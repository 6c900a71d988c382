"""CaptureLoss on CPU: partitioning per op class, refusal codes, guards and budget, ownership.

Capture itself is exercised with :class:`EmulatedRecorder`, which keeps CUDA graphs' static-buffer
semantics (every replay overwrites the same output and gradient tensors) on a CPU.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch import nn

from fxpasses import LeafPolicy, optimize, trace
from fxpasses.analysis.capture import plan_regions
from fxpasses.analysis.meta import annotate, fake_mode, is_dynamic, value
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.testing import assert_equivalent
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch


def opaque(x):
    """A function declared a leaf: unknown to the capture tables."""
    return x * 2


class Mixed(nn.Module):
    """One op of every class: capturable, host-sync, dynamic, unknown, local in-place, grad switch."""

    def forward(self, pred, target, mask):
        with torch.no_grad():
            weight = (target.sigmoid() * 2).clamp(0, 1).exp().sqrt()  # 5 capturable ops, no grad
        diff = (pred - target) * weight
        selected = diff[mask]                                  # host-sync: boolean-mask indexing
        dynamic = (selected.abs() * 2 + 1).sum()              # dynamic shapes
        count = mask.sum().clamp(min=1)
        smooth = (pred.exp() * 3 - 1).tanh() + 0.0
        smooth.mul_(0.5)                                       # in place, on its own memory
        tail = (opaque(smooth) + 1).mean() * pred.mean()      # opaque: unknown op, a barrier
        return dynamic / count + tail, tail


def _traced(loss, args, policy=None):
    gm = trace(loss, args, policy=policy or LeafPolicy(leaf_functions=(opaque,)))
    annotate(gm, list(args))
    return gm


def _args(rows=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(rows, 3, generator=g, requires_grad=True)
    target = torch.randn(rows, 3, generator=g)
    return pred, target, target[:, 0] > 0


def test_partition_decisions_per_op_class():
    gm = _traced(Mixed(), _args())
    plan = plan_regions(gm, devices=("cpu",), min_region_ops=1)

    def by_target(target):
        return [v for n, v in plan.verdicts.items() if n.target == target]

    assert all(v.capturable for v in by_target("sigmoid") + by_target(operator.sub))
    (selection,) = [n for n in gm.graph.nodes if n.target is operator.getitem
                    and plan.verdicts[n].code == "host-sync"]  # diff[mask]
    downstream = _downstream(selection)  # abs, *2, +1, sum: shapes known only from data
    assert downstream and {plan.verdicts[n].code for n in downstream} == {"dynamic-shape"}
    (opaque_call,) = by_target(opaque)
    assert opaque_call.code == "op-unknown" and opaque_call.barrier
    (in_place,) = [n for n in gm.graph.nodes if n.target == "mul_"]  # memory the loss made
    assert plan.verdicts[in_place].capturable and not plan.verdicts[in_place].barrier
    (tanh,) = [n for n in gm.graph.nodes if n.target == "tanh"]
    assert any(in_place in r and tanh in r for r in plan.regions)  # with the op making it
    switches = by_target(torch._C._set_grad_enabled)  # the no_grad block is held whole
    assert len(switches) == 2 and all(v.capturable and not v.barrier for v in switches)
    nodes = list(gm.graph.nodes)
    first, second = [i for i, n in enumerate(nodes) if n.target is torch._C._set_grad_enabled]
    (holding,) = [r for r in plan.regions if nodes[first] in r]
    assert set(nodes[first:second + 1]) <= set(holding)  # both switches and the 5 ops
    assert plan.blocks_in(holding) and plan.blocks_in(holding)[0].off is nodes[first]
    for region in plan.regions:  # no region spans a barrier
        positions = [list(gm.graph.nodes).index(n) for n in region]
        barriers = [i for i, n in enumerate(gm.graph.nodes) if plan.verdicts[n].barrier]
        assert not any(min(positions) < b < max(positions) for b in barriers)


class InPlace(nn.Module):
    """In-place writes of each kind: on memory the loss made (``clone``, a view of it), on a view
    of an input, on a buffer, and on memory a host read sees before the write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(3))

    def forward(self, pred, target, mask):
        y = (pred * 1.5).clone()
        y[..., :2] *= 2.0                      # local, through a view
        y[..., 0] += target[..., 0]            # local
        decoded = (y.exp() + 1).log().tanh()
        target.detach()[:, 0].mul_(1.0)        # a view of an input: stays a barrier
        self.scale.mul_(1.0)                   # a buffer: stays a barrier
        z = (target * 3).sigmoid()
        seen = z[mask]                         # a host read of z before z is written
        z.mul_(2.0)                            # must stay a barrier
        return (decoded * self.scale).sum() + seen.sum() + (z * pred).sum()


def _in_place_plan():
    gm = _traced(InPlace(), _args())
    return gm, plan_regions(gm, devices=("cpu",), min_region_ops=1, count_copies=False)


def test_an_in_place_write_on_memory_the_loss_made_is_captured_with_its_aliases():
    gm, plan = _in_place_plan()
    writes = [n for n in gm.graph.nodes if n.target in (operator.imul, operator.iadd, "mul_")]
    local = [n for n in writes if plan.verdicts[n].capturable]
    assert len(local) == 2  # y[..., :2] *= 2, y[..., 0] += ...
    (clone,) = [n for n in gm.graph.nodes if n.target == "clone"]
    (region,) = [r for r in plan.regions if clone in r]
    assert set(local) <= set(region)


def test_an_in_place_write_to_an_input_a_buffer_or_seen_memory_stays_a_barrier():
    gm, plan = _in_place_plan()
    kept = [plan.verdicts[n] for n in gm.graph.nodes if n.target == "mul_"]
    assert len(kept) == 3 and all(v.code == "op-in-place" and v.barrier for v in kept)


def test_regions_with_in_place_writes_match_native_in_float64():
    loss = InPlace().double()
    fast, _ = _captured(loss, min_region_ops=1, count_copies=False)
    for seed in range(4):
        pred, target, mask = _args(seed=seed)
        args = (pred.detach().double().requires_grad_(), target.double(), mask)
        assert_equivalent(loss, fast, args, rtol=1e-12, atol=1e-12, parameters=False)
    fast(*args)
    applied = [c for c in fast.certificates if c.pass_name == "CaptureLoss" and c.applied]
    assert applied and fast.stats.optimized >= 1
    assert ("op-in-place",) in {c.codes for c in fast.certificates if not c.applied}


def _downstream(node):
    """The users of ``node``, transitively while their values have data-dependent shapes."""
    found, frontier = [], [node]
    while frontier:
        for user in frontier.pop().users:
            if user not in found:
                found.append(user)
                if is_dynamic(value(user)):
                    frontier.append(user)
    return found


class Spread(torch.nn.Module):
    """Six kernels, five tensors in and five out: a replay would add more launches than it saves."""

    def forward(self, a, b, c, d, e):
        return a + b, c * d, (e - a).abs(), b.exp(), c.sin()


class Chain(torch.nn.Module):
    """Twenty kernels on one tensor in, one out."""

    def forward(self, a):
        for _ in range(10):
            a = (a * 1.5).tanh()
        return a


def test_a_region_must_launch_more_kernels_than_a_replay_adds():
    args = [torch.randn(3, requires_grad=True) for _ in range(5)]
    fast, _ = _captured(Spread(), count_copies=True)
    fast(*args)
    (cert,) = [c for c in fast.certificates if c.pass_name == "CaptureLoss" and "region-too-small" in c.codes]
    assert cert.checks[0].evidence["kernel_ops"] == 6 and cert.checks[0].evidence["copies"] == 10
    assert not any(c.applied and "region" in c.effect for c in fast.certificates)
    fast, _ = _captured(Spread(), count_copies=False)  # every region of min_region_ops kernels
    fast(*args)
    assert any(c.applied and "region" in c.effect for c in fast.certificates)
    fast, _ = _captured(Chain(), count_copies=True)
    assert torch.allclose(fast(args[0]), Chain()(args[0]))
    (region,) = [c for c in fast.certificates if c.applied and "region" in c.effect]
    assert region.effect["kernel_ops"] == 20


def test_regions_need_capture_devices_and_fake_cuda_tensors_plan_on_a_cpu():
    gm = trace(Mixed(), _args(), policy=LeafPolicy(leaf_functions=(opaque,)))
    with fake_mode():
        fakes = [torch.empty(12, 3, device="cuda"), torch.empty(12, 3, device="cuda"),
                 torch.empty(12, dtype=torch.bool, device="cuda")]
    annotate(gm, fakes)
    assert plan_regions(gm).regions  # CUDA (fake) tensors: regions
    cpu = _traced(Mixed(), _args())
    plan = plan_regions(cpu)  # default devices: cuda only
    assert not plan.regions and "device-not-captured" in {v.code for v in plan.verdicts.values()}


def test_no_cuda_is_a_refusal_and_the_loss_runs_unchanged():
    loss = Mixed()
    fast = optimize(loss, passes=[CaptureLoss()], leaf_functions=[opaque])
    args = _args()
    assert all(torch.equal(a, b) for a, b in zip(fast(*args), loss(*args)))
    (cert,) = [c for c in fast.certificates if c.pass_name == "CaptureLoss"]
    assert "not-on-capture-device" in cert.codes and not fast.specializations[0].run.snapshots[-1].modified


def _captured(loss, recorder=None, **options):
    recorder = recorder or EmulatedRecorder()
    options.setdefault("record_after", 1)  # these tests replay from the second call on
    return optimize(loss, passes=[CaptureLoss(devices=("cpu",), recorder=recorder, **options)],
                    leaf_functions=[opaque]), recorder


def _regions(fast):
    return {k: v for k, v in fast.stats.sites.items() if "capture_region" in k}


def test_captured_values_and_gradients_match_native_over_steps():
    loss = Mixed()
    fast, recorder = _captured(loss)
    for seed in range(4):
        assert_equivalent(loss, fast, _args(seed=seed), rtol=1e-6, atol=1e-6, parameters=False)
    fast(*_args())  # the oracle ran copies; certificates are on the original
    codes = {c.codes for c in fast.certificates if not c.applied}
    assert {("host-sync",), ("dynamic-shape",), ("op-unknown",)} <= codes


def test_held_outputs_and_accumulated_gradients_are_not_overwritten_by_replays():
    loss = Mixed()
    fast, _ = _captured(loss)
    pred, target, mask = _args(seed=1)
    first = fast(pred, target, mask)
    first[0].backward()
    kept = [t.detach().clone() for t in first]
    grad_after_one = pred.grad.clone()
    second = fast(*_args(seed=2))  # replays overwrite the static buffers
    second[0].backward()
    assert all(torch.equal(a, b) for a, b in zip(first, kept))  # the caller's outputs kept their values
    fast(pred, target, mask)[0].backward()  # accumulate a second gradient into pred.grad
    assert torch.allclose(pred.grad, 2 * grad_after_one)
    assert all(v.get("replayed", 0) >= 2 for v in _regions(fast).values())


def test_replay_waits_for_the_pending_backward():
    loss = Mixed()
    fast, _ = _captured(loss)
    a, b = _args(seed=3), _args(seed=4)
    out_a = fast(*a)[0]
    out_b = fast(*b)[0]  # a's backward is pending: regions run eagerly, a's activations survive
    ref_a = loss(*[x.detach().requires_grad_(x.requires_grad) for x in a])[0]
    (grad_a,) = torch.autograd.grad(out_a, a[0])
    (grad_b,) = torch.autograd.grad(out_b, b[0])
    a_ref = a[0].detach().requires_grad_()
    (expected_a,) = torch.autograd.grad(loss(a_ref, *a[1:])[0], a_ref)
    b_ref = b[0].detach().requires_grad_()
    (expected_b,) = torch.autograd.grad(loss(b_ref, *b[1:])[0], b_ref)
    assert torch.allclose(grad_a, expected_a) and torch.allclose(grad_b, expected_b)
    assert torch.allclose(out_a, ref_a)
    assert any(v.get("replay-pending-backward") for v in _regions(fast).values())


def test_replay_resumes_when_an_unused_result_is_freed():
    fast, _ = _captured(Mixed())
    fast(*_args(seed=5))  # result dropped without backward: its graph is freed
    fast(*_args(seed=6))
    assert not any(v.get("replay-pending-backward") for v in _regions(fast).values())


def _step(loss, fast, args):
    """One call of ``fast`` (itself, not the oracle's copy: its counters move) against native."""
    got, want = fast(*args), loss(*args)
    assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-6) for g, w in zip(got, want))
    got[0].backward()  # the step's backward: the next call may replay


def test_recordings_beyond_the_budget_replace_the_least_recently_replayed_then_stop():
    loss = Mixed()
    fast, recorder = _captured(loss, max_recordings=2)
    for rows in (8, 9, 8, 10, 9, 8):  # 10 replaces 9 (8 replayed since), 9 replaces 8, 8 replaces 10
        assert_equivalent(loss, fast, _args(rows=rows), rtol=1e-6, atol=1e-6, parameters=False)
        _step(loss, fast, _args(rows=rows))
    regions = _regions(fast).values()
    assert regions and all(v == {"recorded": 5, "evicted": 3, "replayed": 6} for v in regions)
    moved = fast.stats.rerecorded
    assert set(moved) == set(_regions(fast))
    for again in moved.values():  # each recording after the first says which input's shape moved
        assert sum(again.values()) == 4 and all(" shape: (" in k for k in again), again
        assert any(k.endswith(("(8,) -> (9,)", "(8, 3) -> (9, 3)")) for k in again), again
    shown = [line for line in fast.explain().splitlines() if "recorded again for:" in line]
    assert len(shown) == len(moved) and all(" shape: (" in line for line in shown), shown
    for rows in (11, 12, 13, 14):  # 4 x max_recordings made in all: no more recordings
        _step(loss, fast, _args(rows=rows))
    regions = _regions(fast).values()
    assert all(v["recorded"] == 8 and v["record-budget"] == 1 for v in regions)


def test_a_signature_is_recorded_when_it_recurs(monkeypatch):
    """By default a region records a signature on its second call: a shape seen once (a
    data-dependent one) runs natively and costs no recording; the unrecorded ones remembered
    are bounded."""
    from fxpasses.runtime import capture

    loss = Mixed()
    fast, _ = _captured(loss, record_after=2)
    for rows in (8, 9, 8, 8):  # 9 is seen once: never recorded
        _step(loss, fast, _args(rows=rows))
    regions = _regions(fast).values()
    assert regions and all(v == {"awaiting-repeat": 2, "recorded": 1, "replayed": 2} for v in regions)
    monkeypatch.setattr(capture, "MAX_SIGHTINGS", 2)
    site = capture.CapturedRegion("r", lambda x: x * 2, recorder=EmulatedRecorder(), record_after=2)
    for rows in (1, 2, 3, 1, 3, 3):  # 1 is forgotten when 3 arrives; 3 recurs and is recorded
        assert torch.equal(site(torch.ones(rows)), torch.full((rows,), 2.0))
    assert site.counters == {"awaiting-repeat": 4, "recorded": 1, "replayed": 2}
    with pytest.raises(ValueError, match="record_after"):
        CaptureLoss(record_after=0)


class FailingRecorder(EmulatedRecorder):
    def record(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_runs_the_region_eagerly_from_then_on():
    loss = Mixed()
    fast, _ = _captured(loss, recorder=FailingRecorder())
    for seed in range(2):
        assert_equivalent(loss, fast, _args(seed=seed), rtol=1e-6, atol=1e-6, parameters=False)
    assert all(v == {"capture-failed": 2} for v in _regions(fast).values())


def test_small_regions_are_refused():
    fast, _ = _captured(Mixed(), min_region_ops=100)
    fast(*_args())
    assert {c.codes for c in fast.certificates if c.codes} >= {("region-too-small",)}
    assert not _regions(fast)


def test_hook_added_after_capture_sends_the_next_call_native():
    loss = Mixed()
    fast, _ = _captured(loss)
    fast(*_args())
    loss.register_forward_hook(lambda *args: None)
    fast(*_args())
    assert fast.stats.native == {"hook-added": 1}


@pytest.fixture(scope="module")
def pose_float64():
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().double()
    fast = optimize(loss, passes=[PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), record_after=1)])
    return loss, fast


# Each comparison optimizes a copy of ``fast`` again (the oracle deep-copies it): one batch by
# default, three under -m slow.
@pytest.mark.long
@pytest.mark.parametrize("batches", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_pose_loss_with_both_passes_matches_native_in_float64(pose_float64, batches):
    loss, fast = pose_float64
    for seed in range(batches):
        batch = make_batch(2, seed=seed, image_size=96, dtype=torch.float64)
        assert_equivalent(loss, fast, (batch,), rtol=1e-9, atol=1e-10)  # on a copy of fast
    fast(batch)
    certs = fast.certificates
    assert any(c.pass_name == "PairRLE" and c.applied for c in certs)
    regions = [c for c in certs if c.pass_name == "CaptureLoss" and c.applied]
    assert len(regions) >= 2
    (paired,) = [c for c in certs if c.pass_name == "CaptureLoss" and c.site.description.startswith("row-independent call")]
    assert paired.applied and paired.witness.max_abs_grad_diff < 1e-12  # recorded per row bucket
    site = next(v for k, v in fast.stats.sites.items() if "captured_pair" in k)
    assert site["paired"] == site.get("replayed", 0) + site.get("record-budget", 0) >= 1


@pytest.mark.long
def test_tensor_alpha_changed_between_replays_is_honoured(pose_float64):
    loss, fast = pose_float64
    batch = make_batch(2, seed=7, image_size=96, dtype=torch.float64)
    for weight in (0.25, 0.9):
        alpha = torch.tensor(weight, dtype=torch.float64)
        out = fast(batch, alpha)
        assert out.alpha is alpha
        expected = loss(batch, alpha)
        assert torch.allclose(out.total, expected.total, rtol=1e-12)
        out.total.backward()  # the step's backward: the next call may replay
    index = fast.specializations[-1].index  # the alpha override is its own input structure
    replays = [v for k, v in fast.stats.sites.items() if k.startswith(f"{index}:capture_region")]
    assert replays and all(v.get("replayed", 0) == 2 for v in replays)


def test_regions_returning_sizes_and_ints_replay_with_their_constants():
    from fxpasses.runtime.capture import CapturedRegion

    def region(x, y):
        z = (x * y).exp()
        return z, z.shape, x.shape[0], z.sum()

    site = CapturedRegion("r", region, recorder=EmulatedRecorder())
    for seed in range(3):
        x, y = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)
        z, shape, rows, total = site(x, y)
        assert shape == torch.Size([4, 3]) and rows == 4 and torch.allclose(total, (x * y).exp().sum())
        (grad,) = torch.autograd.grad(total, x)
        assert torch.allclose(grad, y * (x * y).exp())
        del z, total  # a held output would keep the next call eager (outputs-alive)
    assert site.counters == {"recorded": 1, "replayed": 3}


@pytest.mark.long
def test_pose_outputs_held_across_steps_keep_their_values():
    loss = DualBranchPoseLoss()
    fast = optimize(loss, passes=[PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), record_after=1)])
    first = fast(make_batch(2, seed=0, image_size=96))
    first.total.backward()
    kept = {(b, k): v.detach().clone() for b in first.branches for k, v in first.branches[b].items()}
    second = fast(make_batch(2, seed=1, image_size=96))
    second.total.backward()
    assert not torch.equal(second.total, first.total)
    assert all(torch.equal(first.branches[b][k], v) for (b, k), v in kept.items())


def test_a_held_output_is_never_overwritten_by_the_next_call():
    from fxpasses.runtime.capture import CapturedRegion

    def region(x):
        y = x * 2
        return y, y.shape, y + 1  # top-level output 2 is flat leaf 3 (the Size holds two ints)

    site = CapturedRegion("r", region, recorder=EmulatedRecorder())
    first = site(torch.ones(2, 2))[2]
    second = site(torch.zeros(2, 2))[2]  # first is alive: this call runs eagerly
    assert torch.equal(first, torch.full((2, 2), 3.0)) and torch.equal(second, torch.ones(2, 2))
    del first, second
    third = site(torch.zeros(2, 2))[2]  # nothing refers to the static memory: replayed
    assert torch.equal(third, torch.ones(2, 2))
    assert site.counters == {"recorded": 1, "replayed": 2, "outputs-alive": 1}


def test_paired_flow_is_recorded_per_power_of_two_row_bucket():
    from fxpasses.runtime.paired_capture import CapturedPairedCall, bucket

    assert [bucket(n, 1024) for n in (0, 1, 1024, 1025, 5000)] == [1024, 1024, 1024, 2048, 8192]
    torch.manual_seed(0)
    flow = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    site = CapturedPairedCall("pair", "forward", devices=("cpu",), min_bucket=16, max_recordings=2,
                              recorder=EmulatedRecorder())
    for rows_a, rows_b in ((3, 4), (10, 0), (20, 5), (40, 30)):  # buckets 16, 16, 32, 128
        a, b = torch.randn(rows_a, 2, requires_grad=True), torch.randn(rows_b, 2, requires_grad=True)
        out_a, out_b = site(flow, a, b)
        assert torch.allclose(out_a, flow(a)) and torch.allclose(out_b, flow(b))
        loss = out_a.sum() + 2 * out_b.sum()
        got = torch.autograd.grad(loss, [a, b, *flow.parameters()])
        want = torch.autograd.grad(flow(a).sum() + 2 * flow(b).sum(), [a, b, *flow.parameters()])
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
        del out_a, out_b, loss  # views of the recording's outputs: held, they force eager calls
    assert site.counters == {"paired": 4, "recorded": 3, "replayed": 4, "evicted": 1}
    assert site.changes == {"padded rows shape: (16, 2) -> (32, 2)": 1, "padded rows shape: (32, 2) -> (128, 2)": 1}


class LogAbsDensity(torch.nn.Module):
    """A density whose derivatives are infinite at zero: padding rows would poison gradients."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(2))

    def log_prob(self, x):
        return -(x * self.scale).abs().log().sum(-1)


class LogAbsLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.flow = LogAbsDensity()

    def forward(self, a, b, mask):
        return self.flow.log_prob(a[mask]).mean() + self.flow.log_prob(b[mask]).mean()


def test_paired_call_whose_padding_is_unsafe_stays_eager():
    loss = LogAbsLoss()
    fast = optimize(loss, passes=[PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), record_after=1)])
    a, b = torch.randn(6, 2), torch.randn(6, 2)
    mask = torch.tensor([True, False, True, True, False, True])
    assert torch.allclose(fast(a, b, mask), loss(a, b, mask))
    (paired,) = [c for c in fast.certificates if c.site.description.startswith("row-independent call")]
    assert paired.codes == ("padding-unsafe",)


class Noisy(nn.Module):
    """Dropout draws random numbers: a replay would draw others."""

    def forward(self, x):
        return (torch.nn.functional.dropout(x.exp() * 2 + 1, 0.5).tanh() * 3).sum()


def test_random_ops_stay_eager():
    gm = _traced(Noisy(), (torch.randn(4, 3),))
    plan = plan_regions(gm, devices=("cpu",), min_region_ops=1)
    by_name = {n.name: v for n, v in plan.verdicts.items()}
    assert by_name["dropout"].code == "op-random" and not by_name["dropout"].barrier
    assert by_name["exp"].capturable and by_name["tanh"].capturable


class UnbackedSplit(nn.Module):
    """Chunks of a data-dependent row count: shape propagation stops there (torch 2.4 to 2.13;
    BatchNorm's batch-size check stops it only from some version after 2.4)."""

    def forward(self, x, mask):
        return (torch.split(x[mask], 2)[0].exp() * 2).sum() + x.sum()


def test_nodes_shape_propagation_never_reached_are_barriers():
    x = torch.randn(6, 3)
    gm = trace(UnbackedSplit(), (x, x[:, 0] > 0))
    failures = annotate(gm, [x, x[:, 0] > 0])
    plan = plan_regions(gm, devices=("cpu",), min_region_ops=1)
    unreached = [v for n, v in plan.verdicts.items() if v.code == "op-no-metadata"]
    assert failures and unreached and all(v.barrier for v in unreached)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_tensors_without_cuda_are_refused_saying_so():
    gm = trace(Mixed(), _args(), policy=LeafPolicy(leaf_functions=(opaque,)))
    with fake_mode():
        fakes = [torch.empty(12, 3, device="cuda"), torch.empty(12, 3, device="cuda"),
                 torch.empty(12, dtype=torch.bool, device="cuda")]
    annotate(gm, fakes)
    result = CaptureLoss().run(gm)
    (cert,) = result.certificates
    assert cert.codes == ("cuda-unavailable",) and not result.modified


def _region_codes(capture, gm, plan, nodes) -> dict[str, str | None]:
    cert = capture._region_certificate(gm, 0, nodes, plan)
    return {c.id: c.code for c in cert.checks if not c.ok}


def test_region_checks_are_read_from_the_graph_and_fail_on_a_region_that_breaks_them():
    """Each check of a region certificate is computed from the nodes it fuses (they held by
    construction, recorded as True whatever the region): a planned region passes them all; one
    with a host read, a data-dependent shape, a node on another device, a barrier spanned or a
    path out and back in fails the check that says so."""
    gm = _traced(Mixed(), _args())
    capture = CaptureLoss(devices=("cpu",), min_region_ops=1)
    plan = plan_regions(gm, devices=("cpu",), min_region_ops=1)
    assert plan.regions and all(_region_codes(capture, gm, plan, r) == {} for r in plan.regions)
    nodes = list(gm.graph.nodes)
    (selection,) = [n for n in nodes if plan.verdicts[n].code == "host-sync"]
    dynamic = next(n for n in nodes if plan.verdicts[n].code == "dynamic-shape")
    assert _region_codes(capture, gm, plan, [*plan.regions[0], selection])["ops-capturable"] == "host-sync"
    assert _region_codes(capture, gm, plan, [dynamic])["static-shapes"] == "dynamic-shape"
    assert _region_codes(CaptureLoss(devices=("cuda",)), gm, plan, plan.regions[0]) == {
        "on-capture-device": "device-not-captured"}
    (barrier,) = [n for n in nodes if n.target is opaque]  # user code: a barrier
    before = [n for n in nodes if plan.verdicts[n].capturable and nodes.index(n) < nodes.index(barrier)]
    after = [n for n in nodes if plan.verdicts[n].capturable and nodes.index(n) > nodes.index(barrier)]
    spanning = _region_codes(capture, gm, plan, [before[-1], after[0]])
    assert spanning["no-barrier-inside"] == "op-unknown"
    exp = next(n for n in nodes if n.target == "exp" and n.args[0].op == "placeholder")  # pred.exp()
    (tail,) = [u for u in exp.users]  # exp * 3 -> ... -> mul_ -> opaque (eager) -> + 1
    (opaque_call,) = [n for n in nodes if n.target is opaque]
    (plus_one,) = [u for u in opaque_call.users]
    assert _region_codes(capture, gm, plan, [tail, plus_one])["region-convex"] == "region-not-convex"


def _described(val):
    """Shapes, strides, dtypes; a data-dependent size as any such (each propagation names its own);
    a Python scalar as "scalar" (torch 2.4's FakeTensorProp keeps None for one in a tuple)."""
    return [re.sub(r"\bu\d+\b", "u", str((tuple(t.shape), t.stride(), t.dtype))) if isinstance(t, torch.Tensor)
            else "scalar" for t in torch.utils._pytree.tree_leaves(val, is_leaf=lambda x: x is None)]


@pytest.mark.parametrize("loss", ["mixed", "pose"])
def test_a_fused_regions_metadata_is_what_propagation_gives_it(loss):
    """A region's node and its outputs' getitems carry the metadata of the nodes they replaced
    (so the pipeline propagates nothing below them again): the same shapes, strides, dtypes and
    facts as propagating the region itself gives."""
    from fxpasses.analysis.meta import ANNOTATED, annotate_new
    from fxpasses.analysis.ops import node_facts
    from fxpasses.runtime.capture import CapturedRegion

    if loss == "mixed":
        fast, _ = _captured(Mixed())
        fast(*_args())
    else:
        pose = DualBranchPoseLoss().double()
        fast = optimize(pose, passes=[PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())])
        fast(make_batch(2, seed=0, image_size=96, dtype=torch.float64))
    gm = fast.specializations[0].graph_module
    regions = [n for n in gm.graph.nodes if isinstance(n.target, CapturedRegion)]
    carried = {n: (_described(value(n)), node_facts(n)) for r in regions
               for n in (r, *[u for u in r.users if u.target is operator.getitem])}
    assert regions and all(n.meta.get(ANNOTATED) is not None for n in carried)
    for node in carried:
        del node.meta[ANNOTATED]
    annotate_new(gm)
    for node, (described, facts) in carried.items():
        again = node_facts(node)
        assert _described(value(node)) == described, node.name
        assert (set(again.ops), again.writes_input, again.host_read, again.random, again.computes,
                again.complete, again.torch_code) == (set(facts.ops), facts.writes_input, facts.host_read,
                                                      facts.random, facts.computes, facts.complete,
                                                      facts.torch_code), node.name
