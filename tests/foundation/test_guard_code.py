"""The generated assumption check finds what the exact path finds: the same first failing
assumption, or none, whatever changed (values, types, missing attributes and keys)."""

from __future__ import annotations

import types

import torch
from hypothesis import given, settings, strategies as st

from fxpasses.guard_code import FAILED_READ, compile_check
from fxpasses.guards import Assumption, LossRoots, first_failure, snapshot, whole_loss_assumptions
from fxpasses.specialize import Specialization
from fxpasses.tracing.sources import Source

LOSS = Source(("loss",))
GLOBALS: dict = {}


def _state():
    GLOBALS.clear()
    GLOBALS.update(K=3, GAIN=2.0)
    inner = types.SimpleNamespace(topk=10, alpha=0.5, name="o2m")
    return types.SimpleNamespace(assign=inner, gains={"box": 7.5, "kpt": 12.0}, sigmas=torch.ones(17),
                                 flag=True, weight=0.8)


def _assumptions(state, arg):
    shown = ""
    made = [
        Assumption("identity", LOSS.attr("assign"), state.assign, "", shown),
        Assumption("constant", LOSS.attr("assign").attr("topk"), 10, "", shown),
        Assumption("float", LOSS.attr("assign").attr("alpha"), None, "", shown),
        Assumption("constant", LOSS.attr("assign").attr("name"), "o2m", "", shown),
        Assumption("contents", LOSS.attr("gains"), snapshot(state.gains), "", shown),
        Assumption("constant", LOSS.attr("gains").item("box"), 7.5, "", shown),
        Assumption("tensor", LOSS.attr("sigmas"), (torch.float32, "cpu", 1), "", shown),
        Assumption("constant", LOSS.attr("flag"), True, "", shown),
        Assumption("absent", LOSS.attr("assign").attr("residual"), None, "", shown),
        Assumption("float", LOSS.attr("weight"), None, "", shown),
        Assumption("constant", Source(("arg", 1)).attr("extra"), 3, "", shown),
        Assumption("identity", Source(("arg", 1)), arg, "", shown),
        Assumption("constant", Source(("global", GLOBALS, "K")), 3, "", shown),
        Assumption("float", Source(("global", GLOBALS, "GAIN")), None, "", shown),
    ]
    return tuple(made) + whole_loss_assumptions(LossRoots(state, ()))[-1:]  # + autocast


_VALUES = st.sampled_from([0, 1, 10, 10.0, True, False, "o2m", "x", None, 0.5, torch.ones(17),
                           torch.ones(17, dtype=torch.float64), torch.ones(2, 2), {"box": 7.5}])
_TARGETS = st.sampled_from([("assign", "topk"), ("assign", "alpha"), ("assign", "name"),
                            ("assign", "residual"), (None, "gains"), (None, "sigmas"),
                            (None, "flag"), (None, "weight"), (None, "assign"), ("gains", "box"),
                            ("gains", "kpt"), ("arg", "extra"), ("globals", "K"),
                            ("globals", "GAIN")])
_CHANGES = st.lists(st.tuples(_TARGETS, st.sampled_from(["set", "delete"]), _VALUES), max_size=3)


def _apply(state, arg, changes):
    for (owner, name), action, value in changes:
        target = {"assign": getattr(state, "assign", None), None: state,
                  "gains": getattr(state, "gains", None), "arg": arg, "globals": GLOBALS}[owner]
        if isinstance(target, dict):
            if action == "delete":
                target.pop(name, None)
            else:
                target[name] = value
        elif isinstance(target, types.SimpleNamespace):  # an owner replaced by a plain value: no-op
            if action == "set":
                setattr(target, name, value)
            elif hasattr(target, name):
                delattr(target, name)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_CHANGES)
def test_the_generated_check_finds_the_first_failure_of_the_exact_path(changes):
    state, arg = _state(), types.SimpleNamespace(extra=3)
    assumptions = _assumptions(state, arg)
    check = compile_check(assumptions)
    leaves = [torch.zeros(1), arg]
    assert check(state, leaves) == -1
    _apply(state, arg, changes)
    exact = first_failure(assumptions, LossRoots(state, leaves))
    special = Specialization(0, None, assumptions, check=check)
    assert special.failing(state, leaves) is exact
    index = check(state, leaves)
    assert index == FAILED_READ or (index == -1) == (exact is None)
    if index >= 0:
        assert assumptions[index] is exact


def test_a_read_that_raises_falls_back_to_the_exact_path():
    state, arg = _state(), types.SimpleNamespace(extra=3)
    assumptions = _assumptions(state, arg)
    check = compile_check(assumptions)
    del state.assign.topk
    leaves = [torch.zeros(1), arg]
    assert check(state, leaves) == FAILED_READ
    special = Specialization(0, None, assumptions, check=check)
    assert special.failing(state, leaves) is assumptions[1]  # MISSING is not 10
