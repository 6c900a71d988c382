"""Guards: every assumption a trace or a rewrite makes, from one table, checked before each call.

An :class:`Assumption` is one thing that must still hold for an optimized graph to compute what
the loss computes: a value the trace read (``loss.assign_o2m.topk`` is 10, ``loss.flow`` is that
module, ``loss.hyp`` holds the same gains, ``loss.o2m`` is a float), or a fact about the whole
loss (no hook registered since, no method replaced, no submodule swapped, train/eval modes, grad
mode, autocast). Each has a *kind*, a row of :data:`GUARD_KINDS`: its reason code, its description,
how its current value is read and compared. The same record is written into certificates
(:meth:`Assumption.as_guard`) and checked at run time (:meth:`Assumption.holds`), as Dynamo's
guards are (``torch/_dynamo/guards.py``): one table, a source per assumption, a cheap check.

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

import enum
import types
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.hooks import RemovableHandle

from .certificates import Guard
from .ir.carriers import ScalarCarrier
from .ir.sources import Roots, Source
from .locations import is_user_class

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


@dataclass
class LossRoots(Roots):
    """Roots of one call, plus the modules and user classes the whole-loss kinds read."""

    modules: Sequence[nn.Module] = ()
    classes: Sequence[type] = ()
    _cache: dict = field(default_factory=dict)

    def component(self, name: str) -> Any:
        if name not in self._cache:
            self._cache[name] = _COMPONENTS[name](self)
        return self._cache[name]


_COMPONENTS: dict[str, Callable[[LossRoots], Any]] = {
    "hooks": lambda r: (global_hook_keys(), tuple([module_hook_keys(m) for m in r.modules])),
    "methods": lambda r: (instance_methods(r.loss) if not isinstance(r.loss, nn.Module) else (),
                          tuple([module_overrides(m) for m in r.modules]),
                          tuple([_class_methods(c) for c in r.classes])),
    "modules": lambda r: tuple([tuple(map(id, m._modules.values())) for m in r.modules]),
    "modes": lambda r: tuple([m.training for m in r.modules]),
    "grad-mode": lambda r: torch.is_grad_enabled(),
    "autocast": lambda r: autocast_state(),
}


# -- snapshots of containers -------------------------------------------------------------------

_PLAIN = (bool, int, float, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
FLOAT_READ = "a float, read on every call"  # a snapshot's record of a float held in a dict or namespace


def snapshot(value: Any, depth: int = 4, floats: list | None = None, path: tuple = (),
             exact: bool = False) -> Any:
    """A comparable copy of a container's contents: plain values by value, anything else
    (tensors, modules, objects) by identity; dicts, lists, tuples, sets, namespaces and
    dataclass instances recursively. A float held in a dict or a namespace is recorded by type
    only (:data:`FLOAT_READ`): a trace reads it on every call, as an input; ``floats``, when
    given, collects where each is: ``(path from value, its container, key)``. ``exact``: every
    float by value (what code the trace does not follow read, see ``held``)."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if depth <= 0:
        return ("id", id(value))
    if isinstance(value, dict):
        return ("dict", _held_items(value, value.items(), "item", depth, floats, path, exact))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(snapshot(v, depth - 1, floats, (*path, ("item", i)), exact)
                                   for i, v in enumerate(value)))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(snapshot(v, depth - 1, exact=exact) for v in value))
    if isinstance(value, types.SimpleNamespace):
        return ("namespace", ("dict", _held_items(value, vars(value).items(), "attr", depth - 1, floats,
                                                  path, exact)))
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((f.name, snapshot(getattr(value, f.name), depth - 1, floats,
                                                     (*path, ("attr", f.name)), exact))
                                   for f in fields(value)))
    return ("id", id(value))


def _held_items(owner: Any, items: Iterable, step: str, depth: int, floats: list | None,
                path: tuple, exact: bool = False) -> tuple:
    """A dict's or namespace's items for :func:`snapshot`: floats (and, during a trace, the
    inputs standing in for them) by type only, unless ``exact``."""
    if depth <= 0:
        return ("id", id(owner))
    held = []
    for k, v in items:
        if not exact and (type(v) is float or isinstance(v, ScalarCarrier)):
            held.append((k, (float, FLOAT_READ)))
            if floats is not None:
                floats.append(((*path, (step, k)), owner, k))
        elif isinstance(v, ScalarCarrier):  # a trace's stand-in for the float it holds
            held.append((k, (float, v.value)))
        else:
            held.append((k, snapshot(v, depth - 1, floats, (*path, (step, k)), exact)))
    return tuple(held)


def exact_snapshot(value: Any) -> Any:
    """:func:`snapshot` with every float by value."""
    return snapshot(value, exact=True)


def flat_form(snap: Any) -> tuple | None:
    """For the snapshot of a dict, namespace, list or tuple of plain values: (container type,
    keys, value types, the values compared), what :func:`same_flat` compares; None for any other
    snapshot."""
    tag, body = snap
    if tag == "namespace":
        form = flat_form(body)
        return None if form is None else (types.SimpleNamespace, *form[1:])
    if tag == "dict":
        if not isinstance(body, tuple) or body[:1] == ("id",):
            return None
        keys, items = [k for k, _ in body], [v for _, v in body]
    elif tag in (list, tuple):
        keys, items = None, list(body)
    else:
        return None
    if not all(type(i) is tuple and isinstance(i[0], type) and issubclass(i[0], _PLAIN)
               for i in items):
        return None
    if keys is None:
        values = tag(v for _, v in items)
    else:  # floats read on every call: their type only
        values = {k: v for k, (_, v) in zip(keys, items) if v is not FLOAT_READ}
    return (dict if tag == "dict" else tag, keys, [t for t, _ in items], values)


def same_flat(value: Any, container: type, keys: list | None, value_types: list, values: Any) -> bool:
    """``snapshot(value) == snap`` for a snapshot whose :func:`flat_form` is the other arguments
    (True only then; False may also mean "compare the snapshots"), without building one."""
    if type(value) is not container:
        return False
    if container is types.SimpleNamespace:
        value = vars(value)
    if keys is None:
        return list(map(type, value)) == value_types and value == values
    if list(value) != keys or list(map(type, value.values())) != value_types:
        return False
    if len(values) == len(keys):
        return value == values
    return all(value[k] == v for k, v in values.items())


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple, set, frozenset, types.SimpleNamespace)) or (
        is_dataclass(value) and not isinstance(value, type))


# -- the table -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GuardKind:
    """One row: the code counted when it fails, its description, how it compares; and, for a
    value that is costly to read, a global counter that moves whenever it can change (see
    :meth:`Assumption.holds`) and the recorded values for which the counter is enough."""

    name: str
    code: str
    description: str  # "{source}" and "{value}" are filled in
    same: Callable[[Any, Any], bool]  # (value now, value recorded) -> still holds
    counter: Callable[[], int] | None = None
    counter_suffices: Callable[[Any], bool] = lambda expected: False
    # ``same`` as a Python expression over {v} (the value now) and {e} (the value recorded),
    # calling only GUARD_HELPERS (without {v}: a whole-loss value the helpers read themselves);
    # the generated checks (fxpasses.guard_code) use it
    inline: str | None = None


def _same_constant(now: Any, expected: Any) -> bool:
    return type(now) is type(expected) and bool(now == expected)


def _same_tensor(now: Any, expected: Any) -> bool:
    return isinstance(now, torch.Tensor) and (now.dtype, now.device.type, now.dim()) == expected


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


GUARD_KINDS: dict[str, GuardKind] = {k.name: k for k in (
    GuardKind("constant", "assumption-changed", "{source} is {value}", _same_constant,
              inline="type({v}) is type({e}) and bool({v} == {e})"),
    GuardKind("identity", "assumption-changed", "{source} is the same object ({value})",
              lambda now, expected: now is expected, inline="{v} is {e}"),
    GuardKind("contents", "assumption-changed", "{source} holds the same contents ({value})",
              lambda now, expected: snapshot(now) == expected, inline="snapshot({v}) == {e}"),
    GuardKind("held", "assumption-changed",
              "{source} holds the same contents, floats by value ({value})",
              lambda now, expected: exact_snapshot(now) == expected, inline="exact_snapshot({v}) == {e}"),
    GuardKind("tensor", "assumption-changed",
              "{source} is a tensor of {value}, read on every call", _same_tensor,
              inline="same_tensor({v}, {e})"),
    GuardKind("unchanged", "assumption-changed",
              "{source} is the same tensor, not written since a rewrite folded its values ({value})",
              _unchanged, inline="unchanged({v}, {e})"),
    GuardKind("float", "assumption-changed",
              "{source} is a float, read on every call (an input, not a constant)",
              lambda now, expected: type(now) is float, inline="type({v}) is float"),
    GuardKind("absent", "assumption-changed", "{source} does not exist",
              lambda now, expected: now is MISSING),
    GuardKind("hooks", "hook-added", "no module or global hook registered since optimization",
              lambda now, expected: now == expected,
              # every register_*hook makes a RemovableHandle, which takes the next id; with no
              # hook recorded there is none to remove, so an unmoved id means none was added
              counter=lambda: RemovableHandle.next_id,
              counter_suffices=lambda expected: not any(map(any, (expected[0], *expected[1])))),
    GuardKind("methods", "method-replaced",
              "no method replaced on an instance or class since optimization",
              lambda now, expected: now == expected),
    GuardKind("modules", "module-replaced",
              "no submodule replaced by another object since optimization",
              lambda now, expected: now == expected),
    GuardKind("modes", "mode-changed", "train/eval mode of every module as at optimization",
              lambda now, expected: now == expected),
    GuardKind("grad-mode", "grad-mode-changed", "grad mode as at tracing",
              lambda now, expected: now == expected),
    GuardKind("autocast", "autocast-changed", "autocast enabled/dtype (cuda and cpu) as at tracing",
              lambda now, expected: now == expected, inline="autocast_state() == {e}"),
)}


GUARD_HELPERS = {"snapshot": snapshot, "exact_snapshot": exact_snapshot, "same_tensor": _same_tensor,
                 "unchanged": _unchanged, "autocast_state": autocast_state,
                 "same_flat": same_flat, "autocast_off": autocast_off, "certainly_absent": certainly_absent,
                 "Tensor": torch.Tensor}


@dataclass(frozen=True)
class Assumption:
    """One assumption: its kind, what it reads (a source, or a whole-loss component), the value
    recorded, where the trace made it, and that value as text for certificates."""

    kind: str
    source: Source | None
    expected: Any = field(compare=False)
    location: str = ""
    shown: str = ""
    # the kind's counter when this assumption last held in full (empty: never, or not usable)
    counter_seen: list = field(default_factory=list, compare=False, repr=False)

    def now(self, roots: LossRoots) -> Any:
        if self.source is None:
            return roots.component(self.kind)
        try:
            return self.source.read(roots)
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            return MISSING

    def holds(self, roots: LossRoots) -> bool:
        """Whether the value now is the value recorded. A kind with a counter reads the value
        only when the counter moved since it last held in full (the counter is read first, so
        a change made meanwhile moves it again)."""
        kind = GUARD_KINDS[self.kind]
        if kind.counter is None:
            return kind.same(self.now(roots), self.expected)
        count = kind.counter()
        if self.counter_seen and self.counter_seen[0] == count:
            return True
        ok = kind.same(self.now(roots), self.expected)
        if ok and kind.counter_suffices(self.expected):
            self.counter_seen[:] = [count]
        return ok

    @property
    def code(self) -> str:
        return GUARD_KINDS[self.kind].code

    def describe(self) -> str:
        return GUARD_KINDS[self.kind].description.format(source=self.source, value=self.shown)

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
    return tuple(Assumption(kind, None, roots.component(kind), shown=_summary(kind, roots))
                 for kind in _COMPONENTS)


def _summary(kind: str, roots: LossRoots) -> str:
    if kind == "grad-mode":
        return str(roots.component(kind))
    if kind == "autocast":
        return repr(roots.component(kind))
    return f"{len(roots.modules)} modules"


def first_failure(assumptions: Iterable[Assumption], roots: LossRoots) -> Assumption | None:
    """The first assumption that no longer holds, or None."""
    return next((a for a in assumptions if not a.holds(roots)), None)
