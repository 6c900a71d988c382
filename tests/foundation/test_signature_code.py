"""The generated call matcher agrees with pytree: a call matches a signature, with the same
leaves, exactly when ``tree_flatten`` and :meth:`CallSignature.matches` say it does."""

from __future__ import annotations

import collections

import torch
from hypothesis import given, settings, strategies as st
from torch.utils import _pytree as pytree

from fxpasses.signature import CallSignature, flatten_call
from fxpasses.signature_code import UNDECIDED

Pair = collections.namedtuple("Pair", "a b")


class Row(tuple):
    """A tuple subclass pytree does not know: a leaf."""


class Bag:
    """A type registered with pytree whose context depends on the value (its names)."""

    def __init__(self, **items):
        self.items = items

    def __repr__(self):
        return f"Bag({self.items})"


pytree.register_pytree_node(
    Bag, lambda bag: (list(bag.items.values()), tuple(bag.items)),
    lambda values, names: Bag(**dict(zip(names, values))))


_leaves = st.sampled_from([
    torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, dtype=torch.float64), torch.zeros(()),
    torch.zeros(2, dtype=torch.long), torch.zeros(2, device="meta"), torch.nn.Parameter(torch.zeros(2)),
    0.5, 1.5, 3, 4, True, None, "mean", "sum", torch.float32, Row((1, 2)), Pair(1, 2)])
_trees = st.recursive(_leaves, lambda inner: (
    st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2).map(lambda d: Bag(**d))),
    max_leaves=8)
_calls = st.tuples(st.lists(_trees, max_size=3).map(tuple),
                   st.dictionaries(st.sampled_from(["x", "y"]), _trees, max_size=2))


def _expected(signature, args, kwargs):
    leaves, spec = flatten_call(args, kwargs)
    return leaves if signature.matches(leaves, spec) else None


def _same(a, b):
    return a is None and b is None or (a is not None and b is not None and len(a) == len(b)
                                       and all(x is y for x, y in zip(a, b)))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_calls, _calls)
def test_the_matcher_agrees_with_pytree(first, second):
    signature = CallSignature.of_call(*first)
    for args, kwargs in (first, second):
        flat_calls = []

        def flat(args=args, kwargs=kwargs):
            flat_calls.append(1)
            return flatten_call(args, kwargs)

        assert _same(signature.leaves_of(args, kwargs, flat), _expected(signature, args, kwargs))
        matcher = signature._matcher
        if matcher is not None and matcher(args, kwargs) is not UNDECIDED:
            assert not flat_calls  # decided without pytree


def test_a_tuple_subclass_at_a_leaf_is_left_to_pytree():
    signature = CallSignature.of_call((torch.zeros(2), Row((1, 2))), {})
    assert signature._matcher((torch.zeros(2), Row((1, 2))), {}) is UNDECIDED
    leaves = signature.leaves_of((torch.zeros(2), Row((1, 2))), {},
                                 lambda: flatten_call((torch.zeros(2), Row((1, 2))), {}))
    assert leaves is not None and leaves[1] == Row((1, 2))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_calls, st.data())
def test_the_matcher_agrees_with_pytree_on_a_call_with_one_leaf_changed(first, data):
    signature = CallSignature.of_call(*first)
    leaves, spec = flatten_call(*first)
    if leaves:
        index = data.draw(st.integers(0, len(leaves) - 1))
        leaves[index] = data.draw(_leaves | _trees)
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    expected = _expected(signature, args, kwargs)
    assert _same(signature.leaves_of(args, kwargs, lambda: flatten_call(args, kwargs)), expected)
    assert expected is not None or leaves  # an unchanged call always matches


def test_dict_keys_must_come_in_the_same_order_as_pytree_requires():
    x = torch.zeros(2)
    signature = CallSignature.of_call(({"a": x, "b": 1.0},), {})
    for call in (({"b": 1.0, "a": x},), ({"a": x, "c": 1.0},), ({"a": x},)):
        assert signature.leaves_of(call, {}, lambda call=call: flatten_call(call, {})) is None
        assert _expected(signature, call, {}) is None
    assert signature.leaves_of(({"a": x, "b": 2.0},), {}, None) == [x, 2.0]


def test_a_type_registered_with_pytree_is_matched_by_its_flatten_function():
    call = ((Bag(a=torch.zeros(2), b=1.5),), {})
    signature = CallSignature.of_call(*call)
    assert signature._matcher is not None
    assert _same(signature._matcher(*call), [call[0][0].items["a"], 1.5])
    for other in (Bag(a=torch.zeros(2), c=1.5), Bag(b=1.5, a=torch.zeros(2)), Bag(a=torch.zeros(2)),
                  {"a": torch.zeros(2), "b": 1.5}):
        assert signature._matcher((other,), {}) is None  # other names, order or type
