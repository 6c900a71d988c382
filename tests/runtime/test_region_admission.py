"""A region's admission reads module state through slots and flattens only containers: the same
tensors, in the same order, as walking the modules and flattening every argument."""

from __future__ import annotations

import itertools
from collections import namedtuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxpasses.runtime.capture import StateSlots, flatten_arguments, read_state


def _walked(modules):
    seen = {}
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _tree():
    shared = nn.Linear(3, 3)
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), shared, nn.Sequential(shared))
    net.register_buffer("scale", torch.ones(3))
    return net, shared


def test_slots_read_what_walking_the_modules_reads_in_its_order():
    net, shared = _tree()
    other = nn.Linear(3, 1)
    slots = StateSlots.of([net, other, shared])
    assert [id(t) for t in read_state(slots)] == [id(t) for t in _walked([net, other, shared])]


def test_a_rebound_parameter_is_read_fresh():
    net, _ = _tree()
    slots = StateSlots.of([net])
    new = nn.Parameter(torch.zeros(3, 2))
    net[0].weight = new
    assert slots.holds_for([net])  # same structure: the slots stay, and read the new tensor
    assert any(t is new for t in read_state(slots))
    assert [id(t) for t in read_state(slots)] == [id(t) for t in _walked([net])]


def test_a_tensor_or_child_added_or_removed_makes_the_slots_stale():
    for change in (lambda n: n[0].register_parameter("extra", nn.Parameter(torch.ones(1))),
                   lambda n: n[1].register_buffer("extra", torch.ones(1)),
                   lambda n: n.append(nn.Linear(3, 3)),
                   lambda n: delattr(n[0], "bias")):
        net, _ = _tree()
        slots = StateSlots.of([net])
        change(net)
        assert not slots.holds_for([net])
    net, _ = _tree()
    assert not StateSlots.of([net]).holds_for([_tree()[0]])  # another module, same shape


Pair = namedtuple("Pair", "a b")


def test_arguments_flatten_as_pytree_flattens_them():
    t = torch.ones(2)
    args = [t, 3, 1.5, None, "s", torch.float32, nn.Linear(1, 1), (t, [t, 2]), {"k": t},
            Pair(t, 4), torch.Size([2, 3]), nn.Parameter(torch.ones(1))]
    leaves, specs, starts = flatten_arguments(args)
    expected = [pytree.tree_flatten(a) for a in args]
    assert leaves == [leaf for arg_leaves, _ in expected for leaf in arg_leaves]
    for spec, (arg_leaves, want) in zip(specs, expected):
        assert (spec is None) == want.is_leaf()
        if spec is not None:
            assert repr(spec) == repr(want)
    assert starts == [0, *itertools.accumulate(len(x) for x, _ in expected)]
