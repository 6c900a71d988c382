"""Attribute reads and writes during a trace: every value the loss reads from its state.

An :class:`ObjectTracker` knows a :class:`~.sources.Source` for each object the loss holds (the
loss itself, its submodules, the plain objects they hold, objects passed as arguments, objects in
the globals its functions read). While tracing, the classes of those objects read attributes
through a hook (:meth:`ObjectTracker.hooks`); a read made by user code is *adopted*:

==================  ========================================================================
value read          becomes
==================  ========================================================================
traced value        itself (it was computed in this trace)
parameter, buffer   a ``get_attr`` node of the root module: read live on every call
other tensor        a ``ReadSource`` node (read on every call) + a ``tensor`` assumption
float               a ``ReadSource`` node: an *input*, never a constant + a ``float`` assumption
                    (an attribute, a global, a closure cell; a default argument is a constant)
int, bool, str...   the value + a ``constant`` assumption (it may steer control flow or shapes)
module, object      the object + an ``identity`` assumption; its own reads are tracked in turn
                    (an object of a user class that defines ``__call__`` too: it is no function)
dict, list, ...     the container + a ``contents`` assumption (its items by value or identity);
                    the objects in it are tracked (in globals and closure cells too); a float
                    in a dict or namespace is an input, as an attribute's is (stood in for by
                    a ``ReadSource`` value until the trace ends; compared by type only)
function, class     (a method, a builtin, a callable of a library's class: a partial, a torch op)
                    stored on an object, or named as a global, a cell or a default: an
                    ``identity`` assumption (its code is in the graph); when a function's code
                    runs, its closure cells and default arguments are adopted in turn
missing attribute   ``getattr(obj, name, default)``: an ``absent`` assumption
==================  ========================================================================

A tracked module's children are tracked too, at ``<module source>.<child name>``: a module
reached through ``nn.Sequential`` or ``ModuleList`` iteration (no attribute read names it) has
its reads recorded like any other (replacing a child is the whole-loss ``modules`` guard's).

A write (``self.bs = ...``) becomes a ``WriteAttribute`` node, later reads of it in the same call
return the written value, and the original value is restored when the trace ends. Globals that
user functions executed during the trace refer to are recorded too (:meth:`ObjectTracker.globals_of`).
Only the tracing thread's reads and writes are recorded: another thread's are native.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import functools
import gc
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from ..guards import Assumption, callable_object
from ..locations import is_user_class, is_user_file
from ..ir.trace_ops import ReadSource, WriteAttribute
from .recorder import Recorder, user_location
from ..ir.sources import ArgRoot, Attr, CellRoot, GlobalRoot, LossRoot, Source
from ..snapshots import exact_snapshot, is_container, snapshot
from .values import TracedScalar, TracedTensor, active_session

_CONSTANTS = (bool, int, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
_NOT_DATA = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type,
             types.MethodType, classmethod, staticmethod, property)
# rebinding one changes the code run
_REBINDABLE_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)
_MISSING = object()


_TORCH_MODULES_DIR = os.path.join(os.path.dirname(torch.__file__), "nn", "modules")


def _user_caller(depth: int = 2) -> bool:
    return is_user_file(sys._getframe(depth).f_code.co_filename)


def _recorded_read(obj: Any, name: str, depth: int = 2) -> bool:
    """Reads by user code; and a torch module's own settings read by its forward (``self.p``,
    ``self.negative_slope``), which change results as much as the user's own attributes."""
    path = sys._getframe(depth).f_code.co_filename
    if is_user_file(path):
        return True
    return isinstance(obj, nn.Module) and path.startswith(_TORCH_MODULES_DIR) \
        and not name.startswith("_") and name != "training"


_MADE_BY_THEIR_CALLER = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _cached(value: Any) -> bool:
    """A function or bound method cached by ``functools.lru_cache`` / ``cache``."""
    return type(getattr(value, "__func__", value)) is functools._lru_cache_wrapper


def _immutable(value: Any) -> bool:
    """Nothing a later change to it could make stale: a constant, a float, a tensor (the graph
    holds the very tensor), a function or class (the code it runs is traced), or a tuple or
    frozenset of those."""
    if isinstance(value, (*_CONSTANTS, float, complex, torch.Tensor, *_NOT_DATA)):
        return True
    return type(value) in (tuple, frozenset) and all(_immutable(v) for v in value)


def _is_code(value: Any) -> bool:
    """A function, method, builtin or class, or a callable of a library's class (a
    ``functools.partial``, a torch op): what it runs is code, its identity what a read of it
    assumes. An instance of a user class that defines ``__call__`` is not: it is an object
    like any other, whose reads are followed and whose attributes are guarded."""
    if isinstance(value, _NOT_DATA):
        return True
    return callable(value) and not isinstance(value, nn.Module) and not callable_object(value)


def _holds_traced(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, set)) else ()
    return any(isinstance(item, (TracedTensor, TracedScalar)) for item in items)


class ObjectTracker:
    """The sources of the loss's objects and the assumptions read from them (see module doc)."""

    def __init__(self, recorder: Recorder, journal: Any, on_module: Callable[[nn.Module], None]):
        self.recorder = recorder
        self.journal = journal  # the trace's undo journal: the hooks and stand-ins it installs
        self.on_module = on_module
        self.assumptions: dict[tuple[str, str], Assumption] = {}
        self._inside: dict[tuple[str, str], Assumption] = {}  # read only by calls kept whole
        self._inside_code: dict[Any, tuple[Assumption, ...]] = {}  # code -> its globals' assumptions
        self._sources: dict[int, tuple[Source, Any, fx.Node | None]] = {}
        self._written: dict[tuple[int, str], Any] = {}
        self._restore: list[tuple[Any, str, Any]] = []
        self._restore_items: list[tuple[Any, Any, float, TracedScalar]] = []  # (dict or cell, key, float, input)
        # id(container) -> (its items' holder, a copy of them as first read, where it was read)
        self._container_copies: dict[int, tuple[Any, Any, str]] = {}
        self.written_state: tuple = ()  # tensors of the loss's state the trace wrote (put back)
        self._seen_code: set[Any] = set()
        self._used: dict[int, nn.Module] = {}  # modules the traced code read an attribute of
        # code -> the functions with that code reached through a source (their cells and
        # defaults are read again through them when that code runs)
        self._functions: dict[Any, dict[int, tuple[types.FunctionType, Source]]] = {}
        # mutable objects read from the closure of a function no source reaches (checked when
        # the trace ends: see closure_state_kept)
        self._closed_over: dict[int, tuple[Any, str]] = {}
        self._closures_followed: set[Any] = set()  # codes whose running closure is guarded
        # mutable objects a cached function (functools.lru_cache / cache) named as a global
        # returned: held by the cache, read again by nothing (see cached_state_read)
        self._cached_results: dict[int, tuple[Any, str]] = {}

    # -- sources ----------------------------------------------------------------------------------
    def track(self, obj: Any, source: Source, placeholder: fx.Node | None = None) -> None:
        """Follow ``obj``'s attribute reads; ``placeholder``: the graph input that is ``obj``."""
        if id(obj) in self._sources or isinstance(obj, (torch.Tensor, *_CONSTANTS, float)):
            return
        self._sources[id(obj)] = (source, obj, placeholder)
        cls = type(obj)
        if not isinstance(obj, nn.Module) and is_user_class(cls):
            self._patch_class(cls)
        elif not isinstance(obj, nn.Module) and is_container(obj):  # its reads cannot be followed
            self._contents(obj, source)
        if isinstance(obj, nn.Module):
            if not isinstance(source.root, LossRoot) or source.path:  # the loss module is not its own child
                self.recorder.module_path(obj, _hint(source))
            self.on_module(obj)
            # children reached without an attribute read (nn.Sequential, ModuleList iteration)
            # still have their reads recorded; replacing one is the "modules" guard's to see
            for name, child in obj._modules.items():
                if child is not None:
                    self.track(child, source.attr(name))

    def _reader(self, source: Source) -> tuple[ReadSource, tuple]:
        """A ReadSource for ``source`` and its node inputs (the argument placeholder, if any)."""
        root = source.root
        op_id = "read_" + "".join(c if c.isalnum() else "_" for c in str(source))[:40]
        if isinstance(root, ArgRoot):
            _, _, placeholder = next(v for v in self._sources.values() if v[0] == Source(root))
            return ReadSource(op_id, source.path, str(source)), (placeholder,)
        if isinstance(root, LossRoot):
            return ReadSource(op_id, source.path, str(source), self._loss(), source), ()
        held, steps = root.anchor()  # a global's namespace, a cell
        return ReadSource(op_id, (*steps, *source.path), str(source), held, source), ()

    def _loss(self) -> Any:
        return next(obj for src, obj, _ in self._sources.values()
                    if isinstance(src.root, LossRoot) and not src.path)

    def _assume(self, kind: str, source: Source, expected: Any, shown: str,
                inside: bool = False) -> Assumption:
        """The assumption of ``kind`` at ``source`` (made once). ``inside``: read by a call
        kept whole, an assumption only of the rewrites that rely on that call (the trace's own
        once the traced code reads it too)."""
        key = (kind, str(source))
        found = self.assumptions.get(key) or self._inside.get(key)
        if found is None:
            found = Assumption(kind, source, expected, user_location(), shown[:120])
        if inside:
            self._inside.setdefault(key, found)
        else:
            self.assumptions.setdefault(key, found)
        return found

    # -- reads ------------------------------------------------------------------------------------
    def read(self, obj: Any, name: str, value: Any) -> Any:
        entry = self._sources.get(id(obj))
        if entry is None or entry[1] is not obj:
            return value  # an object made during this trace
        if isinstance(obj, nn.Module):
            self._used[id(obj)] = obj
        if (id(obj), name) in self._written:
            return self._written[(id(obj), name)]
        return self.adopt(value, entry[0].attr(name), instance=name in getattr(obj, "__dict__", {}))

    def absent(self, obj: Any, name: str) -> None:
        entry = self._sources.get(id(obj))
        if entry is not None and entry[1] is obj and (id(obj), name) not in self._written:
            self._assume("absent", entry[0].attr(name), None, "missing")

    def adopt(self, value: Any, source: Source, instance: bool = True) -> Any:
        """``value`` read at ``source``, as the trace should see it (see the module table)."""
        rec = self.recorder
        if isinstance(value, (TracedTensor, TracedScalar)):
            return value
        if isinstance(value, torch.Tensor):
            state = rec.state_node(value)
            if state is not None:  # a parameter or buffer: read live on every call
                return rec.wrap(value, state)
            self._assume("tensor", source, (value.dtype, value.device.type, value.dim()),
                         f"{value.dtype} on {value.device.type}, {value.dim()}-d")
            read, given = self._reader(source)
            return rec.read_source(read, given, value)
        if type(value) is float:
            self._assume("float", source, None, repr(value))
            read, given = self._reader(source)
            return rec.read_source(read, given, value)
        if isinstance(value, _CONSTANTS):
            self._assume("constant", source, value, repr(value))
            return value
        if _is_code(value):
            if getattr(value, "_fxpasses_patch", False):  # the trace's own stand-in
                return value
            if instance and not isinstance(value, type):  # a function stored on the object
                self._assume("identity", source, value, getattr(value, "__qualname__", repr(value)))
                self._register_function(value, source)
            if _cached(value):  # a cached method: what it returns is kept (cached_state_read)
                return self._cached_stand_in(value, str(source))
            return value
        if is_container(value):
            self._container(value, source)
            return value
        self._assume("identity", source, value, type(value).__qualname__)
        self.track(value, source)
        return value

    # -- inside a call kept whole -------------------------------------------------------------------
    def read_inside(self, obj: Any, name: str, value: Any) -> None:
        """A read by the code of a call kept whole (its value is not traced: the graph calls
        that code, which reads it live): recorded for the rewrites that rely on the call."""
        entry = self._sources.get(id(obj))
        if entry is None or entry[1] is not obj or (id(obj), name) in self._written:
            return
        found = self._inside_value(entry[0].attr(name), value,
                                   code=name in getattr(obj, "__dict__", {}))
        if found is not None:
            self.recorder.kept_whole.reads.append(found)

    def absent_inside(self, obj: Any, name: str) -> None:
        entry = self._sources.get(id(obj))
        if entry is not None and entry[1] is obj and (id(obj), name) not in self._written:
            self.recorder.kept_whole.reads.append(
                self._assume("absent", entry[0].attr(name), None, "missing", inside=True))

    def write_inside(self, obj: Any, name: str) -> None:
        """A write by the code of a call kept whole to the loss's state (``self.calls += 1``):
        running that code another number of times would change what it leaves behind."""
        entry = self._sources.get(id(obj))
        if entry is not None and entry[1] is obj:
            self.recorder.kept_whole.writes.append(f"{entry[0].attr(name)} at {user_location()}")

    def frame_state_inside(self, frame: types.FrameType) -> None:
        """The globals a user function run by a call kept whole refers to."""
        code = frame.f_code
        if code not in self._inside_code:
            found = [self._inside_value(Source(GlobalRoot(frame.f_globals, name)),
                                        frame.f_globals[name], code=True)
                     for name in code.co_names if name in frame.f_globals]
            self._inside_code[code] = tuple(a for a in found if a is not None)
        self.recorder.kept_whole.reads.extend(self._inside_code[code])

    def _inside_value(self, source: Source, value: Any, code: bool) -> Assumption | None:
        """What a read inside a call kept whole assumes: every plain value by value, floats
        included (they may steer its control flow); a container's contents with floats by
        value; a function or class by identity where ``code`` (stored on the object, or a
        global); an object by identity, its own reads followed; parameters and buffers nothing
        (read live)."""
        if getattr(value, "_fxpasses_patch", False) or isinstance(value, (TracedTensor, TracedScalar)):
            return None
        if isinstance(value, torch.Tensor):
            if self.recorder.is_state(value):
                return None
            return self._assume("tensor", source, (value.dtype, value.device.type, value.dim()),
                                f"{value.dtype} on {value.device.type}, {value.dim()}-d", inside=True)
        if isinstance(value, (*_CONSTANTS, float)):
            return self._assume("constant", source, value, repr(value), inside=True)
        if isinstance(value, types.ModuleType) or value is builtins:
            return None
        if isinstance(value, _NOT_DATA) or callable(value) and not isinstance(value, nn.Module):
            if not code:
                return None  # a method of the object's class: the whole-loss methods guard's
            return self._assume("identity", source, value, getattr(value, "__qualname__", repr(value)),
                                inside=True)
        if is_container(value):
            self._track_items(value, source, depth=4)
            return self._assume("held", source, exact_snapshot(value), _shown(value), inside=True)
        found = self._assume("identity", source, value, type(value).__qualname__, inside=True)
        self.track(value, source)
        return found

    # -- writes -----------------------------------------------------------------------------------
    def write(self, obj: Any, name: str, value: Any) -> None:
        entry = self._sources.get(id(obj))
        if entry is None or entry[1] is not obj:
            return
        key = (id(obj), name)
        if key not in self._written:
            self._restore.append((obj, name, obj.__dict__.get(name, _MISSING)
                                  if not isinstance(obj, nn.Module) else _module_value(obj, name)))
        self._written[key] = value
        source, _, placeholder = entry
        rec = self.recorder
        if isinstance(obj, nn.Module):
            owner = rec.get_attr(rec.module_path(obj))
        elif placeholder is not None:
            owner = placeholder
        else:
            read, given = self._reader(source)
            owner = rec.node("call_function", read, given)
        rec.node("call_function", WriteAttribute(f"write_{name}", name), (owner, rec.arg(value)))

    def restore(self) -> None:
        """Put back every attribute the trace wrote (the graph writes them on each call), every
        float that an input stood in for, the contents of every container the loss wrote into
        (:meth:`container_writes`) and the values of the tensors it read from its state and
        wrote in place (the first call makes its writes once). An entry of the trace's journal
        (:mod:`.session`), which undoes the hooks and stand-ins itself."""
        self._put_back_floats()
        for held, kept, _ in self._container_copies.values():
            if not _same_items(held, kept):
                _put_back(held, kept)
        self.written_state = self.recorder.put_back()
        for obj, name, old in reversed(self._restore):
            if old is _MISSING:
                object.__delattr__(obj, name) if name in getattr(obj, "__dict__", {}) else None
            elif isinstance(obj, nn.Module):
                nn.Module.__setattr__(obj, name, old)
            else:
                object.__setattr__(obj, name, old)

    # -- globals of executed user functions -------------------------------------------------------
    def globals_of(self, code: types.CodeType, f_globals: dict) -> None:
        """Record the globals ``code`` refers to (constants, containers, objects, tensors)."""
        if code in self._seen_code:
            return
        self._seen_code.add(code)
        for name in code.co_names:
            if name in f_globals:
                self._global(f_globals, name)
                if _cached(f_globals[name]):
                    self._watch_cached_call(f_globals, name)

    def _watch_cached_call(self, f_globals: dict, name: str) -> None:
        """A cached function named as a global: for the trace, its stand-in
        (:meth:`_cached_stand_in`), an entry of the journal."""
        self.journal.set_item(f_globals, name, self._cached_stand_in(f_globals[name], name))

    def _cached_stand_in(self, cached: Callable, name: str) -> Callable:
        """A callable that calls ``cached`` and keeps what it returns when that is mutable and
        no source reaches it (:meth:`cached_state_read`)."""
        tracker = self

        @functools.wraps(cached)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = cached(*args, **kwargs)
            entry = tracker._sources.get(id(result))
            if not _immutable(result) and (entry is None or entry[1] is not result):
                tracker._cached_results.setdefault(
                    id(result), (result, f"the result of {name}() ({user_location()})"))
            return result

        call._fxpasses_patch = True
        return call

    def cached_state_read(self) -> list[str]:
        """Where the loss took a mutable object from a cached call (a settings object from an
        ``lru_cache``'d getter): the cache holds it and no source reaches it, so a value read
        from it would be a constant of the graph and its later change unseen: the trace must
        be refused. A call returning numbers, strings, tensors, functions or tuples of those
        passes (a function's closure is checked when it runs: :meth:`closure_state_kept`)."""
        found = [where for _, where in self._cached_results.values()]
        self._cached_results.clear()
        return found

    def frame_state(self, frame: types.FrameType) -> None:
        """What a user function the trace runs reads besides its arguments: its globals, and
        its default arguments where the function can be read again (a module-level function
        by its name, a method through its tracked ``self``)."""
        code = frame.f_code
        if code.co_freevars and code not in self._closures_followed and code not in self._functions:
            self._unsourced_closure(frame)
        if code in self._seen_code:
            return
        self.globals_of(code, frame.f_globals)
        for function, source in list(self._functions.get(code, {}).values()):
            self._adopt_function_state(function, source)  # reached through a source
        if code.co_name in frame.f_globals:
            function = frame.f_globals[code.co_name]
            source = Source(GlobalRoot(frame.f_globals, code.co_name))
        else:
            owner = frame.f_locals.get("self") if code.co_argcount else None
            entry = self._sources.get(id(owner))
            if entry is None or entry[1] is not owner:
                return
            function = getattr(type(owner), code.co_name, None)
            source = entry[0].attr(code.co_name)
        if getattr(function, "__code__", None) is code:
            self.adopt_defaults(function, source)

    def _unsourced_closure(self, frame: types.FrameType) -> None:
        """A running function that no source reaches (one a call returned, say): its closure
        cannot be read again at the next call. The mutable objects it holds there (containers,
        user objects, modules) that the trace does not follow are kept for
        :meth:`closure_state_kept`."""
        code = frame.f_code
        if code.co_name in _MADE_BY_THEIR_CALLER:  # made afresh by the frame that runs them
            return
        values = frame.f_locals
        for name in code.co_freevars:
            value = values.get(name)
            if id(value) in self._sources or isinstance(value, (TracedTensor, TracedScalar)) or \
                    _holds_traced(value):  # the call's own values (its inputs, its results)
                continue
            if isinstance(value, (dict, list, set, types.SimpleNamespace, nn.Module)) or (
                    dataclasses.is_dataclass(value) and not isinstance(value, type)) or (
                    is_user_class(type(value)) and not isinstance(value, _REBINDABLE_CODE)):
                where = f"closure variable {name!r} of {code.co_name} ({code.co_filename}:{code.co_firstlineno})"
                self._closed_over.setdefault(id(value), (value, where))

    def closure_state_kept(self) -> list[str]:
        """Where a function no source reaches read a mutable object from its closure that
        outlives the trace (a cached helper's settings, say): its later changes could not be
        seen, so the trace must be refused. An object made during the trace and dropped with
        its frames (a list an inner function appends to) is no state and passes. Call when the
        loss has returned."""
        if not self._closed_over:
            return []
        kept = self._outliving()
        if kept:
            gc.collect()  # closures in reference cycles (the trace runs with collection off)
            kept = self._outliving()
        self._closed_over.clear()
        return kept

    def _outliving(self) -> list[str]:
        # referrers besides this tracker's tuple, the loop variable and getrefcount's argument
        return [where for value, where in self._closed_over.values() if sys.getrefcount(value) > 3]

    def _register_function(self, value: Any, source: Source) -> None:
        """A Python function reached through ``source``: when its code runs (or has run), its
        closure cells and default arguments are read again through it on every call."""
        function = value.__func__ if isinstance(value, types.MethodType) else value
        if not isinstance(function, types.FunctionType) or getattr(function, "_fxpasses_patch", False):
            return
        self._functions.setdefault(function.__code__, {})[id(function)] = (function, source)
        if function.__code__ in self._seen_code:
            self._adopt_function_state(function, source)

    def _adopt_function_state(self, function: types.FunctionType, source: Source) -> None:
        """``function``'s default arguments (through ``source``) and closure cells (each cell is
        fixed for the function's life; the function's own identity is guarded at ``source``)."""
        self.adopt_defaults(function, source)
        self.adopt_closure(function)

    def adopt_defaults(self, function: Any, source: Source) -> None:
        """``function``'s default arguments, read again through ``source`` (the function, or a
        bound method of it): guarded like globals."""
        for i, value in enumerate(function.__defaults__ or ()):
            self._outside_value(source.attr("__defaults__").item(i), value)
        for name, value in (function.__kwdefaults__ or {}).items():
            self._outside_value(source.attr("__kwdefaults__").item(name), value)

    def _global(self, f_globals: dict, name: str) -> None:
        self._outside_value(Source(GlobalRoot(f_globals, name)), f_globals[name])

    def adopt_closure(self, function: types.FunctionType) -> None:
        """``function``'s closure cells (the loss function's, or one's a source reaches): each
        cell is fixed for the function's life, its contents guarded like a global."""
        self._closures_followed.add(function.__code__)
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self._outside_value(Source(CellRoot(cell, name)), value)

    def adopt_bound(self, source: Source, value: Any) -> None:
        """A value bound to the loss's function before the call (a default argument, an argument
        or keyword of a ``functools.partial``), readable again at ``source``: guarded like a
        global."""
        self._outside_value(source, value)

    def _outside_value(self, source: Source, value: Any) -> None:
        """A global or a closure cell: constants, tensors and containers guarded, objects tracked
        (their attribute reads are recorded in turn)."""
        if getattr(value, "_fxpasses_patch", False):  # a leaf function's stand-in: the original is bound
            value = getattr(value, "__wrapped__", value)
        if isinstance(value, _REBINDABLE_CODE) and not getattr(value, "_fxpasses_patch", False):
            # a function, method or class the traced code names: its code is in the graph
            self._assume("identity", source, value, getattr(value, "__qualname__", repr(value)))
            self._register_function(value, source)
            return
        if isinstance(value, _NOT_DATA) or value is builtins or isinstance(value, (TracedTensor, TracedScalar)):
            return
        root = source.root
        if type(value) is float and isinstance(root, (GlobalRoot, CellRoot)) and not source.path:
            self._assume("float", source, None, repr(value))  # an input, as an attribute's is
            if isinstance(root, GlobalRoot):
                self._stand_in(root.namespace, root.global_name, value, source)
            else:
                self._stand_in(root.cell, None, value, source)
        elif isinstance(value, (_CONSTANTS, float)):
            self._assume("constant", source, value, repr(value))
        elif isinstance(value, torch.Tensor):
            self._assume("identity", source, value, f"tensor {tuple(value.shape)}")
            self.recorder.keep(value, str(source), followed=False)
        elif is_container(value):
            self._container(value, source)
        else:  # an object, callable or not (a partial, an instance with __call__): its reads too
            self._assume("identity", source, value, type(value).__qualname__)
            self.track(value, source)
            if isinstance(value, functools.partial):  # its bound arguments reach the code it runs
                self._register_function(value.func, source.attr("func"))
                for i, arg in enumerate(value.args):
                    self._outside_value(source.attr("args").item(i), arg)
                for name, arg in value.keywords.items():
                    self._outside_value(source.attr("keywords").item(name), arg)

    def _container(self, value: Any, source: Source) -> None:
        """A container read: its contents guarded (items by value or identity), and the objects
        and modules in it tracked, so that what the trace reads from them is recorded too."""
        self._contents(value, source)
        self._track_items(value, source, depth=4)  # as deep as the snapshot compares

    def _put_back_floats(self) -> None:
        for held, key, seen, traced in reversed(self._restore_items):
            if key is None and held.cell_contents is traced:
                held.cell_contents = seen
            elif key is not None and dict.get(held, key) is traced:
                dict.__setitem__(held, key, seen)

    def container_writes(self) -> list[str]:
        """Where the loss wrote into a container it read (an item set, deleted or appended, an
        input's stand-in replaced): the graph cannot record such writes, so the trace must be
        refused (:meth:`restore` undoes them). Ends the floats' stand-ins."""
        self._put_back_floats()
        return [where for held, kept, where in self._container_copies.values() if not _same_items(held, kept)]

    def _keep_contents(self, value: Any, where: str, depth: int = 4) -> None:
        """A shallow copy of a container and of those in it, as deep as a snapshot compares."""
        if depth <= 0 or id(value) in self._container_copies:
            return
        held = vars(value) if isinstance(value, types.SimpleNamespace) or (
            dataclasses.is_dataclass(value) and hasattr(value, "__dict__")) else value
        if isinstance(held, dict):
            kept: Any = dict(dict.items(held))
        elif isinstance(held, list):
            kept = list.copy(held)
        elif isinstance(held, set):
            kept = set.copy(held)
        elif isinstance(held, (tuple, frozenset)):
            kept = None
        else:
            return
        if kept is not None:
            self._container_copies[id(value)] = (held, kept, where)
        for item in (held.values() if isinstance(held, dict) else held):
            if is_container(item):
                self._keep_contents(item, where, depth - 1)
            elif isinstance(item, torch.Tensor):  # read as a constant: a write to it is no node
                self.recorder.keep(item, where, followed=False)

    def _contents(self, value: Any, source: Source) -> None:
        """A ``contents`` assumption; and each float a dict or namespace in it holds becomes an
        input: replaced, until the trace ends, by a value the graph reads at its source on every
        call (a dict or namespace item cannot be followed as an attribute read is)."""
        self._keep_contents(value, str(source))
        floats: list = []
        expected = snapshot(value, floats=floats)
        inputs = ", ".join("".join(map(str, path)) for path, _, _ in floats)
        self._assume("contents", source, expected,
                     f"floats read on every call: {inputs}; {_shown(value)}" if inputs else _shown(value))
        for path, owner, key in floats:
            held = vars(owner) if isinstance(owner, types.SimpleNamespace) else owner
            seen = dict.__getitem__(held, key)
            if type(seen) is not float:  # already an input (reached before)
                continue
            where = Source(source.root, (*source.path, *path))
            self._stand_in(held, key, seen, where)

    def _stand_in(self, held: Any, key: Any, seen: float, source: Source) -> None:
        """Until the trace ends, ``held[key]`` (a dict's item; a cell's contents when ``key`` is
        None) is the graph's read of ``source``: what reads it is computed from it."""
        read, given = self._reader(source)
        traced = self.recorder.read_source(read, given, seen)
        if key is None:
            held.cell_contents = traced
        else:
            dict.__setitem__(held, key, traced)
        self._restore_items.append((held, key, seen, traced))

    def _track_items(self, value: Any, source: Source, depth: int) -> None:
        for key, item in _items(value):
            where = source.attr(key) if _by_attribute(value) else source.item(key)
            if is_container(item):
                if depth > 1:
                    self._track_items(item, where, depth - 1)
            elif isinstance(item, _REBINDABLE_CODE):  # its identity is in the container's snapshot
                self._register_function(item, where)
            elif not isinstance(item, (torch.Tensor, *_CONSTANTS, float)):
                self.track(item, where)

    def used_modules(self) -> list[nn.Module]:
        """Every module the traced code read an attribute of (``forward`` included, which a
        module's call reads): those whose hooks, methods and modes the trace depends on."""
        return list(self._used.values())

    # -- the hooks --------------------------------------------------------------------------------
    def _patch_class(self, cls: type) -> None:
        if getattr(cls.__getattribute__, "_fxpasses_hook", False):
            return
        self._install(cls, "__getattribute__", _getattribute_hook(cls.__getattribute__))
        self._install(cls, "__setattr__", _setattr_hook(cls.__setattr__))

    def _install(self, cls: type, name: str, hook: Any) -> None:
        self.journal.set(cls, name, hook)

    @contextlib.contextmanager
    def hooks(self) -> Iterator["ObjectTracker"]:
        """nn.Module's attribute access through the tracker while inside (user classes are
        patched as their objects are tracked); what was installed inside is undone on exit."""
        with self.journal.scope():
            self._install(nn.Module, "__getattribute__", _getattribute_hook(object.__getattribute__))
            self._install(nn.Module, "__getattr__", _module_getattr_hook(nn.Module.__getattr__))
            self._install(nn.Module, "__setattr__", _setattr_hook(nn.Module.__setattr__))
            yield self


def _tracker() -> ObjectTracker | None:
    """The tracker of the trace in progress, for a read or write made on the thread that runs
    it; None otherwise (another thread's access is native and unrecorded)."""
    session = active_session()
    if session is None or session.recorder.paused or session.thread != threading.get_ident():
        return None
    return session.tracker


def _inside() -> ObjectTracker | None:
    """The tracker while the code of a call kept whole runs (its reads are recorded, not traced);
    None while torch.compile traces that code (what it compiles is its own to guard)."""
    session = active_session()
    if session is None or session.recorder.kept_whole is None \
            or session.thread != threading.get_ident() or torch.compiler.is_compiling():
        return None
    return session.tracker


def _getattribute_hook(original: Any) -> Any:
    def __getattribute__(obj, name):
        try:
            value = original(obj, name)
        except AttributeError:
            tracker = _tracker()
            if tracker is not None and name[:2] != "__" and not isinstance(obj, nn.Module) \
                    and _user_caller():
                tracker.absent(obj, name)
            elif tracker is None and name[:2] != "__" and not isinstance(obj, nn.Module) \
                    and (inside := _inside()) is not None and _user_caller():
                inside.absent_inside(obj, name)
            raise
        if name[:2] == "__":
            return value
        return _read(obj, name, value)

    __getattribute__._fxpasses_hook = True
    return __getattribute__


def _module_getattr_hook(original: Any) -> Any:
    def __getattr__(module, name):
        try:
            value = original(module, name)
        except AttributeError:
            tracker = _tracker()
            if tracker is not None and _user_caller():
                tracker.absent(module, name)
            elif tracker is None and (inside := _inside()) is not None and _user_caller():
                inside.absent_inside(module, name)
            raise
        return _read(module, name, value)

    return __getattr__


def _read(obj: Any, name: str, value: Any) -> Any:
    """An attribute read the hooks saw: recorded by the trace (or, inside a call kept whole,
    as that call's read) when user code made it; the value the caller gets."""
    tracker = _tracker()
    if tracker is None:
        inside = _inside()
        if inside is not None and _recorded_read(obj, name, depth=3):
            inside.read_inside(obj, name, value)
        return value
    if not _recorded_read(obj, name, depth=3):
        return value
    return tracker.read(obj, name, value)


def _setattr_hook(original: Any) -> Any:
    def __setattr__(obj, name, value):
        tracker = _tracker()
        if tracker is not None and _user_caller():
            tracker.write(obj, name, value)
        elif tracker is None and (inside := _inside()) is not None and _recorded_read(obj, name):
            inside.write_inside(obj, name)
        original(obj, name, value)

    return __setattr__


def _same_items(held: Any, kept: Any) -> bool:
    """Whether ``held`` holds the very objects ``kept`` (a copy made before) holds."""
    if isinstance(held, dict):
        return len(held) == len(kept) and all(
            k in kept and v is kept[k] for k, v in dict.items(held)) and list(held) == list(kept)
    if isinstance(held, list):
        return len(held) == len(kept) and all(a is b for a, b in zip(held, kept))
    return held == kept  # a set


def _put_back(held: Any, kept: Any) -> None:
    if isinstance(held, dict):
        dict.clear(held)
        dict.update(held, kept)
    elif isinstance(held, list):
        list.__setitem__(held, slice(None), kept)
    else:
        set.clear(held)
        set.update(held, kept)


def _module_value(module: nn.Module, name: str) -> Any:
    for store in (module.__dict__, module._parameters, module._buffers, module._modules):
        if name in store:
            return store[name]
    return _MISSING


def _items(value: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    if isinstance(value, types.SimpleNamespace):
        return iter(vars(value).items())
    if isinstance(value, (list, tuple)):
        return iter(enumerate(value))
    if dataclasses.is_dataclass(value):
        return iter((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    return iter(())


def _by_attribute(value: Any) -> bool:
    """Whether a container's items are read as attributes (else by key or index)."""
    return isinstance(value, types.SimpleNamespace) or dataclasses.is_dataclass(value)


def _hint(source: Source) -> str:
    """A name for a module found at ``source``: its attribute name, or the global's or cell's."""
    if source.path:
        last = source.path[-1]
        return str(last.name if isinstance(last, Attr) else last.key)
    return source.root.name


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
