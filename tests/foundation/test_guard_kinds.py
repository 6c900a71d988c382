"""Guard kinds are objects: one per name, each with its comparison and its generated check; an
assumption names its kind and holds no state of its own."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import types

import pytest
from torch import nn

from fxpasses.guards import GUARD_KINDS, HOOKS, Assumption, GuardKind, LossRoots, whole_loss_assumptions
from fxpasses.ir.sources import LossRoot, Source


def test_a_kind_is_its_name_and_there_is_one_object_per_name():
    a = Assumption("identity", Source(LossRoot()).attr("flow"), object())
    assert isinstance(a.kind, GuardKind) and a.kind is GUARD_KINDS["identity"] and a.kind == "identity"
    assert pickle.loads(pickle.dumps(a.kind)) is a.kind and copy.deepcopy(a).kind is a.kind
    assert a.as_guard().evidence["kind"] == "identity" and type(a.as_guard().evidence["kind"]) is str
    with pytest.raises(KeyError, match="identiy"):
        Assumption("identiy", Source(LossRoot()), None)


def test_every_kind_names_a_registered_code_and_compares():
    loss = types.SimpleNamespace(k=3)
    roots = LossRoots(loss, ())
    for kind in GUARD_KINDS.values():
        assert kind.code and kind.description and type(kind).same is not GuardKind.same
    assert Assumption("constant", Source(LossRoot()).attr("k"), 3).holds(roots)
    assert not Assumption("constant", Source(LossRoot()).attr("k"), 3.0).holds(roots)
    assert Assumption("absent", Source(LossRoot()).attr("gone"), None).holds(roots)


def _hooks(modules):
    """The hooks assumption over ``modules``, and the roots of a call (read afresh each time)."""
    roots = lambda: LossRoots(modules[0], (), modules)  # noqa: E731
    (hooks,) = [a for a in whole_loss_assumptions(roots()) if a.kind is HOOKS]
    return hooks, roots


def test_an_assumption_keeps_no_state_after_it_held():
    hooks, roots = _hooks([nn.Linear(2, 2)])
    before = dataclasses.astuple(hooks)
    assert hooks.holds(roots()) and hooks.holds(roots())  # the second by the hook-handle counter
    assert dataclasses.astuple(hooks) == before
    assert not any(isinstance(getattr(hooks, f.name), (list, dict, set)) for f in dataclasses.fields(hooks))


def test_equal_hooks_assumptions_do_not_share_what_one_of_them_confirmed():
    """Two assumptions that compare equal (the recorded value is not compared) over different
    modules: one holding at the handle counter says nothing about the other."""
    mine, theirs = [nn.Linear(2, 2)], [nn.Linear(2, 2)]
    a, roots_a = _hooks(mine)
    b, roots_b = _hooks(theirs)
    assert a == b and a is not b
    theirs[0].register_forward_hook(lambda *args: None)  # the counter moves; b no longer holds
    assert a.holds(roots_a())  # confirmed at the new counter
    assert not b.holds(roots_b())
