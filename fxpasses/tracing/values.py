"""The carriers of a concrete trace: real values that also name the graph node computing them.

* :class:`TracedTensor` is a ``torch.Tensor`` subclass (made with ``as_subclass``: the same memory
  and autograd history as the real tensor), so ``isinstance(x, torch.Tensor)`` holds and Python
  sees real values. Its ``__torch_function__`` hands every torch call to the active recorder.
* :class:`TracedScalar` is a size, a count or a float input: it behaves as a number in arithmetic
  (each operation is a node) and turns into a plain Python value — with a guard that the value is
  the one seen — where Python needs one (``bool``, ``int``, ``range``, formatting, hashing, a
  method of the number such as ``n.bit_length()``).
  It is deliberately *not* an ``int`` subclass: CPython reads an int subclass's value directly
  (``range``, indexing, numpy), which no guard would see.
* :class:`TracedSize` is the tuple of TracedScalars that ``x.shape`` returns.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx

from ..ir.carriers import ScalarCarrier

# the sessions of the traces in progress, innermost last: all on the one thread that may trace
# now (a session holds the process's trace lock: :mod:`.session`)
_in_progress: list[Any] = []


def active_session() -> Any:
    """The innermost trace in progress (a :class:`~.session.TraceSession`), or None."""
    return _in_progress[-1] if _in_progress else None


def active_recorder() -> Any:
    """The recorder of the innermost trace in progress, or None."""
    return _in_progress[-1].recorder if _in_progress else None


@contextlib.contextmanager
def recording(session: Any) -> Iterator[None]:
    """``session`` is the active trace inside (the innermost, for nested traces)."""
    _in_progress.append(session)
    try:
        yield
    finally:
        _in_progress.pop()


class TracedTensor(torch.Tensor):
    """A real tensor that also names its graph node (``_fx_node``); see the module docstring."""

    _fx_node: fx.Node

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        recorder = active_recorder()
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():  # the recorder's own tensor calls: plain
            if recorder is None or recorder.paused or recorder.busy:
                return func(*args, **kwargs)
            if recorder.thread != threading.get_ident():  # another thread: native, unrecorded
                return func(*recorder.real(args), **recorder.real(kwargs))
            return recorder.torch_function(func, args, kwargs)


def _intercepted(method: Any) -> Any:
    """``x.<method>(...)`` handed to the recorder *before* torch's argument parser runs: the
    parser would turn a TracedScalar argument into an int (a guard) that the node does not need."""
    def call(self, *args, **kwargs):
        recorder = active_recorder()
        if recorder is None or recorder.paused or recorder.busy:
            return method(self, *args, **kwargs)
        return TracedTensor.__torch_function__(method, (TracedTensor,), (self, *args), kwargs)
    call.__name__ = getattr(method, "__name__", "method")
    return call


_NOT_INTERCEPTED = frozenset("""__delattr__ __getattribute__ __getstate__ __init__ __init_subclass__
    __new__ __reduce__ __reduce_ex__ __setattr__ __sizeof__ __subclasshook__ __torch_dispatch__
    __torch_function__ __setstate__ __hash__ __dir__ __class__ as_subclass""".split())
for _name in dir(torch.Tensor):
    _method = getattr(torch.Tensor, _name, None)
    if _name not in _NOT_INTERCEPTED and type(_method).__name__ in ("method_descriptor", "wrapper_descriptor"):
        setattr(TracedTensor, _name, _intercepted(_method))


def _binary(op):
    def forward(self, other):
        if isinstance(other, torch.Tensor):
            return NotImplemented  # the tensor's reflected method records the call
        return self.recorder.scalar_op(op, self, other)

    def reflected(self, other):
        if isinstance(other, torch.Tensor):
            return NotImplemented
        return self.recorder.scalar_op(op, other, self)

    return forward, reflected


class TracedScalar(ScalarCarrier):
    """A number known at trace time that the graph computes at run time (see module docstring)."""

    __slots__ = ("value", "node", "recorder")

    def __init__(self, value: Any, node: fx.Node, recorder: Any):
        self.value, self.node, self.recorder = value, node, recorder

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # a torch call with a traced number among its arguments (``tensor * weight``): torch's
        # argument parser treats any object with this method as tensor-like and dispatches here
        return TracedTensor.__torch_function__.__func__(cls, func, types, args, kwargs)

    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __eq__, _ = _binary(operator.eq)
    __ne__, _ = _binary(operator.ne)
    __lt__, __gt__ = _binary(operator.lt)[0], _binary(operator.gt)[0]
    __le__, __ge__ = _binary(operator.le)[0], _binary(operator.ge)[0]

    def __neg__(self):
        return self.recorder.scalar_op(operator.neg, self)

    def __pos__(self):
        return self

    def __abs__(self):
        return self.recorder.scalar_op(operator.abs, self)

    # Python needs the value: take it, guarded
    def __bool__(self) -> bool:  # only the truth is taken: ``if n:`` guards ``bool(n)``, not n
        return bool(self.recorder.concretize(self.recorder.scalar_op(bool, self)))

    def __index__(self) -> int:
        return operator.index(self.recorder.concretize(self))

    def __int__(self) -> int:
        return int(self.recorder.concretize(self))

    def __float__(self) -> float:
        return float(self.recorder.concretize(self))

    def __hash__(self) -> int:
        return hash(self.recorder.concretize(self))

    def __format__(self, spec: str) -> str:
        return format(self.recorder.concretize(self), spec)

    def __str__(self) -> str:
        return str(self.recorder.concretize(self))

    def __round__(self, digits=None):
        return round(self.recorder.concretize(self), digits)

    def __repr__(self) -> str:  # for debugging only: no guard
        return f"TracedScalar({self.value!r}, node={self.node.name})"

    def __getattr__(self, name: str) -> Any:
        # a method or attribute of the number itself (``n.bit_length()``): of its value, guarded
        value = object.__getattribute__(self, "value")
        if name.startswith("__") or not hasattr(type(value), name):
            raise AttributeError(f"{type(value).__name__!r} object has no attribute {name!r}")
        return getattr(self.recorder.concretize(self), name)


class TracedSize(tuple):
    """``x.shape`` during a trace: a tuple of TracedScalars with ``torch.Size``'s ``numel``."""

    def numel(self) -> Any:
        total: Any = 1
        for size in self:
            total = total * size
        return total
