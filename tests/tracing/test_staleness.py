"""No stale values, wherever the loss reaches its state and whatever changes in it.

A module with every kind of setting a loss reads (an int, a float, a flag, a string, a tensor
attribute, a buffer, a parameter, a list of floats, a dict of settings, a submodule) is reached
in each way a loss can reach one (an attribute, containers registered or plain, a global, a
closure, a default argument of the loss or of a function or method it calls, a partial, a
property, an argument). After the first optimized
call one setting changes, or the holder is rebound to another module; the next call must equal
the native loss, value and gradient. Each
hole this grid covers was a real silent wrong number once (Sequential children, containers in
globals, default arguments and partials were not tracked).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch
from torch import nn

from fxpasses import optimize


class Knobs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)
        self.k, self.w, self.flag, self.mode = 2, 0.5, True, "sum"
        self.t = torch.tensor([1.0, 2.0])
        self.register_buffer("buf", torch.ones(2))
        self.ws = [0.5, 1.5]
        self.cfg = {"a": 1.0, "n": 1}
        self.frac, self.thresh, self.idx = 0.5, 0.25, [0, 1]

    def forward(self, x):
        y = self.lin(x)[:, self.idx] * self.k + self.w
        if self.flag:
            y = y * self.t
        y = y + self.buf * self.ws[0] * self.cfg["a"]
        y = y[:, : self.cfg["n"] + 1]
        y = y[: int(self.frac * 4) + 1] if self.thresh < 1.0 else y * 2.0  # floats steering
        if self.training:
            y = y + 1.0
        return y.sum() if self.mode == "sum" else y.mean()


def _no_grad(fn):
    def run(m):
        with torch.no_grad():
            fn(m)
    return run


CHANGES = {
    "int": lambda m: setattr(m, "k", 3),
    "float": lambda m: setattr(m, "w", 1.25),
    "flag": lambda m: setattr(m, "flag", False),
    "string": lambda m: setattr(m, "mode", "mean"),
    "tensor-rebound": lambda m: setattr(m, "t", torch.tensor([3.0, -1.0])),
    "tensor-in-place": lambda m: m.t.mul_(2.0),
    "buffer-in-place": lambda m: m.buf.add_(1.0),
    "parameter-in-place": _no_grad(lambda m: m.lin.weight.mul_(2.0)),
    "list-entry": lambda m: m.ws.__setitem__(0, 2.5),
    "dict-float": lambda m: m.cfg.__setitem__("a", 3.0),
    "dict-int": lambda m: m.cfg.__setitem__("n", 0),
    "submodule-replaced": lambda m: setattr(m, "lin", nn.Linear(2, 2)),
    "float-steering-a-shape": lambda m: setattr(m, "frac", 1.0),
    "float-steering-a-branch": lambda m: setattr(m, "thresh", 2.0),
    "index-list-entry": lambda m: m.idx.__setitem__(1, 0),
    "parameter-rebound": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.ones(2, 2))),
    "buffer-rebound": lambda m: setattr(m, "buf", torch.full((2,), 3.0)),
    "buffer-dtype": lambda m: setattr(m, "buf", torch.ones(2, dtype=torch.float64)),
    "eval-mode": lambda m: m.eval(),
}


class Attribute(nn.Module):
    def __init__(self, knobs):
        super().__init__()
        self.knobs = knobs

    def forward(self, x):
        return self.knobs(x)


class InSequential(nn.Module):
    def __init__(self, knobs):
        super().__init__()
        self.seq = nn.Sequential(nn.Identity(), knobs)

    def forward(self, x):
        return self.seq(x)


class InModuleDict(nn.Module):
    def __init__(self, knobs):
        super().__init__()
        self.parts = nn.ModuleDict({"knobs": knobs})

    def forward(self, x):
        return sum(part(x) for part in self.parts.values())


@dataclasses.dataclass
class Parts:
    knobs: nn.Module


class PlainHolder:
    """A plain criterion holding the module in a plain list, a dict, a namespace, a dataclass,
    behind a property and two plain objects deep."""

    def __init__(self, knobs, how):
        self.how = how
        self.listed, self.mapped = [knobs], {"knobs": knobs}
        self.ns, self.parts = types.SimpleNamespace(knobs=knobs), Parts(knobs)
        self.outer = types.SimpleNamespace(inner=types.SimpleNamespace(knobs=knobs))
        self._knobs = knobs

    @property
    def knobs(self):
        return self._knobs

    def __call__(self, x):
        return {"list": lambda: self.listed[0], "dict": lambda: self.mapped["knobs"],
                "namespace": lambda: self.ns.knobs, "dataclass": lambda: self.parts.knobs,
                "property": lambda: self.knobs,
                "nested": lambda: self.outer.inner.knobs}[self.how]()(x)


class ClassHeld:
    """The module as a class attribute, read through the instance."""

    shared: nn.Module | None = None

    def __call__(self, x):
        return self.shared(x)


def _class_held(knobs):
    ClassHeld.shared = knobs
    return ClassHeld(), None


def _helper(x, knobs=None):
    return knobs(x)


def through_a_helper_default(x):
    return _helper(x)


class MethodDefault:
    """The module as the default argument of a method the loss calls."""

    def __call__(self, x):
        return self.apply(x)

    def apply(self, x, knobs=None):
        return knobs(x)


def _helper_default(knobs):
    _helper.__defaults__ = (knobs,)
    return through_a_helper_default, None


def _method_default(knobs):
    MethodDefault.apply.__defaults__ = (knobs,)
    return MethodDefault(), None


GLOBAL = {"knobs": None}


def through_a_global(x):
    return GLOBAL["knobs"](x)


def _closure(knobs):
    def loss(x):
        return knobs(x)
    return loss


def _with_default(knobs):
    def loss(x, knobs=knobs):
        return knobs(x)
    return loss


def _apply(x, knobs):
    return knobs(x)


class HelperHolder(nn.Module):
    """A module whose forward calls a function stored on it, made outside the trace."""

    def __init__(self, helper):
        super().__init__()
        self.helper = helper

    def forward(self, x):
        return self.helper(x)


def _closing_over(knobs):
    def helper(x):
        return knobs(x)
    return helper


def _defaulting_to(knobs):
    def helper(x, knobs=knobs):
        return knobs(x)
    return helper


global_helper = None  # a closure over the module, bound by the "global-helper-closure" holder


def through_a_global_helper(x):
    return global_helper(x)


def _as_global_helper(knobs):
    global global_helper
    global_helper = _closing_over(knobs)
    return through_a_global_helper, None


def _holders():
    """name -> (knobs -> (loss, call(loss, x)))"""
    plain = {f"plain-{how}": (lambda how: lambda k: (PlainHolder(k, how), None))(how)
             for how in ("list", "dict", "namespace", "dataclass", "property", "nested")}

    def as_global(k):
        GLOBAL["knobs"] = k
        return through_a_global, None

    def as_argument(k):
        box = [k]  # the call passes whatever the box holds
        return _apply, lambda loss, x: loss(x, box[0]), box

    return {"attribute": lambda k: (Attribute(k), None),
            "sequential": lambda k: (InSequential(k), None),
            "module-dict": lambda k: (InModuleDict(k), None),
            **plain,
            "class-attribute": _class_held,
            "global-dict": as_global,
            "closure": lambda k: (_closure(k), None),
            "default-argument": lambda k: (_with_default(k), None),
            "partial": lambda k: (functools.partial(_apply, knobs=k), None),
            "helper-default": _helper_default,
            "method-default": _method_default,
            "helper-closure": lambda k: (HelperHolder(_closing_over(k)), None),
            "helper-nested-default": lambda k: (HelperHolder(_defaulting_to(k)), None),
            "global-helper-closure": _as_global_helper,
            "argument": as_argument}


HOLDERS = _holders()

# how each holder's reference is rebound to another module
REBIND = {
    "attribute": lambda loss, new: setattr(loss, "knobs", new),
    "sequential": lambda loss, new: loss.seq.__setitem__(1, new),
    "module-dict": lambda loss, new: loss.parts.__setitem__("knobs", new),
    "plain-list": lambda loss, new: loss.listed.__setitem__(0, new),
    "plain-dict": lambda loss, new: loss.mapped.__setitem__("knobs", new),
    "plain-namespace": lambda loss, new: setattr(loss.ns, "knobs", new),
    "plain-dataclass": lambda loss, new: setattr(loss.parts, "knobs", new),
    "plain-property": lambda loss, new: setattr(loss, "_knobs", new),
    "plain-nested": lambda loss, new: setattr(loss.outer.inner, "knobs", new),
    "class-attribute": lambda loss, new: setattr(ClassHeld, "shared", new),
    "global-dict": lambda loss, new: GLOBAL.__setitem__("knobs", new),
    "closure": lambda loss, new: setattr(loss.__closure__[0], "cell_contents", new),
    "default-argument": lambda loss, new: setattr(loss, "__defaults__", (new,)),
    "partial": lambda loss, new: loss.keywords.__setitem__("knobs", new),
    "helper-default": lambda loss, new: setattr(_helper, "__defaults__", (new,)),
    "method-default": lambda loss, new: setattr(MethodDefault.apply, "__defaults__", (new,)),
    "helper-closure": lambda loss, new: setattr(loss.helper.__closure__[0], "cell_contents", new),
    "helper-nested-default": lambda loss, new: setattr(loss.helper, "__defaults__", (new,)),
    "global-helper-closure": lambda loss, new: setattr(global_helper.__closure__[0], "cell_contents", new),
    "argument": None,  # the box, below
}


def _value_and_grad(fn, x):
    x = x.clone().requires_grad_()
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x)
    return out.detach(), grad


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("holder", list(HOLDERS))
def test_a_changed_setting_is_never_stale(holder, change):
    knobs = Knobs()
    loss, call, *_ = HOLDERS[holder](knobs)
    call = call or (lambda fn, x: fn(x))
    fast = optimize(loss)
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        got, want = _value_and_grad(lambda x: call(fast, x), x), _value_and_grad(lambda x: call(loss, x), x)
        assert all(torch.allclose(g, w) for g, w in zip(got, want))
    CHANGES[change](knobs)
    got, want = _value_and_grad(lambda x: call(fast, x), x), _value_and_grad(lambda x: call(loss, x), x)
    assert all(torch.allclose(g, w) for g, w in zip(got, want)), (holder, change)
    assert fast.stats.optimized >= 2  # the grid tests optimized calls, not native ones


@pytest.mark.parametrize("holder", list(HOLDERS))
def test_a_rebound_module_is_never_stale(holder):
    knobs = Knobs()
    loss, call, *box = HOLDERS[holder](knobs)
    call = call or (lambda fn, x: fn(x))
    fast = optimize(loss)
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    call(fast, x)
    other = Knobs()
    with torch.no_grad():
        other.lin.weight.mul_(-3.0)
    other.k = 7
    if box:
        box[0][0] = other
    else:
        REBIND[holder](loss, other)
    got, want = _value_and_grad(lambda x: call(fast, x), x), _value_and_grad(lambda x: call(loss, x), x)
    assert all(torch.allclose(g, w) for g, w in zip(got, want)), holder


def _doubled(x):
    return x * 2.0


def _tripled(x):
    return x * 3.0


def through_a_global_function(x):
    return _scaled(x).sum()


_scaled = _doubled


def test_a_rebound_global_function_is_never_stale():
    """The traced code names a global function; rebinding the name changes the code run."""
    global _scaled
    fast = optimize(through_a_global_function)
    x = torch.ones(3)
    assert fast(x).item() == 6.0
    _scaled = _tripled
    try:
        assert fast(x).item() == 9.0 and len(fast.specializations) == 2
    finally:
        _scaled = _doubled


class HelperInADict(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.helpers = {"apply": helper}

    def forward(self, x):
        return self.helpers["apply"](x).sum()


def test_the_closure_of_a_helper_held_in_a_dict_is_never_stale():
    knobs = Knobs()
    loss = HelperInADict(_closing_over(knobs))
    fast = optimize(loss)
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    fast(x)
    knobs.k = 5  # read through the helper's closure
    assert torch.allclose(fast(x), loss(x)) and len(fast.specializations) == 2


_reduce = torch.sum


def through_a_global_builtin(x):
    return _reduce(x * 2.0)


def test_a_rebound_global_builtin_is_never_stale():
    global _reduce
    fast = optimize(through_a_global_builtin)
    x = torch.ones(4)
    assert fast(x).item() == 8.0
    _reduce = torch.mean
    try:
        assert fast(x).item() == 2.0 and len(fast.specializations) == 2
    finally:
        _reduce = torch.sum


class _Scaler:
    """A plain callable object (not a module)."""

    def __init__(self):
        self.k = 2

    def __call__(self, x):
        return x * self.k


_scaler = _Scaler()


def through_a_global_callable(x):
    return _scaler(x).sum()


def _times(x, k):
    return x * k


_partial_scale = functools.partial(_times, k=2)


def through_a_global_partial(x):
    return _partial_scale(x).sum()


def test_a_global_callable_object_and_partial_are_never_stale():
    global _partial_scale
    x = torch.ones(3)
    fast = optimize(through_a_global_callable)
    assert fast(x).item() == 6.0
    _scaler.k = 3  # read inside its __call__
    try:
        assert fast(x).item() == 9.0
    finally:
        _scaler.k = 2
    fast = optimize(through_a_global_partial)
    assert fast(x).item() == 6.0
    _partial_scale = functools.partial(_times, k=5)  # rebound
    try:
        assert fast(x).item() == 15.0
        _partial_scale.keywords["k"] = 7  # its bound keyword changed in place
        assert fast(x).item() == 21.0
    finally:
        _partial_scale = functools.partial(_times, k=2)


class WeightedTerm:
    """A plain object (no module) that defines ``__call__`` and holds settings, a tensor and a
    module, as Ultralytics' per-branch pose losses are held by their criterion."""

    def __init__(self):
        torch.manual_seed(0)
        self.weight = torch.tensor([1.0, 2.0])
        self.cfg = types.SimpleNamespace(gain=2.0, power=2)
        self.flow = nn.Linear(2, 2)
        self.scale = 0.75

    def __call__(self, x):
        return (self.flow(x) * self.weight).pow(self.cfg.power).sum() * self.cfg.gain * self.scale


class PlainCriterion:
    """A plain criterion holding the callable term (``E2ELoss`` holding ``PoseLoss26``)."""

    def __init__(self):
        self.term = WeightedTerm()
        self.mix = 0.5

    def __call__(self, x):
        return self.term(x) * self.mix


class ModuleCriterion(nn.Module):
    """A module holding the callable term as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.term = WeightedTerm()

    def forward(self, x):
        return self.term(x)


def _other_flow(term):
    flow = nn.Linear(2, 2)
    with torch.no_grad():
        flow.weight.fill_(0.5)
    term.flow = flow


CALLABLE_CHANGES = {
    "namespace-float": lambda t: setattr(t.cfg, "gain", t.cfg.gain * 2),
    "namespace-int": lambda t: setattr(t.cfg, "power", 3),
    "float": lambda t: setattr(t, "scale", 1.5),
    "tensor-rebound": lambda t: setattr(t, "weight", torch.tensor([-1.0, 0.5])),
    "tensor-in-place": lambda t: t.weight.mul_(3.0),
    "module-rebound": _other_flow,
    "module-parameter": _no_grad(lambda t: t.flow.weight.mul_(-2.0)),
    "term-rebound": None,  # below: the holder's term is another object with other settings
}


@pytest.mark.parametrize("change", list(CALLABLE_CHANGES))
@pytest.mark.parametrize("holder", [PlainCriterion, ModuleCriterion])
def test_a_callable_object_is_followed_not_taken_for_a_function(holder, change):
    """The reads through an object that defines ``__call__`` are assumptions like any other
    object's (its floats inputs, its tensors read live, its module tracked at its source)."""
    loss = holder()
    fast = optimize(loss)
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        got, want = _value_and_grad(fast, x), _value_and_grad(loss, x)
        assert all(torch.allclose(g, w) for g, w in zip(got, want))
    (spec,) = fast.specializations
    sources = {str(a.source) for a in spec.assumptions}
    assert {"loss.term.cfg", "loss.term.weight", "loss.term.flow", "loss.term.scale"} <= sources
    if change == "term-rebound":
        other = WeightedTerm()
        other.cfg.gain, other.weight = 5.0, torch.tensor([3.0, 1.0])
        loss.term = other
    else:
        CALLABLE_CHANGES[change](loss.term)
    got, want = _value_and_grad(fast, x), _value_and_grad(loss, x)
    assert all(torch.allclose(g, w) for g, w in zip(got, want)), (holder, change)
    assert fast.stats.optimized == 3  # optimized calls, not native ones


class _Scales:
    def double(self, v):
        return v * 2.0

    def triple(self, v):
        return v * 3.0


def _code_pairs():
    scales = _Scales()
    pairs = {"lambda": (lambda v: v * 2.0, lambda v: v * 3.0),
             "partial": (functools.partial(torch.mul, other=2.0), functools.partial(torch.mul, other=3.0)),
             "bound-method": (scales.double, scales.triple),
             "builtin": (torch.exp, torch.neg)}
    try:
        import numpy as np
        pairs["extension-callable"] = (np.square, np.negative)  # ufuncs: a C class, no reads to follow
    except ImportError:
        pass
    return pairs


CODE = _code_pairs()


class HoldsCode(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x * 2.0).sum()


class HoldsNumberCode(HoldsCode):
    def forward(self, x):
        return x.sum() * float(self.fn(2.0))


@pytest.mark.parametrize("kind", list(CODE))
def test_code_stored_on_an_object_is_still_an_identity_and_traced(kind):
    """Functions, partials, bound methods, builtins and an extension's callables stay code: the
    trace runs them, their identity is guarded, rebinding one traces again."""
    first, second = CODE[kind]
    loss = (HoldsNumberCode if kind == "extension-callable" else HoldsCode)(first)
    fast = optimize(loss)
    x = torch.arange(1.0, 4.0)
    torch.testing.assert_close(fast(x), loss(x))
    (spec,) = fast.specializations
    assert ("identity", "loss.fn") in {(a.kind, str(a.source)) for a in spec.assumptions}
    loss.fn = second
    torch.testing.assert_close(fast(x), loss(x))
    assert fast.stats.optimized == 2 and len(fast.specializations) == 2


class SettingsLoss(nn.Module):
    """Reads one float of a namespace of many, as Ultralytics' losses read ``self.hyp.box``."""

    def __init__(self):
        super().__init__()
        self.hyp = types.SimpleNamespace(box=7.5, cls=0.5, hsv_h=0.015, degrees=0.0, name="pose")

    def forward(self, x):
        return (x * self.hyp.box).sum()


def test_only_the_settings_the_loss_uses_are_read_on_every_call():
    from fxpasses.ir.trace_ops import ReadSource
    loss, x = SettingsLoss(), torch.arange(3.0)
    fast = optimize(loss)
    assert fast(x).item() == loss(x).item() == 22.5
    graph = fast.specializations[0].graph_module.graph
    reads = [n.target.shown for n in graph.nodes if isinstance(n.target, ReadSource)]
    assert reads == ["loss.hyp.box"], reads
    loss.hyp.hsv_h, loss.hyp.cls = 0.5, 2.0  # unused: nothing to see
    assert fast(x).item() == 22.5
    loss.hyp.box = 2.0  # used: read on this call
    assert fast(x).item() == loss(x).item() == 6.0
    assert fast.stats.optimized == 3
