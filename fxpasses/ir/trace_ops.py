"""What a concretely traced graph calls besides torch: guards, reads of the loss's state, writes.

* :class:`ExpectValue`, :class:`ExpectTruth`, :class:`ExpectLength`: a value Python took during
  tracing (a size turned into an int, ``if mask.any():``, the length of a split) is the same in
  this call (:class:`ExpectEqualSizes`: two sizes a pass took to be equal are), else the call is
  abandoned (:class:`~fxpasses.ir.abandon.Abandon`, code ``guard-failed``) and runs natively.
  Counted per guard.
* :class:`ReadSource`: a value read on every call from the loss's state (a float weight decayed
  each epoch, a tensor attribute): an input of the graph, never a baked constant.
* :class:`ReadState`: a parameter or buffer, read live from the module holding it.
* :class:`WriteAttribute`: an attribute the loss writes during a call (``self.bs = ...``); inside
  :func:`undone_on_failure` the value it replaced is kept, and put back if the call is
  abandoned or raises (its native run then makes the write once, as the loss would).
* :func:`set_item`: ``x[index] = value`` as an expression (it returns ``x``), so the nodes after
  it depend on it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch import nn

from .runtime_op import RuntimeOp
from .sources import Step, read_path
from .abandon import Abandon

_MISSING = object()
_WRITES = threading.local()  # .log: the (owner, name, replaced value) of the call in progress


def set_item(tensor: Any, index: Any, value: Any) -> Any:
    tensor[index] = value
    return tensor


class GuardOp(RuntimeOp):
    """A check of a value Python took while tracing; a failure abandons the call.
    ``reads_values``: it reads a tensor's data on the host (a length does not)."""

    pure = True
    grad_free = True
    reads_values = True

    def __init__(self, op_id: str, expected: Any, location: str):
        super().__init__(op_id)
        self.expected = expected
        self.location = location

    def propagate(self, value: Any) -> None:
        return None

    def structure(self) -> Any:
        return (type(self), self.expected)

    def _fail(self, seen: Any) -> None:
        self.count_code("guard-failed")
        raise Abandon("guard-failed", self.location, f"{self.op_id}: traced {self.expected!r}, now {seen!r}")


class ExpectValue(GuardOp):
    """The value (a size, an ``.item()``, a comparison) equals the one seen while tracing."""

    def __call__(self, value: Any) -> None:
        if value != self.expected:
            self._fail(value)


class ExpectTruth(GuardOp):
    """``bool(tensor)`` (a host read, as the loss's own ``if`` does) is the one seen."""

    def __call__(self, value: Any) -> None:
        seen = bool(value)
        if seen != self.expected:
            self._fail(seen)


class ExpectLength(GuardOp):
    """A sequence an op returned (``unbind``, ``split``) has the length seen while tracing."""

    reads_values = False

    def __call__(self, value: Any) -> None:
        if len(value) != self.expected:
            self._fail(len(value))


class ExpectEqualSizes(GuardOp):
    """Two sizes read from the metadata of two inputs (the two branches' predictions' batch
    dims) are equal, as they were when a pass chose to compute with one of them for both."""

    reads_values = False

    def __init__(self, op_id: str, location: str):
        super().__init__(op_id, True, location)

    def propagate(self, first: Any, second: Any) -> None:
        return None

    def __call__(self, first: Any, second: Any) -> None:
        if first != second:
            self._fail(f"{first} != {second}")


class ExpectSameObject(ExpectEqualSizes):
    """Two reads of the loss's state (each branch's ``self.stride``) give the same object, as
    they did when a pass chose to compute with one of them for both."""

    def __call__(self, first: Any, second: Any) -> None:
        if first is not second:
            self._fail("another object")


class ReadSource(RuntimeOp):
    """``op()`` or ``op(root)``: the value at ``path`` under ``root`` (an argument of the call,
    or the object the op holds: the loss, a module's globals, a closure cell), read on this call.
    ``source``: where guards read it again (:class:`~fxpasses.tracing.sources.Source`; None for
    an argument's field, which is no state of the loss)."""

    pure = True
    grad_free = True

    def __init__(self, op_id: str, path: tuple[Step, ...], shown: str, root: Any = None,
                 source: Any = None):
        super().__init__(op_id)
        self.path = path
        self.shown = shown
        self.root = root
        self.source = source

    def __call__(self, *given: Any) -> Any:
        return read_path(given[0] if given else self.root, self.path)

    def propagate(self, *given: Any) -> Any:
        return self(*given)


class ReadState(RuntimeOp):
    """``op()``: a parameter or buffer, read from the module that holds it on this call (so a
    buffer that ``module.to(...)`` or an assignment rebinds is seen, never a stale copy)."""

    pure = True
    grad_free = True

    def __init__(self, op_id: str, module: Any, name: str):
        super().__init__(op_id)
        self.module = module
        self.name = name

    def __call__(self) -> Any:
        return getattr(self.module, self.name)

    def propagate(self) -> Any:
        return self()


class WriteAttribute(RuntimeOp):
    """``op(owner, value)``: ``setattr(owner, name, value)``, as the loss does on each call."""

    grad_free = True

    def __init__(self, op_id: str, name: str):
        super().__init__(op_id)
        self.name = name

    def __call__(self, owner: Any, value: Any) -> None:
        log = getattr(_WRITES, "log", None)
        if log is not None:
            log.append((owner, self.name, _held(owner, self.name)))
        setattr(owner, self.name, value)

    def propagate(self, owner: Any, value: Any) -> None:
        return None


def _held(owner: Any, name: str) -> Any:
    """What ``owner`` itself holds at ``name`` (not a class's default), or ``_MISSING``."""
    if isinstance(owner, nn.Module):
        for store in (owner._parameters, owner._buffers, owner._modules):
            if name in store:
                return store[name]
    return getattr(owner, "__dict__", {}).get(name, _MISSING)


@contextlib.contextmanager
def undone_on_failure() -> Iterator[None]:
    """The attribute writes made inside, put back in reverse order if it raises (an abandoned
    call, a failed one): the native run that follows must find the state the call found, or a
    running value updated before a guard (``self.ema = 0.9 * self.ema + ...``) is updated twice."""
    previous, log = getattr(_WRITES, "log", None), []
    _WRITES.log = log
    try:
        yield
    except BaseException:
        for owner, name, held in reversed(log):
            if held is _MISSING:
                if _held(owner, name) is not _MISSING:  # a module's submodule slot too
                    delattr(owner, name)
            else:
                setattr(owner, name, held)
        raise
    finally:
        _WRITES.log = previous
