"""Native runs never see module state that fxpasses has swapped out for a moment.

Some work puts other tensors in a module's place for its duration: recording a region reads each
parameter through an alias put on the module (:func:`~fxpasses.runtime.capture._reading_state`),
a second-order backward through a region does the same, and a trace runs the loss and its
analyses with their own bookkeeping. A native call running meanwhile in another thread would read
those stand-ins (its parameters' gradients going to an alias: a silent missing gradient).

:data:`MODULE_STATE` is a process-wide shared/exclusive lock: native calls of an OptimizedLoss
hold it *shared*, that work holds it *exclusive*. A thread waits only for work of bounded length
(a native call, a recording, a trace); a thread that already holds it, either way, never waits
for it again, so nested optimized losses cannot deadlock on it. A thread holding it shared cannot
take it exclusive (another thread's native call may be running): :meth:`SharedExclusive.exclusive`
then yields False and the caller does its work without swapping (a region runs eagerly, a trace
is refused) or, where it cannot, proceeds as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class SharedExclusive:
    """A writer-preferring shared/exclusive lock, re-entrant in each thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # shared holds of all threads
        self._owner: int | None = None  # the thread holding it exclusive
        self._depth = 0  # its exclusive holds
        self._waiting = 0  # threads waiting to take it exclusive
        self._local = threading.local()

    def _mine(self) -> int:
        return getattr(self._local, "shared", 0)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Held while a native call runs: waits while another thread holds it exclusive."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me and not self._mine():
                self._cond.wait_for(lambda: self._owner is None and not self._waiting)
            self._shared += 1
        self._local.shared = self._mine() + 1
        try:
            yield
        finally:
            self._local.shared = self._mine() - 1
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Held while module state is swapped: waits for other threads' shared and exclusive
        holds to end. Yields False, holding nothing, in a thread that holds it shared."""
        me = threading.get_ident()
        if self._mine() and self._owner != me:
            yield False
            return
        with self._cond:
            if self._owner != me:
                self._waiting += 1
                try:
                    self._cond.wait_for(lambda: self._owner is None and self._shared == 0)
                finally:
                    self._waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield True
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                self._cond.notify_all()


MODULE_STATE = SharedExclusive()
