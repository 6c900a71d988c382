"""Guards: every assumption a trace or a rewrite makes, from one table, checked before each call.

An :class:`Assumption` is one thing that must still hold for an optimized graph to compute what
the loss computes: a value the trace read (``loss.assign_o2m.topk`` is 10, ``loss.flow`` is that
module, ``loss.hyp`` holds the same gains, ``loss.o2m`` is a float), or a fact about the whole
loss (no hook registered since, no method replaced, no submodule swapped, train/eval modes, grad
mode, autocast). Its *kind* is one object of :data:`GUARD_KINDS` (a :class:`GuardKind`): the reason
code, the description, how the value is read now and compared, and beside that comparison the
lines the generated check runs for it. The same record is written into certificates
(:meth:`Assumption.as_guard`) and checked at run time (:meth:`Assumption.holds`), as Dynamo's
guards are (``torch/_dynamo/guards.py``): one table, a source per assumption, a cheap check.
A :class:`SiteGuard` is the same idea for the per-call checks a run-time op makes (the rows of
a paired call, a captured region's signature): the op checks the record, the pass's
certificate lists it.

Values that steer control flow or shapes are guarded; a float read only as arithmetic is not a
guard but an input, read on every call (kind ``float`` only checks it is still a float).

Cost: the whole-loss state is read once per call, for the loss and the modules its traces
depend on (not every module it holds); hooks are read only when a hook handle was made since
they last held (every ``register_*hook`` makes one; with no hook recorded, none can be removed);
a module's methods are checked by what shadows its class's methods; a specialization's own
assumptions are checked by one generated function (:mod:`fxpasses.guard_code`). Measured in
bench/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .certificates import Guard
from .certificates.codes import lookup
from .ir.sources import Attr, Roots, Source
from .locations import is_user_class
from .snapshots import exact_snapshot, flat_form, same_flat, snapshot

_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                      "_backward_pre_hooks")
MISSING = object()  # what a source reads as when its attribute or key does not exist


# -- the state of modules ------------------------------------------------------------------------

def global_hook_keys() -> tuple:
    return tuple(tuple(getattr(module_mod, name, {})) for name in _GLOBAL_HOOK_DICTS)


def module_hook_keys(m: nn.Module) -> tuple:
    d = m.__dict__
    return (tuple(d.get("_forward_hooks") or ()), tuple(d.get("_forward_pre_hooks") or ()),
            tuple(d.get("_backward_hooks") or ()), tuple(d.get("_backward_pre_hooks") or ()))


def count_hooks(modules: Iterable[nn.Module]) -> dict[str, int]:
    """Hooks per kind over ``modules`` (for evidence)."""
    counts = {name.strip("_"): 0 for name in _MODULE_HOOK_DICTS}
    for m in modules:
        for name in _MODULE_HOOK_DICTS:
            counts[name.strip("_")] += len(getattr(m, name, None) or ())
    return counts


def count_global_hooks() -> dict[str, int]:
    return {name.strip("_"): len(getattr(module_mod, name, {})) for name in _GLOBAL_HOOK_DICTS}


_HEAP_TYPE, _IMMUTABLE_TYPE = 1 << 9, 1 << 8  # Py_TPFLAGS_HEAPTYPE, Py_TPFLAGS_IMMUTABLETYPE


def callable_object(value: Any) -> bool:
    """An instance of a user class written in Python that defines ``__call__`` (not a module):
    an object like any other, whose reads a trace follows, not code (a function, a method, a
    class, a partial, an extension's callable such as a numpy ufunc)."""
    if not callable(value) or isinstance(value, (type, nn.Module)):
        return False
    cls = type(value)
    return cls.__flags__ & (_HEAP_TYPE | _IMMUTABLE_TYPE) == _HEAP_TYPE and is_user_class(cls)


def instance_methods(o: object) -> tuple:
    """The functions stored on an object (a plain object's: read in full); an object that
    defines ``__call__`` is guarded where the trace read it, as any object is."""
    return tuple([(k, id(v)) for k, v in vars(o).items()
                  if callable(v) and not isinstance(v, (nn.Module, torch.Tensor, type))
                  and not callable_object(v)])


def is_method(value: Any) -> bool:
    """A class attribute that acts as a method: a callable or a descriptor that runs code."""
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


_CLASS_METHOD_NAMES: dict[type, frozenset] = {}


def method_names(cls: type) -> frozenset:
    """Names of the callables and descriptors ``cls`` and its bases define (cached per class)."""
    names = _CLASS_METHOD_NAMES.get(cls)
    if names is None:
        names = frozenset(name for klass in cls.__mro__ for name, v in vars(klass).items()
                          if is_method(v))
        _CLASS_METHOD_NAMES[cls] = names
    return names


def module_overrides(m: nn.Module) -> tuple:
    """What on a module instance can change which code its call runs: attributes that shadow a
    method of its class (``m.forward = ...``), and ``m.compile()``'s compiled call. Other
    callables stored on a module matter only if the trace read them, and those reads are
    guarded one by one (``identity``); reading only these keeps the check to a set
    intersection per module instead of a walk of every attribute."""
    d = m.__dict__
    names = method_names(type(m))
    shadowing = () if names.isdisjoint(d) else tuple((k, id(d[k])) for k in d if k in names)
    return shadowing, id(d.get("_compiled_call_impl"))


def _class_methods(cls: type) -> tuple:
    return tuple([(k, id(v)) for k, v in vars(cls).items() if is_method(v)])


def user_classes(objects: Iterable[object]) -> list[type]:
    """Classes (and their user-defined bases) of the loss's objects; torch's own are skipped."""
    seen: dict[type, None] = {}
    for obj in objects:
        for cls in type(obj).__mro__:
            if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
                continue
            seen.setdefault(cls, None)
    return list(seen)


def _autocast(device_type: str) -> tuple[bool, str | None]:
    """(enabled, dtype): the dtype only while enabled (a disabled autocast's dtype changes nothing)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        return (True, str(torch.get_autocast_dtype(device_type))) if enabled else (False, None)
    except TypeError:  # torch < 2.4 spellings
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype
        return (True, str(dtype())) if enabled else (False, None)


AUTOCAST_OFF = ((False, None), (False, None))  # autocast_state() with autocast disabled
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_off() -> bool:
    """True when no autocast is enabled on any device (then :func:`autocast_state` is
    :data:`AUTOCAST_OFF`); False when one is, or when torch cannot say in one call."""
    return _any_autocast is not None and not _any_autocast()


_MODULE_GETATTR = nn.Module.__getattr__


def certainly_absent(obj: Any, name: str) -> bool:
    """True only when ``getattr(obj, name)`` raises AttributeError, found without raising it (a
    raised AttributeError, in nn.Module's ``__getattr__`` among others, costs far more): the
    standard lookup, no class attribute of that name, none in the instance's ``__dict__`` nor,
    for a module, among its parameters, buffers and submodules. False: ask getattr."""
    cls = type(obj)
    hook = getattr(cls, "__getattr__", None)
    if cls.__getattribute__ is not object.__getattribute__ or hook not in (None, _MODULE_GETATTR):
        return False
    for klass in cls.__mro__:
        if name in vars(klass):
            return False
    d = getattr(obj, "__dict__", None)
    if type(d) is not dict or name in d:
        return False
    return hook is None or all(name not in d.get(k, ()) for k in ("_parameters", "_buffers", "_modules"))


def autocast_state() -> tuple:
    """(cuda autocast (enabled, dtype), cpu autocast (enabled, dtype))."""
    return (_autocast("cuda"), _autocast("cpu"))


def ambient_state() -> tuple:
    """(grad enabled, cuda autocast (enabled, dtype), cpu autocast (enabled, dtype))."""
    return (torch.is_grad_enabled(), *autocast_state())


@dataclass(frozen=True, eq=False)
class TensorSeen:
    """A tensor of the loss's state as a rewrite read its values: the object, its version
    counter (every in-place write moves it, through any view), and on the CPU a copy of the
    values (compared without waiting for a device; a write through ``.data`` or a numpy view
    moves no counter). On a device, a write that bypasses autograd's counter (``.data``, raw
    memory) is not seen."""

    tensor: torch.Tensor
    version: int
    values: torch.Tensor | None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSeen":
        values = tensor.detach().clone() if tensor.device.type == "cpu" else None
        return cls(tensor, tensor._version, values)

    def __repr__(self) -> str:
        t = self.tensor
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device} at version {self.version}"


def _unchanged(now: Any, seen: TensorSeen) -> bool:
    if now is not seen.tensor or now._version != seen.version:
        return False
    values = seen.values
    return values is None or torch.equal(now, values) or (  # NaN equals NaN here
        now.is_floating_point() and torch.allclose(now, values, rtol=0.0, atol=0.0, equal_nan=True))


# -- the table -------------------------------------------------------------------------------------

READ_ERRORS = (AttributeError, KeyError, IndexError, TypeError, ValueError)  # a read that fails: MISSING


class GuardKind(str):
    """One kind of assumption, a row of :data:`GUARD_KINDS`: the reason code counted when one
    fails, its description, how its value is read now and compared with the recorded one
    (:meth:`holds`), and beside that comparison the lines the generated checks run for it
    (:meth:`emit`, :mod:`fxpasses.guard_code`).

    A kind *is* its name (a ``str``: ``assumption.kind == "identity"``, and certificates record
    the name); there is one object per name, which pickling and copying keep."""

    code: str
    description: str  # "{source}" and "{value}" are filled in
    compares_identity = False  # its values are one only when they are the same object

    def __new__(cls, name: str, code: str, description: str) -> "GuardKind":
        kind = super().__new__(cls, name)
        lookup(code)
        kind.code, kind.description = code, description
        return kind

    def __reduce__(self) -> tuple:
        return (kind_named, (str(self),))

    def read(self, a: "Assumption", roots: "LossRoots") -> Any:
        """The value ``a`` reads now: its source, read from ``roots`` (:data:`MISSING` if that fails)."""
        try:
            return a.source.read(roots)
        except READ_ERRORS:
            return MISSING

    def same(self, now: Any, expected: Any) -> bool:
        """Whether the value now still is the value recorded."""
        raise NotImplementedError

    def holds(self, a: "Assumption", roots: "LossRoots") -> bool:
        return self.same(self.read(a, roots), a.expected)

    def same_recorded(self, a: Any, b: Any) -> bool:
        """Whether two values recorded for this kind are one (then one check answers for both):
        the same object, or, unless the kind compares identity, equal values of one type."""
        if a is b:
            return True
        if self.compares_identity or type(a) is not type(b):
            return False
        try:
            return (a == b) is True
        except Exception:  # a value whose equality is not a bool (or raises): not one
            return False

    def emit(self, w: Any, a: "Assumption", fail: str, indent: str) -> None:
        """Append to ``w`` (a :class:`fxpasses.guard_code.CheckWriter`) the lines that run ``fail``
        when ``a`` does not hold: here, a call of :meth:`Assumption.holds`."""
        w.lines.append(f"{indent}if not {w.constant(a, 'assumption_')}.holds(LossRoots(loss, leaves)): {fail}")


class ValueKind(GuardKind):
    """A kind whose comparison is one Python expression over ``{v}`` (the value now) and ``{e}``
    (the value recorded) that calls only :data:`GUARD_HELPERS`: compiled once for :meth:`same`,
    written into the generated checks by :meth:`emit`."""

    def __new__(cls, name: str, code: str, description: str, test: str) -> "ValueKind":
        kind = super().__new__(cls, name, code, description)
        kind.test = test
        kind._compare = eval(compile(f"lambda v, e: {test.format(v='v', e='e')}", f"<guard kind {name}>",
                                     "eval"), dict(GUARD_HELPERS))
        return kind

    def same(self, now: Any, expected: Any) -> bool:
        return self._compare(now, expected)

    def emit(self, w: Any, a: "Assumption", fail: str, indent: str) -> None:
        value = w.read(a.source, indent, keep=True)
        w.lines.append(f"{indent}if not ({self._test(w, value, a)}): {fail}")

    def _test(self, w: Any, value: str, a: "Assumption") -> str:
        return self.test.format(v=value, e=w.constant(a.expected, "expected_"))


class ContentsKind(ValueKind):
    """:class:`ValueKind` whose generated check compares a flat container (plain values in a
    dict, list, tuple or namespace) without making a snapshot when it is equal."""

    def _test(self, w: Any, value: str, a: "Assumption") -> str:
        test = super()._test(w, value, a)
        form = flat_form(a.expected)
        return test if form is None else f"same_flat({value}, *{w.constant(form, 'flat_')}) or {test}"


class TensorKind(GuardKind):
    """A tensor of the recorded (dtype, device type, dimensions); its generated check is the same
    comparison specialized to the recorded values (three attribute reads for a plain tensor)."""

    def same(self, now: Any, expected: Any) -> bool:
        return isinstance(now, torch.Tensor) and (now.dtype, now.device.type, now.dim()) == expected

    def emit(self, w: Any, a: "Assumption", fail: str, indent: str) -> None:
        value = w.read(a.source, indent, keep=True)
        dtype, device_type, dim = a.expected
        on_device = {"cpu": f"{value}.is_cpu", "cuda": f"{value}.is_cuda"}.get(
            device_type, f"{value}.device.type == {w.constant(device_type, 'expected_')}")
        w.lines.append(f"{indent}if not (isinstance({value}, Tensor) and {value}.dtype is "
                       f"{w.constant(dtype, 'expected_')} and {on_device} and {value}.ndim == {dim}):"
                       f" {fail}")


class AbsentKind(GuardKind):
    """The source does not exist: it holds when its read fails; the generated check finds an
    attribute absent without raising where it can (:func:`certainly_absent`), else reads it."""

    def same(self, now: Any, expected: Any) -> bool:
        return now is MISSING

    def emit(self, w: Any, a: "Assumption", fail: str, indent: str) -> None:
        inner = indent
        last = a.source.path[-1] if a.source.path else None
        if isinstance(last, Attr):
            owner = w.read(Source(a.source.root, a.source.path[:-1]), indent, keep=True)
            w.lines.append(f"{indent}if not certainly_absent({owner}, {w.constant(last.name, 'key_')}):")
            inner = indent + "    "
        w.lines += [f"{inner}try:", f"{inner}    {w.read(a.source, inner, keep=False)}",
                    f"{inner}except {READ_ERRORS_TEXT}:", f"{inner}    pass", f"{inner}else:", f"{inner}    {fail}"]


class WholeLossKind(GuardKind):
    """A fact about the whole loss (no source): ``component`` reads it from the roots' loss,
    modules and classes, once per call (:meth:`LossRoots.component`); compared by equality.
    ``shown``: its value as text for certificates (default: how many modules it covers)."""

    def __new__(cls, name: str, code: str, description: str, component: Callable[["LossRoots"], Any],
                shown: Callable[[Any], str] | None = None) -> "WholeLossKind":
        kind = super().__new__(cls, name, code, description)
        kind.component, kind.shown = component, shown
        return kind

    def read(self, a: "Assumption", roots: "LossRoots") -> Any:
        return roots.component(self)

    def same(self, now: Any, expected: Any) -> bool:
        return now == expected

    def summary(self, roots: "LossRoots") -> str:
        return self.shown(roots.component(self)) if self.shown else f"{len(roots.modules)} modules"


class HooksKind(WholeLossKind):
    """The hooks of the loss's modules and the global ones. Every ``register_*hook`` makes a
    ``RemovableHandle``, which takes the next id; where none was recorded there is none to
    remove, so an id that has not moved since such an assumption last held means none was added
    (hooks are then not read again). That id is kept here, by the assumption's identity (the
    assumption itself is frozen), and the generated whole-loss check shares it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "HooksKind":
        kind = super().__new__(cls, *args, **kwargs)
        kind._confirmed = WeakIdKeyDictionary()
        return kind

    def confirmed(self, a: "Assumption") -> list:
        """``[handle id]`` when ``a`` last held in full with no hook recorded (else empty)."""
        return self._confirmed.setdefault(a, [])

    def holds(self, a: "Assumption", roots: "LossRoots") -> bool:
        count = RemovableHandle.next_id  # read first: a hook added meanwhile moves it again
        seen = self.confirmed(a)
        if seen and seen[0] == count:
            return True
        ok = self.same(self.read(a, roots), a.expected)
        if ok and not any(map(any, (a.expected[0], *a.expected[1]))):
            seen[:] = [count]
        return ok


class AutocastKind(WholeLossKind):
    """Autocast enabled/dtype on cuda and cpu; the generated check reads it inline (one call
    when no autocast is on at all)."""

    def emit(self, w: Any, a: "Assumption", fail: str, indent: str) -> None:
        test = f"autocast_state() == {w.constant(a.expected, 'expected_')}"
        if a.expected == AUTOCAST_OFF:
            test = f"autocast_off() or {test}"
        w.lines.append(f"{indent}if not ({test}): {fail}")


class DefaultDtypeKind(WholeLossKind):
    """torch's default dtype (the dtype of ``torch.zeros(n)`` and of a Python float made a
    tensor); the generated check reads it inline."""

    def emit(self, w: Any, a: "Assumption", fail: str, indent: str) -> None:
        w.lines.append(f"{indent}if get_default_dtype() is not {w.constant(a.expected, 'expected_')}: {fail}")


READ_ERRORS_TEXT = f"({', '.join(e.__name__ for e in READ_ERRORS)})"
GUARD_HELPERS = {"snapshot": snapshot, "exact_snapshot": exact_snapshot, "unchanged": _unchanged,
                 "autocast_state": autocast_state, "same_flat": same_flat, "autocast_off": autocast_off,
                 "certainly_absent": certainly_absent, "Tensor": torch.Tensor,
                 "get_default_dtype": torch.get_default_dtype}

_CHANGED = "assumption-changed"
HOOKS = HooksKind("hooks", "hook-added", "no module or global hook registered since optimization",
                  lambda r: (global_hook_keys(), tuple([module_hook_keys(m) for m in r.modules])))
METHODS = WholeLossKind("methods", "method-replaced",
                        "no method replaced on an instance or class since optimization",
                        lambda r: (instance_methods(r.loss) if not isinstance(r.loss, nn.Module) else (),
                                   tuple([module_overrides(m) for m in r.modules]),
                                   tuple([_class_methods(c) for c in r.classes])))
MODULES = WholeLossKind("modules", "module-replaced", "no submodule replaced by another object since optimization",
                        lambda r: tuple([tuple(map(id, m._modules.values())) for m in r.modules]))
MODES = WholeLossKind("modes", "mode-changed", "train/eval mode of every module as at optimization",
                      lambda r: tuple([m.training for m in r.modules]))
AUTOCAST = AutocastKind("autocast", "autocast-changed", "autocast enabled/dtype (cuda and cpu) as at tracing",
                        lambda r: autocast_state(), repr)
DEFAULT_DTYPE = DefaultDtypeKind("default-dtype", "default-dtype-changed", "torch's default dtype as at tracing",
                                 lambda r: torch.get_default_dtype(), str)

IDENTITY = ValueKind("identity", _CHANGED, "{source} is the same object ({value})", "{v} is {e}")
IDENTITY.compares_identity = True

GUARD_KINDS: dict[str, GuardKind] = {str(k): k for k in (
    ValueKind("constant", _CHANGED, "{source} is {value}", "type({v}) is type({e}) and bool({v} == {e})"),
    IDENTITY,
    ContentsKind("contents", _CHANGED, "{source} holds the same contents ({value})", "snapshot({v}) == {e}"),
    ValueKind("held", _CHANGED, "{source} holds the same contents, floats by value ({value})",
              "exact_snapshot({v}) == {e}"),
    TensorKind("tensor", _CHANGED, "{source} is a tensor of {value}, read on every call"),
    ValueKind("unchanged", _CHANGED,
              "{source} is the same tensor, not written since a rewrite folded its values ({value})",
              "unchanged({v}, {e})"),
    ValueKind("float", _CHANGED, "{source} is a float, read on every call (an input, not a constant)",
              "type({v}) is float"),
    AbsentKind("absent", _CHANGED, "{source} does not exist"),
    HOOKS, METHODS, MODULES, MODES,
    WholeLossKind("grad-mode", "grad-mode-changed", "grad mode as at tracing", lambda r: torch.is_grad_enabled(), str),
    AUTOCAST,
    DEFAULT_DTYPE,
)}
WHOLE_LOSS_KINDS = tuple(k for k in GUARD_KINDS.values() if isinstance(k, WholeLossKind))  # in recording order
CHECKED_PER_CALL = (HOOKS, METHODS, MODULES, MODES)  # over the loss and its traces' modules, before each call
CHECKED_PER_TRACE = (AUTOCAST, DEFAULT_DTYPE)  # a specialization's own (a trace under autocast,
# or with another default dtype, is another trace: its factories made other dtypes)


def kind_named(name: str) -> GuardKind:
    """The kind called ``name`` (a KeyError names an unknown one)."""
    try:
        return GUARD_KINDS[name]
    except KeyError:
        raise KeyError(f"unknown guard kind {name!r}; known: {sorted(GUARD_KINDS)}") from None


@dataclass
class LossRoots(Roots):
    """Roots of one call, plus the modules and user classes the whole-loss kinds read."""

    modules: Sequence[nn.Module] = ()
    classes: Sequence[type] = ()
    _cache: dict = field(default_factory=dict)

    def component(self, kind: WholeLossKind) -> Any:
        """What ``kind`` reads, read once for this call."""
        if kind not in self._cache:
            self._cache[kind] = kind.component(self)
        return self._cache[kind]


@dataclass(frozen=True)
class Assumption:
    """One assumption: its kind (a :class:`GuardKind`; given by name, the kind of that name),
    what it reads (a source, or nothing for a whole-loss kind), the value recorded, where the
    trace made it, and that value as text for certificates."""

    kind: GuardKind
    source: Source | None
    expected: Any = field(compare=False)
    location: str = ""
    shown: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kind_named(self.kind))

    def holds(self, roots: LossRoots) -> bool:
        """Whether the value now is the value recorded (see :meth:`GuardKind.holds`)."""
        return self.kind.holds(self, roots)

    @property
    def code(self) -> str:
        return self.kind.code

    def describe(self) -> str:
        return self.kind.description.format(source=self.source, value=self.shown)

    def as_guard(self) -> Guard:
        where = str(self.source) if self.source is not None else "the whole loss"
        evidence = {"kind": self.kind, "reads": where}
        if self.location:
            evidence["location"] = self.location
        if self.shown:
            evidence["value"] = self.shown
        return Guard(f"{self.kind}:{where}", self.describe(), self.code, evidence)


def whole_loss_assumptions(roots: LossRoots) -> tuple[Assumption, ...]:
    """The whole-loss kinds, recorded now (at optimization)."""
    return tuple(Assumption(kind, None, roots.component(kind), shown=kind.summary(roots))
                 for kind in WHOLE_LOSS_KINDS)


def first_failure(assumptions: Iterable[Assumption], roots: LossRoots) -> Assumption | None:
    """The first assumption that no longer holds, or None."""
    return next((a for a in assumptions if not a.holds(roots)), None)


@dataclass(frozen=True)
class SiteGuard:
    """A condition a run-time op checks on each call before its rewritten path (a per-site guard):
    where it does not hold, that site runs natively and the op counts ``code``. The op declares
    its guards as these records and counts their codes; the pass that puts the op in a graph
    writes the same records into its certificate (:meth:`as_guard`), so the two cannot differ.
    ``holds``: the check itself, where it is one predicate of the op's arguments."""

    id: str
    description: str
    code: str
    holds: Callable[..., bool] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        lookup(self.code)

    def as_guard(self, **evidence: Any) -> Guard:
        return Guard(self.id, self.description, self.code, evidence)
