"""A hashable key of what a cut-out piece of graph computes, with its node names left out.

Two regions of a loss with one key are the same code on the same constants and on inputs of the
same metadata: the loss's two branches (one-to-many, one-to-one) run the same methods, so their
regions differ in node names only. An analysis that traces a region and reads nothing but its
code, constants and input metadata gives both the same answer; :func:`structure_key` lets it run
once. Written by hand: torch.fx has graph equality up to names only inside Inductor's cache,
which keys post-grad graphs, not traced user code.

The key holds, node by node: the op; the target (the very function, method name or submodule
object); the arguments (:func:`argument_key`, as CaptureLoss keys duplicates), nodes by position; a constant tensor by dtype, shape, device and the
hash of its bytes; an input by its metadata (``meta['val']``), sizes written by ``size_key``.
No key (None) where an identity cannot be compared: a run-time op of fxpasses' own that does
not say what it computes (:meth:`~fxpasses.ir.runtime_op.RuntimeOp.structure`), a value of a
type the key does not know, an attribute it cannot fetch.
"""

from __future__ import annotations

import hashlib
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..ir.runtime_op import RuntimeOp


class _Unkeyable(Exception):
    """A value or target the key cannot compare."""


_ATOMS = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format,
          type(Ellipsis))


def structure_key(module: fx.GraphModule, size_key: Callable[[Any], Any]) -> tuple | None:
    """The key of ``module``'s graph (see the module docstring), hashable; ``size_key`` writes
    a size (an int or a SymInt) as the analysis sees it. None: no key."""
    index: dict[fx.Node, int] = {}
    try:
        nodes = []
        for i, node in enumerate(module.graph.nodes):
            index[node] = i
            nodes.append(_node_key(module, node, index, size_key))
        key = tuple(nodes)
        hash(key)
    except _Unkeyable:
        return None
    except TypeError:  # a target or constant without a hash
        return None
    return key


def _node_key(module: fx.GraphModule, node: fx.Node, index: dict[fx.Node, int],
              size_key: Callable[[Any], Any]) -> tuple:
    if node.op == "placeholder":
        return ("placeholder", _value_key(node.meta.get("val"), size_key))
    if node.op == "get_attr":
        return ("get_attr", _value_key(_attribute(module, node.target), size_key))
    if node.op == "call_module":
        target: Any = ("module", id(module.get_submodule(node.target)))
    elif isinstance(node.target, RuntimeOp):
        target = ("runtime-op", node.target.structure())
        if target[1] is None:
            raise _Unkeyable(node.target)
    else:
        target = node.target
    arguments = argument_key((node.args, dict(node.kwargs)), lambda n: ("node", index[n]))
    if arguments is None:
        raise _Unkeyable(node)
    return (node.op, target, arguments)


def _attribute(module: nn.Module, target: str) -> Any:
    try:
        return operator.attrgetter(target)(module)
    except AttributeError as exc:
        raise _Unkeyable(target) from exc


def argument_key(arg: Any, name: Callable[[fx.Node], Any]) -> Any:
    """A hashable form of an argument, nodes by ``name``; None for an argument that cannot be
    compared. Floats by their text (0.0 and -0.0 differ; nan is nan)."""
    if isinstance(arg, fx.Node):
        return name(arg)
    if isinstance(arg, float):
        return ("float", repr(arg) if not math.isnan(arg) else "nan")
    if isinstance(arg, _ATOMS):
        return (type(arg).__name__, arg)
    if isinstance(arg, (tuple, list)):
        items = tuple(argument_key(a, name) for a in arg)
        return None if None in items else (type(arg).__name__, items)
    if isinstance(arg, dict):
        items = tuple((k, argument_key(v, name)) for k, v in sorted(arg.items()))
        return None if any(v is None for _, v in items) else ("dict", items)
    if isinstance(arg, slice):
        parts = tuple(argument_key(p, name) for p in (arg.start, arg.stop, arg.step))
        return None if None in parts else ("slice", parts)
    return None


def _value_key(value: Any, size_key: Callable[[Any], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        fake = isinstance(value, FakeTensor)
        if type(value) not in (torch.Tensor, nn.Parameter) and not fake:
            raise _Unkeyable(type(value))
        shape = tuple(size_key(s) for s in value.shape)
        content = None if fake or value.device.type == "meta" else _digest(value)
        return ("tensor", shape, value.dtype, value.device.type, value.requires_grad, content)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("size", size_key(value))
    if isinstance(value, nn.Module):
        return ("module", id(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(v, size_key) for v in value))
    key = argument_key(value, _no_node)
    if key is None:
        raise _Unkeyable(type(value))
    return key


def _no_node(node: fx.Node) -> None:  # a value, not an argument: no node in it
    return None


def _digest(value: torch.Tensor) -> str:
    data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()
