"""The generated assumption check finds what the exact path finds: the same first failing
assumption, or none, whatever changed (values, types, missing attributes and keys)."""

from __future__ import annotations

import collections

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fxpasses.guard_code import READ_FAILED, compile_check
from fxpasses.guards import Assumption, LossRoots, first_failure, whole_loss_assumptions
from fxpasses.snapshots import snapshot
from fxpasses.specialize import Specialization
from fxpasses.ir.sources import ArgRoot, GlobalRoot, LossRoot, Source

LOSS = Source(LossRoot())
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
        Assumption("constant", Source(ArgRoot(1)).attr("extra"), 3, "", shown),
        Assumption("identity", Source(ArgRoot(1)), arg, "", shown),
        Assumption("constant", Source(GlobalRoot(GLOBALS, "K")), 3, "", shown),
        Assumption("float", Source(GlobalRoot(GLOBALS, "GAIN")), None, "", shown),
    ]
    return tuple(made) + whole_loss_assumptions(LossRoots(state, ()))[-2:]  # + autocast, default dtype


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
    assert check(state, leaves) is None
    _apply(state, arg, changes)
    exact = first_failure(assumptions, LossRoots(state, leaves))
    special = Specialization(0, None, assumptions, check=check)
    assert special.failing(state, leaves) is exact
    index = check(state, leaves)
    assert index is READ_FAILED or (index is None) == (exact is None)
    if isinstance(index, int):
        assert assumptions[index] is exact


def test_a_read_that_raises_falls_back_to_the_exact_path():
    state, arg = _state(), types.SimpleNamespace(extra=3)
    assumptions = _assumptions(state, arg)
    check = compile_check(assumptions)
    del state.assign.topk
    leaves = [torch.zeros(1), arg]
    assert check(state, leaves) is READ_FAILED
    special = Specialization(0, None, assumptions, check=check)
    exact = collections.Counter()
    assert special.failing(state, leaves, exact) is assumptions[1]  # MISSING is not 10
    assert exact == {"assumptions": 1}


# -- the whole-loss check ------------------------------------------------------------------------

def _loss_tree():
    """A loss module (its own classes, made afresh: the test changes them) holding a flow-like
    submodule tree, as a trace would guard it."""
    from torch import nn

    class Coupling(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 4), nn.LeakyReLU(), nn.Linear(4, 2))

        def forward(self, x):
            return self.net(x)

    class Loss(nn.Module):
        scale = 2

        def __init__(self):
            super().__init__()
            self.couplings = nn.ModuleList([Coupling(), Coupling()])

        def forward(self, x):
            return sum(c(x) for c in self.couplings).sum()

    loss = Loss()
    return loss, list(loss.modules())


_WHOLE_CHANGES = st.lists(st.tuples(
    st.sampled_from(["eval", "train", "replace-child", "reorder-children", "add-child", "shadow-forward",
                     "shadow-extra-repr",
                     "plain-attribute", "hook", "compile", "class-method", "class-constant",
                     "class-method-replaced", "instance-hook-dict"]),
    st.integers(0, 20)), max_size=3)


def _apply_whole(loss, modules, changes):
    from torch import nn
    for action, k in changes:
        m = modules[k % len(modules)]
        if action == "eval":
            m.eval()
        elif action == "train":
            m.train()
        elif action == "replace-child" and m._modules:
            name = list(m._modules)[k % len(m._modules)]
            m._modules[name] = nn.Identity()
        elif action == "reorder-children" and len(m._modules) > 1:
            name = list(m._modules)[0]
            m._modules[name] = m._modules.pop(name)
        elif action == "add-child":  # to a leaf too (checked without reading a tuple of its children)
            m.add_module(f"extra{k}", nn.Identity())
        elif action == "shadow-forward":
            m.forward = lambda *a: 0
        elif action == "shadow-extra-repr":
            m.extra_repr = lambda: ""
        elif action == "plain-attribute":
            m.note = k
        elif action == "hook":
            m.register_forward_hook(lambda *a: None)
        elif action == "compile":
            m.__dict__["_compiled_call_impl"] = lambda *a: 0  # what Module.compile() sets
        elif action == "class-method":
            type(loss).extra = lambda self: 0
        elif action == "class-constant":
            type(loss).scale = k
        elif action == "class-method-replaced":
            type(loss).forward = lambda self, x: x
        elif action == "instance-hook-dict":
            m._forward_pre_hooks[10_000 + k] = lambda *a: None  # no handle made: no counter moved


# the state when the guards are recorded: a module whose forward is shadowed on the instance,
# or that Module.compile() has wrapped, is recorded as such (the changes then replace it again)
_WHOLE_SETUP = st.tuples(st.sampled_from(["plain", "shadow-forward", "compile"]), st.integers(0, 20))


@pytest.fixture(params=["version tags", "no version tags"])
def dict_versions(request, monkeypatch):
    """Both ways of the generated checks: with the interpreter's dict version tags and without
    (an interpreter that no longer keeps them)."""
    import fxpasses.guard_code as guard_code
    if request.param == "version tags" and guard_code.DICT_VERSION is None:
        pytest.skip("this interpreter keeps no dict version tags")
    if request.param == "no version tags":
        monkeypatch.setattr(guard_code, "DICT_VERSION", None)
    return request.param


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_WHOLE_SETUP, _WHOLE_CHANGES)
def test_the_generated_whole_loss_check_never_passes_what_the_exact_path_fails(dict_versions, setup,
                                                                               changes):
    """Checked after every change: a check that held moves its records on (version tags), and
    a change after that must still be found."""
    from fxpasses.guard_code import compile_whole_check
    from fxpasses.guards import user_classes
    loss, modules = _loss_tree()
    if setup[0] != "plain":
        _apply_whole(loss, modules, [setup])
    classes = user_classes([loss, *modules])
    roots = lambda: LossRoots(loss, (), modules, classes)
    whole = tuple(a for a in whole_loss_assumptions(roots()) if a.kind in ("hooks", "methods",
                                                                            "modules", "modes"))
    check = compile_whole_check(whole, loss, modules, classes)
    assert check() and first_failure(whole, roots()) is None
    exact = None
    for change in changes:
        _apply_whole(loss, modules, [change])
        exact = first_failure(whole, roots())
        if check():
            assert exact is None
    guarded = {"eval", "replace-child", "reorder-children", "add-child", "shadow-forward", "shadow-extra-repr", "hook", "compile",
               "class-method", "class-method-replaced"}
    stricter = {"class-constant"}  # a class value rebound: the generated check defers to the exact path
    if exact is None and not (guarded | stricter) & {a for a, _ in changes}:
        assert check()


def test_autocast_is_checked_inline_and_a_change_is_found():
    state, arg = _state(), types.SimpleNamespace(extra=3)
    assumptions = _assumptions(state, arg)
    check, leaves = compile_check(assumptions), [torch.zeros(1), arg]
    assert "autocast_state() ==" in check.source and "holds(" not in check.source
    assert check(state, leaves) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert check(state, leaves) == len(assumptions) - 2
        assert first_failure(assumptions, LossRoots(state, leaves)) is assumptions[-2]


def test_the_default_dtype_is_checked_inline_and_a_change_is_found():
    state, arg = _state(), types.SimpleNamespace(extra=3)
    assumptions = _assumptions(state, arg)
    check, leaves = compile_check(assumptions), [torch.zeros(1), arg]
    assert "get_default_dtype() is not" in check.source and "holds(" not in check.source
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if previous is torch.float32 else torch.float32)
    try:
        assert check(state, leaves) == len(assumptions) - 1
        assert first_failure(assumptions, LossRoots(state, leaves)) is assumptions[-1]
    finally:
        torch.set_default_dtype(previous)
    assert check(state, leaves) is None


class _Settings(types.SimpleNamespace):
    """A namespace of settings of its own class, as Ultralytics' ``IterableSimpleNamespace`` (hyp)."""


_PLAIN_VALUES = st.sampled_from([0, 1, 1.0, True, False, 0.5, float("nan"), "a", None, torch.float32])
_FLAT = st.one_of(
    st.dictionaries(st.sampled_from("abc"), _PLAIN_VALUES, max_size=3),
    st.lists(_PLAIN_VALUES, max_size=3), st.lists(_PLAIN_VALUES, max_size=3).map(tuple),
    st.dictionaries(st.sampled_from("abc"), _PLAIN_VALUES, max_size=3).map(
        lambda d: types.SimpleNamespace(**d)),
    st.dictionaries(st.sampled_from("abc"), _PLAIN_VALUES, max_size=3).map(lambda d: _Settings(**d)))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_FLAT, _FLAT | _PLAIN_VALUES | st.just(object()))
def test_flat_containers_are_compared_as_their_snapshots_are(recorded, now):
    from fxpasses.snapshots import flat_form, same_flat
    snap = snapshot(recorded)
    form = flat_form(snap)
    assert form is not None and same_flat(recorded, *form)
    if same_flat(now, *form):
        assert snapshot(now) == snap
    nested = snapshot({"inner": [1, 2]})
    assert flat_form(nested) is None and flat_form(snapshot(object())) is None


def test_a_namespace_of_its_own_class_is_compared_flat():
    """Ultralytics' hyp is a SimpleNamespace subclass of ~80 settings: compared flat, it is one
    pass over its dict; as a new snapshot, the guard cost most of a call's checks."""
    from fxpasses.snapshots import flat_form, same_flat
    form = flat_form(snapshot(_Settings(box=7.5, name="pose", epochs=3)))
    assert same_flat(_Settings(box=7.0, name="pose", epochs=3), *form)  # floats: read per call
    assert same_flat(types.SimpleNamespace(box=7.5, name="pose", epochs=3), *form)  # as snapshots
    assert not same_flat(_Settings(box=7.5, name="pose", epochs=4), *form)
    assert not same_flat({"box": 7.5, "name": "pose", "epochs": 3}, *form)


def test_flat_comparison_tells_types_order_and_containers_apart():
    from collections import OrderedDict

    from fxpasses.snapshots import flat_form, same_flat
    nan = float("nan")
    for recorded, now in (({"a": 1}, {"a": True}), ([1.0], [1]), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
                          ((1, 2), [1, 2]), ({"a": 1}, OrderedDict(a=1)), ([nan], [float("nan")]),
                          (types.SimpleNamespace(a=1), {"a": 1})):
        form = flat_form(snapshot(recorded))
        assert not same_flat(now, *form), (recorded, now)
        exact = snapshot(now) == snapshot(recorded)
        assert not exact or isinstance(now, OrderedDict)  # an OrderedDict: equal to the exact path
    assert same_flat([nan], *flat_form(snapshot([nan])))  # the same NaN object: equal, as snapshots


def test_a_plain_loss_object_rebinding_a_value_holds_and_a_new_method_does_not(dict_versions):
    from fxpasses.guard_code import compile_whole_check
    from fxpasses.guards import user_classes

    class PlainLoss:
        def __init__(self):
            self.o2m, self.helper = 0.8, len

        def __call__(self, x):
            return x * self.o2m

    loss = PlainLoss()
    classes = user_classes([loss])
    whole = tuple(a for a in whole_loss_assumptions(LossRoots(loss, (), (), classes))
                  if a.kind == "methods")
    check = compile_whole_check(whole, loss, (), classes)
    exact = lambda: first_failure(whole, LossRoots(loss, (), (), classes)) is None
    assert check() and exact()
    for _ in range(3):  # an epoch's new weight: holds (the exact read once, then fast again)
        loss.o2m *= 0.5
        assert check() and exact()
    loss.note = "a new plain value"
    assert check() and exact()
    loss.helper = abs  # a stored callable rebound
    assert not check() and not exact()
    loss.helper = len
    assert check() and exact()
    loss.__call__ = lambda x: x  # a method shadowed on the instance
    assert not check() and not exact()
    del loss.__call__
    assert check() and exact()
    type(loss).__call__ = lambda self, x: x  # the class's method replaced
    assert not check() and not exact()


_ABSENT_CHANGES = st.lists(st.sampled_from(
    ["instance", "parameter", "buffer", "submodule", "class-attribute", "base-class-attribute",
     "class-getattr", "property", "delete"]), max_size=3)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_ABSENT_CHANGES, st.booleans())
def test_certainly_absent_only_when_getattr_raises(changes, module):
    from torch import nn

    from fxpasses.guards import certainly_absent

    class Base(nn.Module if module else object):
        pass

    class Owner(Base):
        pass

    owner = Owner()
    assert certainly_absent(owner, "residual") and not hasattr(owner, "residual")
    for change in changes:
        try:
            if change == "instance":
                owner.__dict__["residual"] = True
            elif change == "parameter" and module:
                owner.residual = nn.Parameter(torch.zeros(1))
            elif change == "buffer" and module:
                owner.register_buffer("residual", torch.zeros(1))
            elif change == "submodule" and module:
                owner.residual = nn.Identity()
            elif change == "class-attribute":
                Owner.residual = True
            elif change == "base-class-attribute":
                Base.residual = True
            elif change == "class-getattr":
                Owner.__getattr__ = lambda self, name: 1
            elif change == "property":
                Owner.residual = property(lambda self: 2)
            elif change == "delete":
                for holder in (owner.__dict__, *(owner.__dict__.get(k, {}) for k in
                                                 ("_parameters", "_buffers", "_modules"))):
                    holder.pop("residual", None)
                for cls in (Owner, Base):
                    if "residual" in vars(cls):
                        delattr(cls, "residual")
        except (KeyError, AttributeError, TypeError):  # refused by the module: nothing changed
            pass
    if certainly_absent(owner, "residual"):
        assert not hasattr(owner, "residual")
    if not changes:
        assert certainly_absent(owner, "residual")


@pytest.mark.parametrize("recorded, change", [("compile", "compile"), ("shadow-forward", "shadow-extra-repr")])
def test_a_module_compiled_or_shadowed_when_recorded_and_changed_again_is_found(recorded, change):
    """The record's branches for a module that compile() wrapped, or whose method an instance
    attribute shadowed, when the guards were recorded (the property test may not reach them)."""
    from fxpasses.guard_code import compile_whole_check
    from fxpasses.guards import user_classes
    loss, modules = _loss_tree()
    _apply_whole(loss, modules, [(recorded, 3)])
    classes = user_classes([loss, *modules])
    roots = LossRoots(loss, (), modules, classes)
    whole = tuple(a for a in whole_loss_assumptions(roots) if a.kind in ("methods", "modes"))
    check = compile_whole_check(whole, loss, modules, classes)
    assert check() and first_failure(whole, roots) is None
    _apply_whole(loss, modules, [(change, 3)])
    assert first_failure(whole, LossRoots(loss, (), modules, classes)) is not None
    assert not check()


def test_each_part_of_the_whole_loss_check_checks_only_its_part():
    from fxpasses.guard_code import WHOLE_CHECK_PARTS, compile_whole_check
    from fxpasses.guards import user_classes
    loss, modules = _loss_tree()
    classes = user_classes([loss, *modules])
    whole = tuple(a for a in whole_loss_assumptions(LossRoots(loss, (), modules, classes))
                  if a.kind in ("hooks", "methods", "modules", "modes"))
    checks = {part: compile_whole_check(whole, loss, modules, classes, parts=(part,))
              for part in WHOLE_CHECK_PARTS}
    assert all(check() for check in checks.values())
    modules[-1].eval()
    assert not checks["modules"]() and checks["classes"]() and checks["hooks"]()
    assert not compile_whole_check(whole, loss, modules, classes)()
