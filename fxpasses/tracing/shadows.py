"""Stand-ins for the builtins ``len`` and ``int``: sizes read with them stay symbolic.

Python's ``len()`` and ``int()`` must return a real ``int``, so without help ``len(idx)`` or
``int(counts.max())`` would make the trace take the value: an exact-value guard that fails
whenever the batch holds another number of objects. During a trace, the globals of each user
module whose code the tracing thread runs get a stand-in for each of these names
(:meth:`BuiltinShadows.cover`): called by the tracing thread, while it records, on a traced
tensor or number, it returns a :class:`~.values.TracedScalar` whose node computes the size on
every call (``len(t)``: ``t.size(0)``; ``int(t)``: ``torch.sym_int(t.item())``, a host read); called
anywhere else (another thread, a call kept whole, on anything else) it *is* the builtin: the
same result or the same exception.

A module gets stand-ins only where they cannot be told from the builtins: it does not bind the
name itself, its builtins are Python's, and every load of the name in its code is a call
(``len(x)``, never ``isinstance(n, int)``, ``map(int, ...)`` or a rebinding), checked on the
bytecode of its source file and of the functions and classes it holds (:func:`why_not_shadowed`).
Nor does its code call ``globals``, ``eval`` or ``exec``, which could see the stand-ins. A
module refused keeps the builtins (its sizes become exact guards, as before); the trace's
certificate names it and why. The stand-ins are entries of the trace's undo journal, removed
when the trace ends, on error too.
"""

from __future__ import annotations

import builtins
import dis
import functools
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch

from .values import TracedScalar, TracedTensor, active_recorder

SHADOWED = ("len", "int")
# code calling these could reach a module's globals by name, stand-ins included
_REFLECTIVE = ("globals", "eval", "exec")
_WRITES = ("STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME")
_OPTIMIZED = 0x1  # CO_OPTIMIZED: a function's code (module and class bodies lack it)


def _recording(rec: Any) -> bool:
    return active_recorder() is rec and not rec.paused and not rec.busy \
        and threading.get_ident() == rec.thread


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _symbolic_len(rec: Any) -> Callable:
    def len(obj, /):  # noqa: A001 (the name code reading it sees)
        if isinstance(obj, TracedTensor) and _recording(rec):
            builtins.len(_plain(obj))  # a 0-d tensor raises here, as natively
            return rec.size(obj, 0)
        return builtins.len(obj)
    return len


def _symbolic_int(rec: Any) -> Callable:
    def int(*args, **kwargs):  # noqa: A001
        if len(args) == 1 and not kwargs and _recording(rec):
            (value,) = args
            # torch.sym_int: int() of a number, and a size symbol as it is, where shape
            # propagation (FakeTensorProp) reads an unbacked .item() (int() would guard on it)
            if isinstance(value, TracedTensor):
                builtins.int(_plain(value))  # a tensor of other than one element raises here
                return rec.scalar_op(torch.sym_int, rec.item(value))
            if isinstance(value, TracedScalar):
                builtins.int(value.value)
                return rec.scalar_op(torch.sym_int, value)
        return builtins.int(*args, **kwargs)
    return int


_STAND_INS = {"len": _symbolic_len, "int": _symbolic_int}


def _code_objects(code: types.CodeType, in_function: bool = False
                  ) -> Iterator[tuple[types.CodeType, bool]]:
    """``code`` and every code object nested in it, each with whether it runs again (it is, or
    is nested in, a function: module and class bodies ran once, at import)."""
    rerun = in_function or bool(code.co_flags & _OPTIMIZED)
    yield code, rerun
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const, rerun)


def _held_code(namespace: dict) -> Iterator[types.CodeType]:
    """The code of the functions a module holds: its functions, its classes' methods and
    properties, and those in its containers (a table of lambdas), defined with these globals."""
    seen: set[int] = set()

    def functions(value: Any, depth: int) -> Iterator[types.FunctionType]:
        if id(value) in seen or depth > 3:
            return
        seen.add(id(value))
        value = getattr(value, "__func__", value)  # classmethod, staticmethod, bound method
        if isinstance(value, types.FunctionType):
            if value.__globals__ is namespace:
                yield value
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is not None:
                yield from functions(wrapped, depth + 1)
        elif isinstance(value, property):
            for part in (value.fget, value.fset, value.fdel):
                yield from functions(part, depth + 1)
        elif isinstance(value, type) and value.__module__ == namespace.get("__name__"):
            for member in vars(value).values():
                yield from functions(member, depth + 1)
        elif type(value) in (dict, list, tuple):
            for item in (value.values() if isinstance(value, dict) else value):
                yield from functions(item, depth + 1)

    for value in list(namespace.values()):
        for function in functions(value, 0):
            yield function.__code__


_LOAD_GLOBAL = dis.opmap["LOAD_GLOBAL"]
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
_BY_NAME = {dis.opmap[name]: name for name in ("LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS", *_WRITES)
            if name in dis.opmap}


def _name_ops(code: types.CodeType) -> Iterator[tuple[str, str, bool, int]]:
    """(op, name, NULL pushed, offset) of each global or name op of ``code``, from its raw
    bytecode (``dis.get_instructions`` is several times slower)."""
    raw, extended = code.co_code, 0
    for offset in range(0, len(raw), 2):
        op, arg = raw[offset], raw[offset + 1] | extended
        extended = arg << 8 if op == _EXTENDED_ARG else 0
        if op == _LOAD_GLOBAL:  # 3.11+: the name is arg >> 1; the low bit pushes NULL (a call)
            yield "LOAD_GLOBAL", code.co_names[arg >> 1], bool(arg & 1), offset
        elif op in _BY_NAME:
            yield _BY_NAME[op], code.co_names[arg], False, offset


def _line(code: types.CodeType, offset: int) -> Any:
    return next((line for start, end, line in code.co_lines() if start <= offset < end), code.co_firstlineno)


@functools.lru_cache(maxsize=4096)
def _misuse(code: types.CodeType, rerun: bool) -> str | None:
    """How ``code`` uses a shadowed name other than by calling it, or None (a pure function of
    the code: remembered)."""
    if not any(name in code.co_names for name in (*SHADOWED, *_REFLECTIVE)):
        return None
    for op, name, called, offset in _name_ops(code):
        if op == "LOAD_GLOBAL" and name in _REFLECTIVE:
            return f"{code.co_qualname}() calls {name}()"
        if name not in SHADOWED:
            continue
        if op == "LOAD_GLOBAL" and not called:
            return f"{code.co_qualname}() uses {name} as a value (line {_line(code, offset)})"
        if op in _WRITES:
            return f"{code.co_qualname}() binds {name}"
        if rerun and op != "LOAD_GLOBAL":
            return f"{code.co_qualname} reads {name} by name (line {_line(code, offset)})"
    return None


@functools.lru_cache(maxsize=256)
def _source_misuse(path: str, mtime_ns: int, size: int) -> str | None:
    """The first misuse in the code of the source file at ``path`` (as of its modification
    time and size: remembered), or None."""
    try:
        with open(path, "rb") as file:
            top = compile(file.read(), path, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return None
    return next(filter(None, (_misuse(code, rerun) for code, rerun in _code_objects(top))), None)


def _source_check(namespace: dict) -> str | None:
    path = namespace.get("__file__")
    if not isinstance(path, str) or not path.endswith(".py"):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _source_misuse(path, stat.st_mtime_ns, stat.st_size)


def why_not_shadowed(namespace: dict) -> str | None:
    """Why the module with globals ``namespace`` cannot get stand-ins (see the module
    docstring), or None when it can."""
    if sys.version_info < (3, 11):
        return "Python < 3.11: a load of a builtin is not marked as a call in the bytecode"
    bound = [name for name in SHADOWED if name in namespace]
    if bound:
        return f"the module binds {bound[0]} itself"
    own = namespace.get("__builtins__", builtins)
    own = vars(own) if isinstance(own, types.ModuleType) else own
    if not isinstance(own, dict) or any(own.get(name) is not getattr(builtins, name) for name in SHADOWED):
        return "the module's builtins are not Python's"
    found = _source_check(namespace)
    if found:
        return found
    return next(filter(None, (_misuse(code, True) for held in _held_code(namespace)
                              for code, _ in _code_objects(held, True))), None)


class BuiltinShadows:
    """The stand-ins of one trace: which modules got them, which were refused and why.

    ``journal`` is the trace's undo journal (``set_item(mapping, key, value)``, undone when the
    trace ends); nothing here outlives the trace."""

    def __init__(self, rec: Any, journal: Any):
        self.rec, self.journal = rec, journal
        self.covered: list[str] = []
        self.refused: dict[str, str] = {}
        self._seen: set[int] = set()
        self._stand_ins = {name: make(rec) for name, make in _STAND_INS.items()}
        for stand_in in self._stand_ins.values():
            stand_in._fxpasses_patch = True  # the trace's own: no assumption reads it

    def cover(self, namespace: dict) -> None:
        """Give the module with globals ``namespace`` the stand-ins, if it can have them."""
        if id(namespace) in self._seen:
            return
        self._seen.add(id(namespace))
        module = str(namespace.get("__name__", "?"))
        why = why_not_shadowed(namespace)
        if why is not None:
            self.refused[module] = why
            return
        for name, stand_in in self._stand_ins.items():
            self.journal.set_item(namespace, name, stand_in)
        self.covered.append(module)
