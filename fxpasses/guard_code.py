"""Generated Python functions that check assumptions: one per specialization, one for the loss.

:func:`compile_check` turns a sequence of :class:`~fxpasses.guards.Assumption` into a function
``check(loss, leaves)``: the index of the first assumption that does not hold, ``None`` when
all hold, :data:`READ_FAILED` when a read raised (the caller then runs the exact, slow path,
:func:`~fxpasses.guards.first_failure`, which turns a failed read into ``MISSING``). It computes
what ``first_failure`` computes, in the same order, with the interpreter's overhead taken out: no
Assumption, Source or kind objects are touched, and a source prefix shared by several
assumptions (``loss.assign_o2m`` for ``.topk``, ``.alpha``...) is read once. Dynamo generated its
guards the same way before its C++ guard manager (``torch/_dynamo/guards.py``); torch offers no
such generator for other callers, hence this one.

Each assumption's lines are written by its kind (:meth:`~fxpasses.guards.GuardKind.emit`, beside
the comparison it inlines), through a :class:`CheckWriter`; a kind without lines of its own is
checked by the assumption's :meth:`~fxpasses.guards.Assumption.holds`.

:func:`compile_whole_check` does the same for the whole-loss assumptions (hooks, methods,
submodules, modes of the loss and of the modules the traces depend on): ``check() -> bool``,
``True`` only when every one holds; ``False`` sends the caller to the exact path, which says
which one failed (or that none did). It reads each module's ``__dict__`` once, for all four kinds
(the exact path walks the modules once per kind, and in training, with cold caches, each module
touched costs more than the comparisons), in one loop over a record per module (unrolled, the
checks' own bytecode would be cold too: slower than the loop once the cache is flushed).
Where the interpreter keeps dict version tags (:data:`DICT_VERSION`), a module whose ``__dict__``
and ``_modules``, a class whose dict, and a plain loss object whose ``__dict__`` has not been
written since its state last held is passed on two integer reads; a written one is checked in
full, and its versions move on when it holds.
"""

from __future__ import annotations

import enum
import gc
from typing import Any, Callable, Optional, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from .guards import (CHECKED_PER_CALL, GUARD_HELPERS, HOOKS, METHODS, MODES, MODULES, READ_ERRORS_TEXT,
                     Assumption, LossRoots, instance_methods, method_names, module_overrides,
                     whole_loss_assumptions)
from .ir.sources import Source


class _Unanswered(enum.Enum):
    """What a generated check answers when it cannot decide."""

    READ_FAILED = "a read raised: run the exact path"


READ_FAILED = _Unanswered.READ_FAILED


def _dict_version_reader() -> Optional[Callable[[dict], int]]:
    """CPython's version tag of a dict (PEP 509: it changes on every write to the dict, an
    identical value stored again excepted), as ``torch._C._dynamo.guards.dict_version`` reads it
    (private to torch: Dynamo's dict guards). None where torch lacks it or this interpreter does
    not keep the tag (PEP 699 deprecates it from 3.12): the checks then read the state itself."""
    try:
        from torch._C._dynamo.guards import dict_version
        probe: dict = {"k": None}
        before = dict_version(probe)
        probe["k"] = object()
        written = dict_version(probe)
        probe["k"] = probe["k"]  # the same value again
        same = dict_version(probe)
        del probe["k"]
        if before != written == same != dict_version(probe):
            return dict_version
    except Exception:  # torch or the interpreter without it: read the state
        pass
    return None


DICT_VERSION = _dict_version_reader()


def _class_dict(cls: type) -> Optional[dict]:
    """The dict behind ``cls.__dict__`` (a read-only proxy of it), or None."""
    inner = gc.get_referents(cls.__dict__)
    return inner[0] if len(inner) == 1 and type(inner[0]) is dict else None


class CheckWriter:
    """The generated function's lines and the constants they refer to by name; a guard kind
    writes its own lines (:meth:`fxpasses.guards.GuardKind.emit`) with :meth:`constant` and
    :meth:`read`."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {}
        self.reads: dict[tuple, str] = {}  # (root, path prefix) -> local variable holding it

    def constant(self, value: Any, hint: str) -> str:
        name = f"{hint}{len(self.names)}"
        self.names[name] = value
        return name


    def read(self, source: Source, indent: str, keep: bool) -> str:
        """An expression for the value at ``source``; with ``keep``, every prefix read on the way
        is stored in a local (read once for the whole function)."""
        path = source.path
        root = source.root.key
        start, value = 0, None
        for n in range(len(path), -1, -1):  # the longest prefix already read
            held = self.reads.get((root, path[:n]))
            if held is not None:
                start, value = n, held
                break
        if value is None:
            value = source.root.code(self.constant)
            if keep:
                value = self._store((root, ()), value, indent)
        for n in range(start, len(path)):
            value = path[n].code(value, self.constant)
            if keep:
                value = self._store((root, path[:n + 1]), value, indent)
        return value

    def _store(self, key: tuple, expression: str, indent: str) -> str:
        local = f"v{len(self.reads)}"
        self.lines.append(f"{indent}{local} = {expression}")
        self.reads[key] = local
        return local


def compile_check(assumptions: Sequence[Assumption],
                  ) -> Callable[[Any, Sequence[Any]], int | None | _Unanswered]:
    """``check(loss, leaves)``: see the module docstring."""
    w = CheckWriter()
    body = "        "
    for i, a in enumerate(assumptions):
        a.kind.emit(w, a, f"return {i}", body)
    source = "\n".join(["def check(loss, leaves):", "    try:", *(w.lines or [f"{body}pass"]),
                        f"    except {READ_ERRORS_TEXT}:", "        return READ_FAILED",
                        "    return None"])
    namespace = {**w.names, "LossRoots": LossRoots, "READ_FAILED": READ_FAILED, **GUARD_HELPERS}
    exec(compile(source, f"<fxpasses guards of {len(assumptions)} assumptions>", "exec"), namespace)
    check = namespace["check"]
    check.source = source
    return check


WHOLE_CHECK_PARTS = ("hooks", "loss callables", "modules", "classes")


def compile_whole_check(assumptions: Sequence[Assumption], loss: Any, modules: Sequence[nn.Module],
                        classes: Sequence[type],
                        parts: Sequence[str] = WHOLE_CHECK_PARTS) -> Callable[[], bool]:
    """``check()``: see the module docstring. ``assumptions``: the whole-loss ones recorded over
    ``loss``, ``modules`` and ``classes``. Each part of the state is checked against the value
    recorded in its assumption; a part whose state already differs at compile time, or a kind
    the generator does not know, makes ``check`` answer ``False`` (the exact path decides).
    ``parts``: a subset of :data:`WHOLE_CHECK_PARTS` generates only those checks (to measure
    what each costs: ``bench/guard_cost.py --parts``); the guards use them all."""
    w = CheckWriter()
    lines = w.lines
    body = "    "
    roots = LossRoots(loss, (), modules, classes)
    now = {a.kind: a for a in whole_loss_assumptions(roots)}
    by_kind = {a.kind: a for a in assumptions}
    if set(by_kind) - set(CHECKED_PER_CALL) or any(
            by_kind[k].expected != now[k].expected for k in by_kind):
        lines.append(f"{body}return False")  # recorded for another state: the exact path decides
    else:
        _whole_lines(w, by_kind, loss, modules, classes, body, frozenset(parts))
    source = "\n".join(["def check():", "    try:", *("    " + line for line in lines or [f"{body}pass"]),
                        "    except Exception:  # a read that raises: the exact path decides",
                        "        return False", "    return True"])
    namespace = {**w.names, "LossRoots": LossRoots, "RemovableHandle": RemovableHandle,
                 "same_callables": _same_callables, "module_overrides": module_overrides,
                 "version": DICT_VERSION}
    exec(compile(source, f"<fxpasses whole-loss guards of {len(modules)} modules>", "exec"), namespace)
    check = namespace["check"]
    check.source = source
    return check


def _whole_lines(w: CheckWriter, by_kind: dict[str, Assumption], loss: Any, modules: Sequence[nn.Module],
                 classes: Sequence[type], body: str, parts: frozenset[str]) -> None:
    lines = w.lines
    hooks = by_kind.get(HOOKS) if "hooks" in parts else None
    if hooks is not None:  # the counter, then the exact read only when it moved
        seen, held = w.constant(HOOKS.confirmed(hooks), "seen_"), w.constant(hooks, "assumption_")
        roots = w.constant((loss, (), modules, classes), "roots_")
        lines.append(f"{body}if not ({seen} and {seen}[0] == RemovableHandle.next_id) and "
                     f"not {held}.holds(LossRoots(*{roots})): return False")
    methods = METHODS in by_kind
    if methods and not isinstance(loss, nn.Module) and "loss callables" in parts:
        values = tuple(vars(loss).values())
        seen = w.constant([tuple(vars(loss)), tuple(map(id, values)), values,
                           DICT_VERSION and DICT_VERSION(vars(loss))], "seen_")
        lines.append(f"{body}if not same_callables({w.constant(loss, 'loss_')}, {seen}, "
                     f"{w.constant(instance_methods(loss), 'expected_')}): return False")
    if "modules" in parts:
        _module_lines(w, modules, methods, MODULES in by_kind, MODES in by_kind, body)
    if methods and "classes" in parts:
        _class_lines(w, classes, body)


def _same_callables(obj: Any, seen: list, expected: tuple) -> bool:
    """Whether the callables stored on ``obj`` are those recorded (``expected``, as
    :func:`~fxpasses.guards.instance_methods` reads them). Fast when no attribute was rebound
    since ``seen`` (names, ids of the values, the values, held so that ids are not reused): the
    values are not read then, only the dict (with :data:`DICT_VERSION`, only its version tag when
    the dict is the one seen). Else the exact read, and ``seen`` moves on when it holds (a float
    updated each epoch costs one exact read per change)."""
    d = vars(obj)
    if DICT_VERSION is not None and DICT_VERSION(d) == seen[3]:
        return True
    if not (tuple(d) == seen[0] and tuple(map(id, d.values())) == seen[1]) and \
            instance_methods(obj) != expected:
        return False
    values = tuple(d.values())
    seen[:] = [tuple(d), tuple(map(id, values)), values, DICT_VERSION and DICT_VERSION(d)]
    return True


def _module_lines(w: CheckWriter, modules: Sequence[nn.Module], methods: bool, children: bool,
                  modes: bool, body: str) -> None:
    """Every module's checks, in one loop over a record per module, each from one read of its
    ``__dict__``: in training, with cold caches, 42 unrolled blocks of checks cost a third more
    than one loop (their bytecode and constants are cold too). Equal parts of the records (the
    attribute names of 18 ``nn.Linear``) are one object, and a module without children is
    checked without building a tuple: less memory to bring back into the cache. With
    :data:`DICT_VERSION`, each record ends with what was seen when the module's state last held
    (its ``__dict__``, that dict's version, its ``_modules``, that dict's version): unwritten
    since, the module is passed; checked in full and holding, the record moves on."""
    if not modules:
        return
    shared: dict[tuple, tuple] = {}
    one = lambda value: shared.setdefault(value, value)  # noqa: E731 (equal tuples: one object)
    records = []
    for m in modules:
        shadowing, compiled = module_overrides(m) if methods else ((), id(None))
        seen = [m.__dict__, DICT_VERSION(m.__dict__), m._modules, DICT_VERSION(m._modules)] \
            if DICT_VERSION else None
        records.append((m, m.training, one(tuple(map(id, m._modules.values()))), one(tuple(m.__dict__)),
                        method_names(type(m)) if methods else frozenset(), shadowing,
                        None if compiled == id(None) else compiled, seen))
    w.constant(tuple(tuple(m._modules.values()) for m in modules), "children_")  # held: ids not reused
    lines = w.lines
    lines.append(f"{body}for m, training, kids, keys, names, shadowing, compiled, seen in {w.constant(tuple(records), 'records_')}:")
    inner = body + "    "
    lines.append(f"{inner}d = m.__dict__")
    if DICT_VERSION:
        lines.append(f"{inner}if d is seen[0] and version(d) == seen[1] and version(seen[2]) == seen[3]: continue")
    if modes:
        lines.append(f"{inner}if d['training'] is not training and d['training'] != training: return False")
    if children:
        lines.append(f"{inner}if kids:")
        lines.append(f"{inner}    if tuple(map(id, d['_modules'].values())) != kids: return False")
        lines.append(f"{inner}elif d['_modules']: return False")
    if methods:
        lines.append(f"{inner}if shadowing:")
        lines.append(f"{inner}    if module_overrides(m)[0] != shadowing: return False")
        lines.append(f"{inner}elif tuple(d) != keys and not names.isdisjoint(d): return False")
        lines.append(f"{inner}if compiled is None:")
        lines.append(f"{inner}    if d.get('_compiled_call_impl') is not None: return False")
        lines.append(f"{inner}elif module_overrides(m)[1] != compiled: return False")
    if DICT_VERSION:  # it holds as it is now
        lines.append(f"{inner}seen[:] = d, version(d), d['_modules'], version(d['_modules'])")


def _class_lines(w: CheckWriter, classes: Sequence[type], body: str) -> None:
    """Each class's attributes: the same names, each bound to the same object (held, so their
    ids are not reused). Stricter than the methods kind (a non-method value rebound fails here
    and the exact path decides), and read in two passes over the class's dict instead of one
    Python comparison per attribute; one loop for all classes. With :data:`DICT_VERSION`, a class
    whose dict was not written since it last held is passed on its version tag."""
    if not classes:
        return
    def seen(cls: type) -> Optional[list]:
        inner = _class_dict(cls) if DICT_VERSION else None
        return None if inner is None else [inner, DICT_VERSION(inner)]
    records = tuple((cls, tuple(vars(cls)), tuple(map(id, vars(cls).values())), seen(cls))
                    for cls in classes)
    w.constant(tuple(tuple(vars(cls).values()) for cls in classes), "held_")
    w.lines.append(f"{body}for cls, keys, ids, seen in {w.constant(records, 'classes_')}:")
    w.lines.append(f"{body}    if seen is not None and version(seen[0]) == seen[1]: continue")
    w.lines.append(f"{body}    d = cls.__dict__")
    w.lines.append(f"{body}    if tuple(d) != keys or tuple(map(id, d.values())) != ids: return False")
    w.lines.append(f"{body}    if seen is not None: seen[1] = version(seen[0])")
