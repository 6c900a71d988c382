"""The replays' batched host work does exactly what the one-by-one code would: copies
(``_copy_all``), clones of the input gradients (``_clone_all``), outputs rebuilt (``_rebuilder``);
and the copies' batches keep a pair that CUDA's one-kernel route cannot take (an expanded or
sliced value) apart from those it can (``copy_batches``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from fxpasses.runtime import capture
from fxpasses.runtime.capture import _clone_all, _copy_all, _rebuilder, copy_batches

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.float16]


def _source(kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(4, 6, generator=g) * 5).to(dtype)
    return {"dense": base, "transposed": base.t(), "expanded": base[:1].expand(4, 6),
            "sliced": base[:, ::2]}[kind]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES),
                          st.sampled_from(["dense", "transposed", "expanded", "sliced"])), max_size=8))
def test_batched_copies_equal_one_copy_per_pair(pairs):
    values = [_source(kind, src, seed) for seed, (_, src, kind) in enumerate(pairs)]
    targets = [torch.full(v.shape, 7).to(dst) for v, (dst, _, _) in zip(values, pairs)]
    expected = [t.clone().copy_(v) for t, v in zip(targets, values)]
    _copy_all(targets, values)
    for got, want in zip(targets, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES),
                          st.sampled_from(["dense", "transposed", "expanded", "sliced"])), max_size=8))
def test_a_pair_off_the_one_kernel_route_never_shares_a_batch_with_pairs_on_it(pairs):
    """The static buffers are ``empty_like`` the recorded value (dense, its strides where it is
    dense itself): a dense value, transposed or not, copies on CUDA's one-kernel route; an
    expanded or sliced one does not, and must not take its batch's other pairs off it."""
    values = [_source(kind, src, seed) for seed, (_, src, kind) in enumerate(pairs)]
    targets = [torch.empty_like(v, dtype=dst) for v, (dst, _, _) in zip(values, pairs)]
    batches = copy_batches(targets, values)
    assert sorted(i for batch in batches for i in batch) == list(range(len(pairs)))
    for batch in batches:
        kinds = {(targets[i].dtype, values[i].dtype, pairs[i][2] in ("dense", "transposed")) for i in batch}
        assert len(kinds) == 1, [pairs[i] for i in batch]
        on_route = next(iter(kinds))[2]
        assert all((values[i].stride() == targets[i].stride()) == on_route for i in batch)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach-clone", "by-hand"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(kinds=st.lists(st.tuples(st.sampled_from(_DTYPES), st.sampled_from(["dense", "transposed", "expanded",
                                                                          "sliced"])), max_size=6))
def test_batched_clones_equal_one_clone_each(foreach, kinds):
    values = [_source(kind, dtype, seed) for seed, (dtype, kind) in enumerate(kinds)]
    saved = capture._FOREACH_CLONE
    capture._FOREACH_CLONE = saved if foreach else None
    try:
        clones = _clone_all(values)
    finally:
        capture._FOREACH_CLONE = saved
    for got, value in zip(clones, values):
        want = value.clone()
        assert got.dtype == want.dtype and got.stride() == want.stride() and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()


_LEAF = st.sampled_from(["tensor", 3, 2.5, None, True])
_TREES = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(st.sampled_from("ab"), inner, max_size=2), max_leaves=12)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_TREES)
def test_outputs_are_rebuilt_as_pytree_rebuilds_them(tree):
    tree = pytree.tree_map(lambda leaf: torch.zeros(1) if leaf == "tensor" else leaf, tree)
    flat, spec = pytree.tree_flatten(tree)
    places = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
    rebuild = _rebuilder(spec, places)
    plain = all(s.type in (list, tuple) for s in _nodes(spec))
    assert (rebuild is not None) == plain  # a dict anywhere: pytree rebuilds it
    if rebuild is not None:
        fresh = [torch.ones(1) for _ in places]  # the replay's outputs, where the tensors were
        expected = pytree.tree_unflatten([fresh[places.index(i)] if i in places else leaf
                                          for i, leaf in enumerate(flat)], spec)
        got = rebuild(fresh, flat)
        assert pytree.tree_structure(got) == spec
        assert all(a is b for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)))


def _nodes(spec):
    if spec.is_leaf():
        return []
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return [spec, *(n for c in children for n in _nodes(c))]
