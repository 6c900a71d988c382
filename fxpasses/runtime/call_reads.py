"""The reads of the loss's state that the optimized call in progress rests on, for work that
runs after the call has returned.

A second-order backward recomputes a captured region eagerly (``double-backward-eager``): the
code kept whole inside it (a paired flow call) reads the loss's state again, a flag perhaps
changed since the forward. The call's specialization checked those reads before the call; the
region keeps the check (:func:`current`) and runs it again before recomputing: a change raises
:class:`StateChangedError` instead of giving gradients of code the forward did not run.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from ..certificates.codes import note

_CURRENT = threading.local()  # .changed: the check of the call in progress on this thread


@contextlib.contextmanager
def relied_reads(changed: Callable[[], Any]) -> Iterator[None]:
    """Inside, :func:`current` is ``changed``: it returns the first read that no longer holds
    (an assumption), or None."""
    previous = getattr(_CURRENT, "changed", None)
    _CURRENT.changed = changed
    try:
        yield
    finally:
        _CURRENT.changed = previous


def current() -> Callable[[], Any] | None:
    return getattr(_CURRENT, "changed", None)


class StateChangedError(RuntimeError):
    """A second-order backward reached a captured region after a value its code reads changed."""

    code = "double-backward-state-changed"

    def __init__(self, message: str):
        super().__init__(message)
        note(self.code)
