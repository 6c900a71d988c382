"""Input values the loss never reads are free in the signature (fxpasses.tracing.input_reads).

A training batch carries metadata the loss never reads (file names, shapes): calls that differ
there share one trace. A value the loss does read (a key taken, every value handed out) stays a
constant matched by equality, so a call with another one is traced again and gets its values.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fxpasses import optimize
from fxpasses.signature import CallSignature, flatten_call
from fxpasses.tracing.input_reads import InputReads, ReadDict


def _batch(seed: int, files=("a.png", "b.png"), mode="train") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2 + seed % 3, 3, generator=g, dtype=torch.float64),
            "im_file": tuple(f"{seed}/{f}" for f in files), "ori_shape": ((seed, 7), (5, seed)),
            "ratio_pad": ((1.0 + seed, 0.5),), "mode": mode}


def _reads_x(pred, batch):
    return ((pred - batch["x"].sum(0)) ** 2).sum()


def _reads_mode(pred, batch):
    scale = 2.0 if batch["mode"] == "train" else 3.0
    return scale * ((pred - batch["x"].sum(0)) ** 2).sum()


def _reads_items(pred, batch):
    total = pred.sum() * 0
    for key, value in batch.items():  # hands out every value: none is free
        if key == "ori_shape":
            total = total + value[0][0]
    return total + (pred * batch["x"].sum(0)).sum()


def _reads_type(pred, batch):
    scale = 2.0 if type(batch) is dict else 3.0  # the stand-in is no plain dict: nothing is free
    return scale * ((pred - batch["x"].sum(0)) ** 2).sum()


def _run(fast, loss, pred, batch):
    got_pred, want_pred = (pred.detach().clone().requires_grad_() for _ in range(2))
    got, want = fast(got_pred, batch), loss(want_pred, batch)
    got.backward(), want.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_pred.grad, want_pred.grad, rtol=0, atol=0)


def test_values_never_read_are_free_and_one_trace_serves_every_batch():
    fast = optimize(_reads_x, passes=[])
    pred = torch.randn(3, dtype=torch.float64)
    for seed in range(6):  # other file names, shapes and padding ratios each call
        _run(fast, _reads_x, pred, _batch(seed))
    assert len(fast.specializations) == 1
    assert fast.stats.optimized == 6 and not fast.stats.native
    evidence = fast.specializations[0].certificates[0].checks[0].evidence["inputs_not_read"]
    assert list(evidence["values"]) == ["batch['im_file']", "batch['ori_shape']", "batch['ratio_pad']",
                                  "batch['mode']"]
    placeholders = [n.name for n in fast.specializations[0].graph_module.graph.nodes
                    if n.op == "placeholder"]
    assert placeholders == ["pred", "batch_x"]  # ratio_pad's float is no input any more


def test_a_value_the_loss_reads_stays_a_constant_and_another_one_is_traced_again():
    fast = optimize(_reads_mode, passes=[])
    pred = torch.randn(3, dtype=torch.float64)
    for seed, mode in [(0, "train"), (1, "train"), (2, "val"), (3, "val"), (4, "train")]:
        _run(fast, _reads_mode, pred, _batch(seed, mode=mode))
    assert len(fast.specializations) == 2  # one per mode, file names free in both
    assert fast.stats.optimized == 5 and not fast.stats.native


def test_a_dict_whose_values_are_all_handed_out_has_no_free_value():
    fast = optimize(_reads_items, passes=[])
    pred = torch.randn(3, dtype=torch.float64)
    for seed in (0, 1, 1, 2):
        _run(fast, _reads_items, pred, _batch(seed))
    assert len(fast.specializations) == 3  # ori_shape steers the value: each one its trace
    assert not fast.specializations[0].info.unread_inputs


def test_code_that_can_tell_the_dict_type_leaves_no_value_free():
    fast = optimize(_reads_type, passes=[])
    pred = torch.randn(3, dtype=torch.float64)
    for seed in range(3):
        _run(fast, _reads_type, pred, _batch(seed))  # native's 2.0, as type(batch) is dict
    assert len(fast.specializations) == 3 and not fast.specializations[0].info.unread_inputs
    assert fast.stats.optimized == 3


def _reads_mode_unbound(pred, batch):
    scale = 2.0 if dict.__getitem__(batch, "mode") == "train" else 3.0  # past the stand-in's override
    return scale * ((pred - dict.get(batch, "x").sum(0)) ** 2).sum()


def _reads_values_unbound(pred, batch):
    mode = list(dict.values(batch))[-1]
    return (2.0 if mode == "train" else 3.0) * ((pred - batch["x"].sum(0)) ** 2).sum()


@pytest.mark.parametrize("loss", [_reads_mode_unbound, _reads_values_unbound])
def test_dict_methods_called_unbound_on_the_batch_take_every_value(loss):
    fast = optimize(loss, passes=[])
    pred = torch.randn(3, dtype=torch.float64)
    for seed, mode in enumerate(("train", "val", "train")):
        _run(fast, loss, pred, _batch(seed, mode=mode))  # 3.0 for val: a stale 2.0 before
    assert not fast.specializations[0].info.unread_inputs
    assert fast.stats.optimized == 3


def test_a_call_missing_a_free_key_or_with_another_structure_is_not_matched():
    fast = optimize(_reads_x, passes=[])
    pred = torch.randn(3, dtype=torch.float64)
    _run(fast, _reads_x, pred, _batch(0))
    signature = fast.specializations[0].signature
    no_files = {k: v for k, v in _batch(1).items() if k != "im_file"}
    assert signature.leaves_of((pred, no_files), {}, lambda: flatten_call((pred, no_files), {})) is None
    assert signature.flatten((pred, no_files), {}) is None
    three = _batch(1, files=("a", "b", "c"))  # a free value of another structure still matches
    leaves = signature.leaves_of((pred, three), {}, lambda: flatten_call((pred, three), {}))
    assert leaves is not None and signature.inputs(leaves)[1] is three["x"]
    _run(fast, _reads_x, pred, no_files)
    assert len(fast.specializations) == 2


def test_the_generated_matcher_and_the_pytree_path_agree_on_free_values():
    pred, batch = torch.randn(3), _batch(0)
    reads = InputReads()
    (_, wrapped), _ = reads.wrap(((pred, batch), {}))
    wrapped["x"]  # the loss reads x alone
    signature = CallSignature.of_call((pred, batch), {}).without(reads.unread(), (pred, batch), {})
    other = _batch(5, files=("q",))
    by_matcher = signature.leaves_of((pred, other), {}, lambda: None)
    leaves, spec = signature.flatten((pred, other), {})
    assert signature.matches(leaves, spec)
    assert [type(v) for v in by_matcher] == [torch.Tensor, torch.Tensor, tuple, tuple, tuple, str]
    assert signature.inputs(by_matcher) == signature.inputs(leaves)


@pytest.mark.parametrize("use, taken, everything", [
    (lambda d: d["a"], {"a"}, False),
    (lambda d: d.get("b"), {"b"}, False),
    (lambda d: ("a" in d, len(d), list(d), list(d.keys())), set(), False),
    (lambda d: {**d}, {"a", "b"}, False),  # Python reads each key through d[k]
    (lambda d: dict(d), {"a", "b"}, False),
    (lambda d: d.items(), set(), True),
    (lambda d: d.values(), set(), True),
    (lambda d: copy.deepcopy(d), set(), True),
    (lambda d: repr(d), set(), True),
    (lambda d: d == {}, set(), True),
    (lambda d: d.update(c=1), set(), True),
    (lambda d: torch.utils._pytree.tree_leaves(d), set(), True),
])
def test_read_dict_records_what_was_taken(use, taken, everything):
    d = ReadDict({"a": 1, "b": "x"})
    use(d)
    assert d.taken == taken and d.all_taken is everything


def test_read_dict_results_are_plain_dicts():
    d = ReadDict({"a": 1})
    for result in (copy.deepcopy(d), copy.copy(d), d.copy(),
                   torch.utils._pytree.tree_map(lambda v: v, d)):
        assert type(result) is dict and result == {"a": 1}
