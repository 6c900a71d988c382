"""Sizes read from data stay symbolic: one trace serves every batch, whatever its object counts.

``len(t)``, ``int(t)``, ``t.shape[k]`` that flow only into sizes or arithmetic are nodes computed on
every call, not exact-value guards (:mod:`fxpasses.tracing.shadows`); a branch on a size guards
only its truth. Each program (:mod:`size_programs`) is traced once and called on batches of other
sizes, empty images and empty batches included; values and every gradient equal the native loss
in float64.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

from fxpasses import optimize, trace
from fxpasses.cli import import_file
from fxpasses.ir.trace_ops import ExpectValue, GuardOp, WriteAttribute
from fxpasses.tracing.shadows import SHADOWED, why_not_shadowed

programs = import_file(Path(__file__).with_name("size_programs.py"))

KEYPOINTS, ANCHORS, BATCH = 4, 5, 3


def _batch(counts, seed=0):
    """Inputs of PackedLoss for persons per image ``counts`` (about a third unlabelled)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.as_tensor(counts)
    n = int(counts.sum())
    xy = torch.rand(n, KEYPOINTS, 2, generator=g, dtype=torch.float64)
    visible = torch.rand(n, KEYPOINTS, generator=g, dtype=torch.float64) > 0.3
    keypoints = torch.cat((xy * visible[..., None], visible[..., None] * 2.0), -1)
    pred = torch.rand(len(counts), ANCHORS, KEYPOINTS, 3, generator=g, dtype=torch.float64)
    return pred.requires_grad_(), keypoints, torch.repeat_interleave(torch.arange(len(counts)), counts)


def _call(loss, *args):
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = loss(*args)
    out.backward()
    params = [p.grad.clone() for p in getattr(loss, "parameters", lambda: [])()]
    for p in getattr(loss, "parameters", lambda: [])():
        p.grad = None
    return out.detach(), [a.grad for a in args if a.requires_grad], params


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
    for g, w in zip([*got[1], *got[2]], [*want[1], *want[2]], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def _guards(gm):
    return [n.target for n in gm.graph.nodes if isinstance(n.target, GuardOp)]


COUNTS = [[1, 3, 0], [2, 2, 2], [0, 0, 5], [1, 0, 0], [4, 7, 1], [0, 0, 0], [3, 1, 2], [9, 0, 1]]


def test_packed_targets_trace_once_for_every_count():
    native = programs.PackedLoss(KEYPOINTS, BATCH)
    fast = optimize(native)
    for seed, counts in enumerate(COUNTS):
        batch = _batch(counts, seed)
        _assert_same(_call(fast, *batch), _call(native, *batch))
    assert len(fast.specializations) == 1
    assert fast.stats.optimized == len(COUNTS) and not fast.stats.native


def test_a_short_last_batch_shares_the_trace():
    """The batch size read from the predictions reaches ``torch.bincount(minlength=...)``, an int
    argument torch's argument parser takes by ``__index__`` before any ``__torch_function__``:
    it stays a node computed on every call, not an exact guard (the trainer's last batch of an
    epoch is short)."""
    native = programs.PackedLoss(KEYPOINTS, BATCH, batch_from_predictions=True)
    fast = optimize(native)
    for seed, counts in enumerate([[1, 3, 0], [2, 2, 2], [0, 4], [3, 1, 2], [5], [0, 0, 1, 2]]):
        batch = _batch(counts, seed)
        _assert_same(_call(fast, *batch), _call(native, *batch))
    assert len(fast.specializations) == 1
    assert fast.stats.optimized == 6 and not fast.stats.native and not fast.stats.abandoned
    bincount = next(n for n in fast.specializations[0].graph_module.graph.nodes
                    if n.target is torch.bincount)
    assert isinstance(bincount.kwargs["minlength"], torch.fx.Node)


def test_a_size_used_as_a_size_is_no_value_guard_but_a_node():
    gm = trace(programs.PackedLoss(KEYPOINTS, BATCH), _batch([1, 3, 0]))
    lines = {g.location.rsplit(":", 1)[-1] for g in _guards(gm) if isinstance(g, ExpectValue)}
    source = {i + 1: line for i, line in enumerate(open(programs.__file__).read().splitlines())}
    assert not [source[int(n)] for n in lines if "len(" in source[int(n)] or "int(" in source[int(n)]]
    nodes = {n.name: n for n in gm.graph.nodes}
    zeros = next(n for n in nodes.values() if n.target == "new_zeros")
    padded = zeros.args[1][1]  # int(counts.max()), computed on every call
    assert padded.target is torch.sym_int and padded.args[0].target == "item"
    arange = next(n for n in nodes.values() if getattr(n.target, "__name__", "") == "arange")
    assert arange.args[0].target == "size"  # len(batch_idx)
    divided = [n for n in nodes.values() if len(n.args) == 2 and getattr(n.args[1], "target", None)
               == "size" and n.args[1].args[0] is n.args[0]]  # loss /= len(loss)
    assert [str(n.target) for n in divided] == ["__idiv__"]


@pytest.mark.skipif(torch.__version__ < "2.5", reason="torch 2.4 has no fake kernel for bincount "
                    "(DynamicOutputShapeException): the packed targets' shapes are unknown there")
def test_shape_propagation_reads_a_padded_size_as_an_unbacked_symbol():
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from fxpasses.analysis.meta import annotate
    from fxpasses.signature import flatten_call

    batch = _batch([1, 3, 0])
    gm = trace(programs.PackedLoss(KEYPOINTS, BATCH), batch)
    leaves, _ = flatten_call(batch, {})
    assert annotate(gm, gm.meta["fxpasses"].signature.inputs(leaves)) == []  # every node has metadata
    zeros = next(n for n in gm.graph.nodes if n.target == "new_zeros")
    assert free_unbacked_symbols(tuple(zeros.meta["val"].shape[1:2]))  # int(counts.max())


def test_int_of_arithmetic_on_a_size_and_a_setting_is_computed_each_call():
    native = programs.CountedTopK()
    fast = optimize(native)
    for n in (3, 5, 0, 8, 1):
        scores = torch.randn(2, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        args = (scores.requires_grad_(), torch.zeros(n, dtype=torch.long))
        _assert_same(_call(fast, *args), _call(native, *args))
    native.fraction = 0.25  # a float setting: an input of the graph
    _assert_same(_call(fast, *args), _call(native, *args))
    assert len(fast.specializations) == 1 and not fast.stats.native


def test_a_branch_on_a_size_guards_only_its_truth():
    native = programs.EmptyGuarded()
    fast = optimize(native)
    pred = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    for n in (2, 5, 1, 7):
        idx = torch.arange(n) % 4
        _assert_same(_call(fast, pred, idx), _call(native, pred, idx))
    assert len(fast.specializations) == 1 and fast.stats.optimized == 4
    kinds = {(type(g).__name__, g.expected) for g in _guards(fast.specializations[0].graph_module)}
    assert kinds == {("ExpectValue", False)}  # bool(len(batch_idx) == 0) was False
    empty = torch.zeros(0, dtype=torch.long)
    _assert_same(_call(fast, pred, empty), _call(native, pred, empty))  # the other way: native
    assert sum(fast.stats.native.values()) == 1


def test_the_stand_ins_are_the_builtins_on_what_is_not_traced():
    loss = programs.BuiltinsAsBefore()
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    native = loss(x)
    want = (list(loss.sizes), loss.zero_d_error)
    del loss.sizes, loss.zero_d_error
    gm = trace(loss, (x,))
    written = {n.target.name: n.args[1] for n in gm.graph.nodes if isinstance(n.target, WriteAttribute)}
    assert written == {"sizes": want[0], "zero_d_error": want[1]}  # constants: plain values
    assert all(type(v) is int for v in written["sizes"])
    out = gm.meta["fxpasses"].unflatten_output(gm(x))
    torch.testing.assert_close(out, native)
    assert (loss.sizes, loss.zero_d_error) == want
    assert not _guards(gm)  # len(x) is the node x.size(0)


def test_another_thread_calling_the_stand_ins_during_a_trace_gets_the_builtins():
    x = torch.arange(6.0, dtype=torch.float64).reshape(3, 2)
    programs.SEEN.clear()
    gm = trace(programs.OtherThread(), (x,))
    assert programs.SEEN == {"len": 3, "int": 0, "int-size": 3, "len-list": 2}
    assert all(type(v) is int for v in programs.SEEN.values())
    alone = trace(programs.OtherThread(other=False), (x,))
    shown = [(n.op, str(n.target)) for n in gm.graph.nodes]
    assert shown == [(n.op, str(n.target)) for n in alone.graph.nodes]  # nothing the other thread did
    assert not _guards(gm)


def test_module_globals_are_put_back_after_a_trace_and_after_a_failed_one():
    from fxpasses.trace import TraceFailure

    namespace = vars(programs)
    trace(programs.PackedLoss(KEYPOINTS, BATCH), _batch([2, 1, 1]))
    assert not [name for name in SHADOWED if name in namespace]
    with pytest.raises(TraceFailure):
        trace(programs.Raises(), (torch.ones(2, 2),))
    assert not [name for name in SHADOWED if name in namespace]
    assert len(torch.ones(4)) == 4


def test_a_method_of_a_size_takes_its_value_with_a_guard():
    native = programs.PowerOfTwo()
    gm = trace(native, (torch.ones(3, 2),))
    assert [(type(g).__name__, g.expected) for g in _guards(gm)] == [("ExpectValue", 2)]  # len(x) - 1
    fast = optimize(native)
    for rows in (3, 4, 6, 3):
        x = torch.rand(rows, 2, dtype=torch.float64)
        torch.testing.assert_close(fast(x), native(x))
    assert fast.stats.optimized == 3 and len(fast.specializations) == 2  # 6 rows: 8 slots, a new trace


def _module(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_REFUSED = {
    "value": "def loss(x):\n    n = len(x)\n    return x.sum() / n if isinstance(n, int) else x.sum()\n",
    "mapped": "def loss(x):\n    return x.sum() * sum(map(int, '12'))\n",
    "bound": "len = len\ndef loss(x):\n    return x.sum() / len(x)\n",
    "rebinds": "def loss(x):\n    global int\n    int = float\n    return x.sum()\n",
    "globals": "def loss(x):\n    return x.sum() / globals()['__builtins__']['len'](x)\n",
    "table": "TABLE = {'cast': lambda v: int}\ndef loss(x):\n    return x.sum() / len(x)\n",
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_module_that_could_tell_a_stand_in_keeps_the_builtins(tmp_path, case):
    module = _module(tmp_path, f"refused_{case}", _REFUSED[case])
    assert why_not_shadowed(vars(module)) is not None
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    try:
        gm = trace(module.loss, (x,))
    except Exception:  # the module's own code (rebinding int) is not the point here
        return
    assert not [name for name in SHADOWED if name in vars(module) and case not in ("bound", "rebinds")]
    info = gm.meta["fxpasses"]
    assert module.__name__ in dict(info.builtins_refused)
    torch.testing.assert_close(info.unflatten_output(gm(x)), module.loss(x))


def test_a_module_that_only_calls_them_gets_stand_ins(tmp_path):
    module = _module(tmp_path, "called_only", "def loss(x):\n    return x.sum() / len(x) + int(x.shape[1])\n")
    assert why_not_shadowed(vars(module)) is None
    gm = trace(module.loss, (torch.ones(3, 2),))
    assert module.__name__ in gm.meta["fxpasses"].builtins_shadowed and not _guards(gm)
    assert "len" not in vars(module) and "int" not in vars(module)
    for rows in (1, 5, 0):
        x = torch.ones(rows, 2)
        torch.testing.assert_close(gm.meta["fxpasses"].unflatten_output(gm(x)), module.loss(x), equal_nan=True)


@st.composite
def _count_sequences(draw):
    """Batches of persons per image: empty images, all persons in one image, one person in the
    batch, an empty batch, and a batch with more in one image than any before."""
    counts = st.lists(st.integers(0, 6), min_size=BATCH, max_size=BATCH)
    batches = draw(st.lists(counts, min_size=1, max_size=4))
    special = draw(st.sampled_from(["none", "one-image", "one-person", "exceeded", "empty"]))
    if special == "one-image":
        batches.append([0, draw(st.integers(1, 9)), 0])
    elif special == "one-person":
        batches.append([0, 0, 1])
    elif special == "exceeded":
        batches.append([max(max(b) for b in batches) + draw(st.integers(1, 4)), 0, 1])
    elif special == "empty":
        batches.insert(draw(st.integers(0, len(batches))), [0, 0, 0])
    return batches


_SHARED: dict = {}  # one optimized loss for every example: traced on the first batch it sees


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_count_sequences(), st.integers(0, 2**16))
def test_one_trace_equals_native_over_any_count_sequence(batches, seed):
    if not _SHARED:
        native = programs.PackedLoss(KEYPOINTS, BATCH)
        _SHARED.update(native=native, fast=optimize(native))
    native, fast = _SHARED["native"], _SHARED["fast"]
    calls = fast.stats.optimized
    for i, counts in enumerate(batches):
        batch = _batch(counts, seed + i)
        _assert_same(_call(fast, *batch), _call(native, *batch))
    assert len(fast.specializations) == 1 and fast.stats.optimized == calls + len(batches)
    assert not fast.stats.native


@pytest.mark.parametrize("first", [[0, 0, 0], [0, 1, 0], [5, 5, 5]])
def test_a_trace_made_on_an_empty_or_a_full_batch_serves_the_others(first):
    native = programs.PackedLoss(KEYPOINTS, BATCH)
    fast = optimize(native)
    for seed, counts in enumerate([first, [2, 0, 7], [0, 0, 0], [1, 1, 1], [3, 0, 0]]):
        batch = _batch(counts, seed)
        _assert_same(_call(fast, *batch), _call(native, *batch))
    assert len(fast.specializations) == 1 and not fast.stats.native
