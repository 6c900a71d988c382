"""One trace in progress: the thread it runs on, what records it, and its one undo journal.

A trace patches objects the whole process shares (torch's factories, ``nn.Module``'s attribute
hooks, user modules' globals), so traces run one at a time: a :class:`TraceSession` holds a
re-entrant process lock from its start to its end (and, as ``optimize()`` does, the module-state
lock of :mod:`fxpasses.runtime.module_state`, so no native call of another thread runs
meanwhile). A trace started on another thread meanwhile waits for it (it would otherwise see
this trace's patches and record nothing: a graph with the other loss's values baked in); a trace
nested on the same thread goes on. Only the session's thread records; another thread's torch
calls, attribute reads and writes run natively.

Everything the trace changes is an entry of the session's :class:`Journal`: an attribute or a
mapping entry set, or a component's own undo (the tracker's writes and container copies, the
modules' state). The journal is undone in reverse when the session ends, however it ends, and
a :meth:`Journal.scope` undoes what was set inside it when the scope ends (the patches that
exist only while the loss runs).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from torch import nn

from ..runtime.module_state import MODULE_STATE
from .objects import ObjectTracker
from .patches import ModulePatcher
from .recorder import Recorder
from .shadows import BuiltinShadows
from .values import recording

_ABSENT = object()
_TRACING = threading.RLock()  # held by the thread whose trace is in progress


class Journal:
    """What a trace changed, undone in reverse (:meth:`undo`)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, undone by restoring (or deleting) the own attribute."""
        previous = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT
        self._undo.append(lambda: _put_attribute(owner, name, previous))
        setattr(owner, name, value)

    def set_item(self, mapping: dict, key: Any, value: Any) -> None:
        """``mapping[key] = value``, undone by restoring (or removing) the entry."""
        previous = mapping.get(key, _ABSENT)
        self._undo.append(lambda: _put_item(mapping, key, previous))
        mapping[key] = value

    def on_undo(self, undo: Callable[[], Any]) -> None:
        """Run ``undo`` when the journal is undone, after everything recorded later."""
        self._undo.append(undo)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """What is recorded inside is undone when the scope ends."""
        mark = len(self._undo)
        try:
            yield
        finally:
            self.undo(mark)

    def undo(self, mark: int = 0) -> None:
        """Undo the entries after the first ``mark``, newest first; every one runs, and the first
        that raised raises again after the last."""
        failure: BaseException | None = None
        while len(self._undo) > mark:
            try:
                self._undo.pop()()
            except BaseException as exc:  # the others must still be undone
                failure = failure or exc
        if failure is not None:
            raise failure


def _put_attribute(owner: Any, name: str, previous: Any) -> None:
    if previous is _ABSENT:
        if name in getattr(owner, "__dict__", {}):  # a class patched twice loses its entry once
            delattr(owner, name)
    else:
        setattr(owner, name, previous)


def _put_item(mapping: dict, key: Any, previous: Any) -> None:
    if previous is _ABSENT:
        mapping.pop(key, None)
    else:
        mapping[key] = previous


class TraceSession:
    """The trace of one loss call in progress (see the module docstring).

    Args:
        root (nn.Module): the module the graph's ``get_attr`` nodes read from.
        density_methods (tuple[str, ...]): methods of submodules kept as one node.
        is_leaf (Callable[[nn.Module], bool]): modules whose call is kept as one node.
    """

    def __init__(self, root: nn.Module, density_methods: tuple[str, ...],
                 is_leaf: Callable[[nn.Module], bool]):
        self.thread = threading.get_ident()
        self.journal = Journal()
        self.recorder = Recorder(root, self.thread)
        self.patcher = ModulePatcher(self.recorder, self.journal, density_methods, is_leaf)
        self.tracker = ObjectTracker(self.recorder, self.journal, on_module=self.patcher)
        self.shadows = BuiltinShadows(self.recorder, self.journal)
        # undone last: the modules' state as met, then what the traced run wrote
        self.journal.on_undo(self.patcher.state.restore)
        self.journal.on_undo(self.tracker.restore)

    def __enter__(self) -> "TraceSession":
        # module state first, as optimize() takes it, so that the two never wait on each other
        self._held = contextlib.ExitStack()
        self._held.enter_context(MODULE_STATE.exclusive())
        _TRACING.acquire()
        self._held.callback(_TRACING.release)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._held:
            self.journal.undo()

    def recording(self) -> contextlib.AbstractContextManager:
        """While inside, the session's recorder and tracker are the ones the carriers and hooks
        find (:func:`~.values.active_session`)."""
        return recording(self)
