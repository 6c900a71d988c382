"""May two nodes of a graph swap places? Memory, random state and attributes say.

A rewrite that moves a node past another (pairing two calls moves the first call's users after
the second) keeps the program's meaning when the two do not *conflict*: neither writes memory the
other reads or writes (storages from the nodes' fake-tensor metadata, writes from the ops they
ran: :mod:`fxpasses.analysis.ops`), they do not both draw random numbers, and they do not both
touch Python attributes with one of them writing the name the other touches (two reads of the
loss's state pass each other; a read through a property, another descriptor or a container of
another type than dict, list and tuple touches every name). A node whose effects are unknown
(user code, a node shape propagation never reached whose schema allows writes) conflicts with
everything.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir.runtime_op import RuntimeOp
from ..ir.sources import Attr
from ..ir.trace_ops import ReadSource, ReadState, WriteAttribute
from .meta import storages_of
from .ops import may_write_inputs, node_facts

@dataclass(frozen=True)
class Effects:
    """What a node touches: storages read and written (None: unknown), random draws, attributes."""

    reads: frozenset[int] | None
    writes: frozenset[int] | None
    random: bool = False
    attributes: bool = False
    writes_attributes: bool = False
    names: frozenset[str] | None = frozenset()  # the attribute names touched (None: any)

    @property
    def unknown(self) -> bool:
        return self.writes is None


def effects(node: fx.Node) -> Effects:
    reads = _reads(node)
    if not node.op.startswith("call_") or node.target is torch._C._set_grad_enabled:
        return Effects(reads, frozenset())  # grad-mode switches are compared separately
    if isinstance(node.target, WriteAttribute):
        return Effects(reads, frozenset(), attributes=True, writes_attributes=True,
                       names=_names_written(node))
    if isinstance(node.target, ReadSource):
        return Effects(reads, frozenset(), attributes=True, names=_names_read(node.target, node.args))
    if isinstance(node.target, ReadState):  # a module's parameter or buffer, by its name
        return Effects(reads, frozenset(), attributes=True, names=frozenset((node.target.name,)))
    if isinstance(node.target, RuntimeOp):
        return Effects(reads, frozenset() if node.target.pure else None)
    facts = node_facts(node)
    if facts is None or not facts.complete:  # never propagated: what its schema allows
        return Effects(reads, None if may_write_inputs(node) or node.is_impure() else frozenset())
    if not facts.torch_code or node.is_impure():
        return Effects(reads, None)
    return Effects(reads, facts.writes, random=facts.random)


def _names_read(op: ReadSource, args: tuple) -> frozenset[str] | None:
    """The attribute names ``op``'s path reads, where each step is a plain lookup on the objects
    it reads now (an instance's own attribute, a module's parameter, buffer or submodule, a class
    attribute that is no descriptor; an item of a dict, list or tuple); None otherwise (a getter
    may read anything), or where the root is an argument of the call."""
    if args:
        return None
    value, names = op.root, set()
    for step in op.path:
        if isinstance(step, Attr):
            if not _plain_attribute(value, step.name):
                return None
            names.add(step.name)
        elif type(value) not in (dict, list, tuple):
            return None
        try:
            value = step.read(value)
        except Exception:
            return None
    return frozenset(names)


def _names_written(node: fx.Node) -> frozenset[str] | None:
    """The one attribute name a :class:`WriteAttribute` writes, where its owner (a ``get_attr``
    of the graph module) sets it plainly (``object``'s or ``nn.Module``'s ``__setattr__``, and no
    data descriptor of that name: a setter may write anything); None otherwise."""
    owner = node.args[0] if node.args else None
    gm = node.graph.owning_module
    if not isinstance(owner, fx.Node) or owner.op != "get_attr" or gm is None:
        return None
    try:
        value = gm.get_submodule(owner.target)
    except AttributeError:  # (not a module)
        return None
    setter = type(value).__setattr__
    if setter not in (object.__setattr__, torch.nn.Module.__setattr__) or \
            hasattr(inspect.getattr_static(type(value), node.target.name, None), "__set__"):
        return None
    return frozenset((node.target.name,))


def _plain_attribute(value: object, name: str) -> bool:
    if name in getattr(value, "__dict__", {}):
        return not hasattr(inspect.getattr_static(type(value), name, None), "__set__")  # a data descriptor wins
    if isinstance(value, torch.nn.Module) and any(name in d for d in (value._parameters, value._buffers, value._modules)):
        return True
    found = inspect.getattr_static(value, name, _MISSING)
    return found is not _MISSING and not hasattr(type(found), "__get__")


_MISSING = object()


_TENSOR_FACTS = frozenset(("device", "dtype", "layout", "shape", "ndim", "is_cuda", "requires_grad"))


def _tensorless(node: fx.Node) -> bool:
    """A node known to hold no tensor: a run-time op that says so, or a tensor's device, dtype,
    shape or flag read with ``getattr``."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _TENSOR_FACTS
    return getattr(node.target, "tensorless", False)


def _reads(node: fx.Node) -> frozenset[int] | None:
    """Storages of the node's tensor inputs; None when an input computed by the graph has no
    metadata (what it aliases is unknown), unless it is known to hold no tensor."""
    storages: set[int] = set()
    for arg in node.all_input_nodes:
        if "val" not in arg.meta and arg.op.startswith("call") and not _tensorless(arg):
            return None
        storages |= storages_of(arg)  # a real tensor's, and its fake copy's that ops wrote
    return frozenset(storages)


def conflict(a: fx.Node | Effects, b: fx.Node | Effects) -> str | None:
    """Why ``a`` and ``b`` (nodes, or their :func:`effects` read once) may not swap places, or None."""
    ea, eb = (x if isinstance(x, Effects) else effects(x) for x in (a, b))
    if ea.unknown or eb.unknown:
        return "effects unknown"
    if ea.random and eb.random:
        return "both draw random numbers"
    if ea.attributes and eb.attributes and (ea.writes_attributes or eb.writes_attributes) and \
            (ea.names is None or eb.names is None or ea.names & eb.names):
        return "both touch attributes, one writing what the other touches"
    for writer, other in ((ea, eb), (eb, ea)):
        if writer.writes and (other.reads is None or writer.writes & other.reads or writer.writes & other.writes):
            return "one writes memory the other reads or writes"
    return None
