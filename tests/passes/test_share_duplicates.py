"""Work a loss does twice on the same inputs (each branch packing the same targets) is done once
by CaptureLoss, where no write reaches the shared memory; everything else stays as it was, and
values and gradients are native's (float64)."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fxpasses import optimize
from fxpasses.cli import import_file
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.bounded_counts import BoundedBincount

pytestmark = pytest.mark.skipif(torch.__version__ < "2.5", reason="torch 2.4 has no fake kernel for "
                                "bincount: the packed buffer's size has no metadata, so nothing is shared")

helpers = import_file(Path(__file__).parents[1] / "helpers" / "two_branch_targets.py")


class _Counted(TorchDispatchMode):
    """The aten ops a call runs, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _capture():
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1)


def _inputs(counts, seed):
    g = torch.Generator().manual_seed(seed)
    many, one = (torch.randn(len(counts), 2, generator=g, dtype=torch.float64, requires_grad=True)
                 for _ in range(2))
    batch_idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    values = torch.rand(len(batch_idx), 2, generator=g, dtype=torch.float64) + 0.5
    return many, one, batch_idx, values


def _bounded(fast) -> int:
    """How many bincounts the final graph computes (each rewritten by bounded_counts)."""
    return sum(isinstance(n.target, BoundedBincount) for n in fast.graph_module.graph.nodes)


def _shared(fast):
    return [c for c in fast.certificates if c.applied and "nodes_removed" in c.effect]


def test_the_second_branch_packs_nothing_again_and_matches_native():
    loss = helpers.TwoBranches()
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (1, 4, 0), (3, 3, 3), (1, 2, 5)]):
        inputs, reference = _inputs(counts, seed), _inputs(counts, seed)
        with _Counted() as ours:  # (the first call's also counts the trace and the pipeline)
            got = fast(*inputs)
        with _Counted() as native:
            want = loss(*reference)
        got.backward()
        want.backward()
        assert abs(float(got.detach()) - float(want.detach())) <= 1e-10 * (1 + abs(float(want.detach())))
        for a, b in zip(inputs[:2], reference[:2]):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
        assert native.ops.count("bincount") == 2
        if seed:  # a steady call: no bincount (bounded_counts: bins compared on the device), no item
            assert ours.ops.count("bincount") == 0 and ours.ops.count("_local_scalar_dense") == 0
    assert fast.stats.optimized == 4 and not fast.stats.native
    assert _bounded(fast) == 1  # one packing's counts, read once (with their bound)
    shared = _shared(fast)
    assert shared and all(c.site.locations for c in shared)
    kept = [c for c in fast.certificates if "duplicate-written" in c.codes]
    # each branch's buffer is written in place (packed, then scaled by its own factor): kept apart
    assert any("new_zeros" in c.checks[0].evidence["ops"] for c in kept)


@pytest.mark.parametrize("loss_class", ["TwoBranches", "SamePackings"])  # (SamePackings: write chains shared)
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=5),
                          st.sampled_from([None, float("nan"), float("inf")])), min_size=1, max_size=4))
def test_shared_packing_equals_native_over_count_vectors(loss_class, batches):
    """Empty images, all persons in one image, one person, the largest count exceeded, a batch
    with no person at all, a non-finite target value: the same values and gradients as native,
    in float64 (NaN where native's is NaN)."""
    loss = getattr(helpers, loss_class)()
    fast = optimize(loss, passes=[_capture()])
    for seed, (counts, odd) in enumerate([((2, 1, 3), None), *batches]):
        inputs, reference = _inputs(counts, seed), _inputs(counts, seed)
        if odd is not None and len(inputs[3]):
            inputs[3][0, 1] = reference[3][0, 1] = odd
        got, want = fast(*inputs), loss(*reference)
        got.backward()
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12, equal_nan=True)
        for a, b in zip(inputs[:2], reference[:2]):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, equal_nan=True)


def test_grad_mode_switches_and_values_with_gradients_are_not_shared():
    loss = helpers.TwiceUnderNoGrad()
    fast = optimize(loss, passes=[_capture()])
    for seed in range(2):
        x = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed),
                        requires_grad=True)
        y = x.detach().clone().requires_grad_(True)
        got, want = fast(x), loss(y)
        got.backward()
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=0)
    shared = [name for c in _shared(fast) for name in c.site.nodes]
    assert "mul_1" in shared  # x * 2 in the second no_grad block: the first block's
    assert not any(name.startswith("_set_grad_enabled") for name in shared)  # switches: effects
    refused = [c for c in fast.certificates if "duplicate-autograd" in c.codes]
    assert [c.site.nodes for c in refused] == [("mul_2",)]  # x * 2 with gradients


def test_branches_whose_batch_sizes_differ_fail_the_equal_size_guard_and_run_natively():
    """The second branch's packing reads the first branch's batch size in place of its own,
    under a guard: a call whose two predictions differ in rows is abandoned, and native."""
    loss = helpers.TwoBranches()
    fast = optimize(loss, passes=[_capture()])
    fast(*_inputs((2, 1, 3), 0))  # traced with equal batch sizes
    guards = [g for c in _shared(fast) for g in c.guards]
    assert guards and all(g.code == "guard-failed" for g in guards)
    many, one, batch_idx, values = _inputs((2, 1, 3), 1)
    one = torch.cat([one.detach(), torch.ones(1, 2, dtype=torch.float64)]).requires_grad_(True)
    reference = [t.detach().clone().requires_grad_(t.requires_grad) for t in (many, one, batch_idx, values)]
    got, want = fast(many, one, batch_idx, values), loss(*reference)
    got.backward()
    want.backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-10 * (1 + abs(float(want.detach())))
    torch.testing.assert_close(one.grad, reference[1].grad, rtol=1e-10, atol=1e-12)
    assert sum(fast.stats.abandoned.values()) == 1


def test_a_size_shared_with_the_one_it_equals_gets_no_guard_comparing_it_with_itself():
    """Each branch's ``len(batch_idx.flatten())``: the second is a duplicate of the first (the
    same op on the same input) and equal to it; sharing it is proof enough, and a guard
    ``ExpectEqualSizes(n, n)`` (it was made, then rewired to one node) checked nothing on every
    call. The guard on the predictions' batch sizes stays, and values and gradients are native's."""
    from fxpasses.ir.trace_ops import ExpectEqualSizes
    loss = helpers.FlattenedTwoBranches()
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (1, 4, 0)]):
        inputs, reference = _inputs(counts, seed), _inputs(counts, seed)
        got, want = fast(*inputs), loss(*reference)
        got.backward()
        want.backward()
        assert abs(float(got.detach()) - float(want.detach())) <= 1e-10 * (1 + abs(float(want.detach())))
        for a, b in zip(inputs[:2], reference[:2]):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    guards = [n.args for n in fast.graph_module.graph.nodes if isinstance(n.target, ExpectEqualSizes)]
    assert guards and all(a is not b for a, b in guards)
    recorded = [g for c in _shared(fast) for g in c.guards]
    assert len(recorded) == len(guards)
    assert fast.stats.optimized == 2


def test_no_equal_size_guard_after_a_write_of_the_loss_state():
    """A loss that writes its own buffer first: a guard added later could abandon a call whose
    write is already done, so the two branches keep their own batch sizes (and bincounts)."""
    loss, reference_loss = helpers.CountingTwoBranches(), helpers.CountingTwoBranches()
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (1, 4, 0), (3, 3, 3)]):
        inputs, reference = _inputs(counts, seed), _inputs(counts, seed)
        with _Counted() as ours:
            got = fast(*inputs)
        want = reference_loss(*reference)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12)
        if seed:
            assert ours.ops.count("bincount") == 0  # (bounded_counts: bins compared on the device)
    assert float(loss.calls) == float(reference_loss.calls) == 3
    assert _bounded(fast) == 2  # each branch's own counts and read
    assert not [g for c in _shared(fast) for g in c.guards]


def test_random_draws_with_equal_arguments_stay_two_draws():
    """``rand_like(x)`` twice: equal calls, different values; sharing them would make the
    difference zero."""
    fast = optimize(helpers.TwoDraws(), passes=[_capture()])
    x = torch.ones(64, dtype=torch.float64)
    assert float(fast(x).abs().sum()) > 0
    refused = [c for c in fast.certificates if "duplicate-impure" in c.codes]
    assert [c.site.nodes for c in refused] == [("rand_like_1",)]
    assert refused[0].checks[0].evidence["facts"]["random"] is True


def _matches_native(fast, loss, counts, seed):
    inputs, reference = _inputs(counts, seed), _inputs(counts, seed)
    with _Counted() as ours:
        got = fast(*inputs)
    with _Counted() as native:
        want = loss(*reference)
    got.backward()
    want.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12, equal_nan=True)
    for a, b in zip(inputs[:2], reference[:2]):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, equal_nan=True)
    return ours.ops, native.ops


def test_a_second_packing_by_the_same_steps_is_the_first_one_and_matches_native():
    """Both branches allocate, write the rows and scale in place by the same steps: the second
    buffer's write chain repeats the first's, so the second packing is not run at all."""
    loss = helpers.SamePackings()
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (1, 4, 0), (3, 3, 3), (1, 2, 5)]):
        ours, native = _matches_native(fast, loss, counts, seed)
        assert native.count("new_zeros") == native.count("index_put_") == 2
        if seed:
            assert ours.count("new_zeros") == ours.count("index_put_") == 1
    chains = [c for c in _shared(fast) if "write_chain" in c.checks[0].evidence]
    written = {op for c in chains for op in c.checks[0].evidence["ops"]}
    assert {"new_zeros", "set_item", "imul"} <= written, written
    guards = [g for c in _shared(fast) for g in c.guards]
    assert any("object" in g.description for g in guards)  # the two holders' scale: one tensor


def test_a_buffer_written_again_after_the_second_packing_is_not_shared():
    loss = helpers.RepackedAfterUse()
    fast = optimize(loss, passes=[_capture()])
    for seed, counts in enumerate([(2, 1, 3), (1, 4, 0), (3, 3, 3)]):
        ours, native = _matches_native(fast, loss, counts, seed)
        if seed:
            assert ours.count("new_zeros") == native.count("new_zeros") == 2
    kept = [c for c in fast.certificates if "duplicate-written" in c.codes]
    assert any("new_zeros" in c.checks[0].evidence["ops"] for c in kept)
    assert not any("write_chain" in c.checks[0].evidence for c in _shared(fast))


def test_holders_whose_scale_stops_being_one_tensor_abandon_the_call_and_match_native():
    """The second branch read the first's scale in place of its own (one object when traced);
    once the user gives the second branch a scale of its own, a call is native, never stale."""
    loss = helpers.SamePackings()
    fast = optimize(loss, passes=[_capture()])
    _matches_native(fast, loss, (2, 1, 3), 0)
    loss.branches[1].scale = torch.tensor([5.0, 7.0], dtype=torch.float64)
    _matches_native(fast, loss, (1, 4, 2), 1)
    assert any(k.startswith("guard-failed") for k in fast.stats.abandoned), fast.stats.render()
