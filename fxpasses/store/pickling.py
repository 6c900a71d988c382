"""A pipeline's result to bytes and back, its references to the loss's objects rebound.

Written with :mod:`pickle` (a :class:`pickle.Pickler` with ``persistent_id`` and
``reducer_override``; torch.fx's own pickling of a GraphModule regenerates imports for its
targets and cannot name fxpasses' run-time ops):

* an object the loss holds (:mod:`.live`) is written as its path and read back as the object at
  that path in the loss being optimized: the same module, parameter or flow, never a copy;
* a module's globals dict as the module's name;
* a GraphModule as its nodes (op, name, target, arguments with nodes by name, the node
  metadata the run time reads) and the attributes its nodes fetch; read back into a new
  GraphModule with the same generated code;
* a run-time op through its ``__getstate__``: configuration, never a call's state (recordings,
  locks, kept tensors; :meth:`~fxpasses.ir.runtime_op.RuntimeOp.fresh_state`);
* a :class:`~fxpasses.guards.TensorSeen` (a tensor a rewrite folded) as the tensor and a digest
  of its values: read back only where the tensor now holds those values, seen at its version now;
* an identity assumption on an object that is neither held by the loss nor picklable (a module's
  lock that kept-whole code reads) as its source and the object's class: recorded again on the
  object the source holds in the reading process, which must be of that class (one pickle writes
  by name, a dtype or a function, stays the object it names, so its identity still compares).

Anything else of a user class, a method of an object the loss does not hold (written by value it
would call a copy), a fake tensor, a symbolic size or a lock is :class:`NotStorable`.
Reading executes pickle: a store directory must be as trusted as the code that reads it.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
import types
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..guards import Assumption, TensorSeen
from ..ir.sources import Roots
from ..ir.proofs import KEPT_WHOLE, PROVEN, RELIED_ON
from ..locations import is_user_class
from .key import fetch_attr, tensor_digest
from .live import LiveObjects

KEPT_NODE_META = ("stack_trace", PROVEN, KEPT_WHOLE)  # what the run time and reports read
KEPT_GRAPH_META = (RELIED_ON,)
_LOCKS = (type(threading.Lock()), type(threading.RLock()))


class NotStorable(Exception):
    """The result holds something that cannot be written portably (the message says what)."""


class StaleResult(Exception):
    """A stored result does not fit the loss it is read for (the message says why)."""


class _NodeRef:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self) -> tuple:
        return (_NodeRef, (self.name,))


def _graph_state(gm: fx.GraphModule) -> tuple:
    nodes, attrs = [], {}
    for node in gm.graph.nodes:
        meta = {k: node.meta[k] for k in KEPT_NODE_META if k in node.meta}
        args = fx.node.map_arg(node.args, lambda n: _NodeRef(n.name))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: _NodeRef(n.name))
        nodes.append((node.op, node.name, node.target, args, kwargs, meta))
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = fetch_attr(gm, node.target)
    meta = {k: gm.meta[k] for k in KEPT_GRAPH_META if k in gm.meta}
    return (type(gm).__name__, attrs, nodes, gm.graph._codegen, meta)


def _graph_module(class_name: str, attrs: dict, nodes: list, codegen: Any, meta: dict) -> fx.GraphModule:
    graph = fx.Graph()
    graph.set_codegen(codegen)
    env: dict[str, fx.Node] = {}

    def load(a: Any) -> Any:
        if isinstance(a, _NodeRef):
            return env[a.name]
        if isinstance(a, (tuple, list)):
            return type(a)(load(x) for x in a)
        if isinstance(a, dict):
            return {k: load(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(load(a.start), load(a.stop), load(a.step))
        return a

    for op, name, target, args, kwargs, node_meta in nodes:
        node = graph.create_node(op, target, load(args), load(kwargs), name=name)
        if node.name != name:
            raise StaleResult(f"node {name} read back as {node.name}")
        node.meta.update(node_meta)
        env[name] = node
    gm = fx.GraphModule(attrs, graph, class_name)
    gm.meta.update(meta)
    return gm


def _aten(namespace: str, name: str, overload: str) -> Any:
    packet = getattr(getattr(torch.ops, namespace), name)
    return getattr(packet, overload) if overload else packet


def _class_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _identity_again(kind: Any, source: Any, cls: str, location: str, shown: str, loss: Any) -> Assumption:
    """An identity assumption on an object neither held by the loss nor named (a module's lock):
    recorded again on the object its source holds in this process, which must be of the class
    the stored one was (its settings, where code read them, are assumptions of their own)."""
    try:
        now = source.read(Roots(loss, ()))
    except Exception as exc:
        raise StaleResult(f"{source} cannot be read: {type(exc).__name__}") from exc
    if _class_name(now) != cls:
        raise StaleResult(f"{source} is a {_class_name(now)}, was a {cls}")
    return Assumption(kind, source, now, location, shown)


def _picklable(value: Any) -> bool:
    """Whether pickle can write ``value`` itself: by its name (a class, a function, a dtype, an
    enum member: the same object read back, so an identity still compares) or by value (a copy,
    so an identity with it never holds and the result is not used)."""
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any failure means no
        return False
    return True


def _seen_again(tensor: torch.Tensor, digest: str) -> TensorSeen:
    if tensor_digest(tensor) != digest:
        raise StaleResult("a tensor a rewrite folded holds other values than when it was stored")
    return TensorSeen.of(tensor)


class _Writer(pickle.Pickler):
    def __init__(self, file: Any, live: LiveObjects):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.live = live
        self.globals = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in (str, int, float, bool, bytes, type(None)):
            return None
        path = self.live.path_of(obj)
        if path is not None:
            return ("live", path)
        if type(obj) is dict and id(obj) in self.globals and vars(sys.modules[self.globals[id(obj)]]) is obj:
            return ("globals", self.globals[id(obj)])
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, fx.GraphModule):
            return (_graph_module, _graph_state(obj))
        if isinstance(obj, torch._ops.OpOverload):
            return (_aten, (obj.namespace, obj._opname, obj._overloadname))
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return (_aten, (namespace, name, ""))
        if isinstance(obj, Assumption) and obj.kind.compares_identity and \
                self.live.path_of(obj.expected) is None and not _picklable(obj.expected):
            return (_identity_again, (obj.kind, obj.source, _class_name(obj.expected), obj.location,
                                      obj.shown, self.live.root))
        if isinstance(obj, TensorSeen):
            return (_seen_again, (obj.tensor, tensor_digest(obj.tensor)))
        if isinstance(obj, (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NotStorable(f"a fake or symbolic value ({type(obj).__name__})")
        if isinstance(obj, _LOCKS):
            raise NotStorable("a lock")
        bound = getattr(obj, "__self__", None)
        if isinstance(obj, (types.MethodType, types.BuiltinMethodType)) and bound is not None and \
                not isinstance(bound, (type, types.ModuleType)) and self.live.path_of(bound) is None \
                and not type(bound).__module__.startswith("fxpasses."):
            raise NotStorable(f"a method of a {type(bound).__name__} the loss does not hold "
                              "(written by value, it would call a copy)")
        if not isinstance(obj, type) and is_user_class(type(obj)):
            raise NotStorable(f"a {type(obj).__module__}.{type(obj).__qualname__} the loss does not hold")
        return NotImplemented


class _Reader(pickle.Unpickler):
    def __init__(self, file: Any, loss: Any):
        super().__init__(file)
        self.loss = loss

    def persistent_load(self, pid: Any) -> Any:
        kind, where = pid
        if kind == "live":
            value = self.loss
            for step in where:
                value = step.read(value)
            return value
        if kind == "globals":
            return vars(sys.modules[where])
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")


def dumps(value: Any, live: LiveObjects) -> bytes:
    """``value`` as bytes, the loss's objects by path; raises :class:`NotStorable`."""
    buffer = io.BytesIO()
    try:
        _Writer(buffer, live).dump(value)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        raise NotStorable(f"{type(exc).__name__}: {exc}"[:300]) from exc
    return buffer.getvalue()


def loads(data: bytes, loss: Any) -> Any:
    """What :func:`dumps` wrote, its paths read from ``loss``; raises :class:`StaleResult`
    (an error reading it is one)."""
    try:
        return _Reader(io.BytesIO(data), loss).load()
    except StaleResult:
        raise
    except Exception as exc:  # a path the loss does not have, a class renamed, a torn file
        raise StaleResult(f"{type(exc).__name__}: {exc}"[:300]) from exc
