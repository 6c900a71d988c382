"""One vocabulary of op facts, read from what torch itself records about its ops.

Every analysis of fxpasses asks the same questions of an op — does it write to its inputs, does
its output alias them, is it elementwise, does it read device data on the host, does it draw
random numbers — and answers them from one place:

* :func:`aten_facts` answers them for an aten op from its schema (``alias_info.is_write`` marks an
  argument written in place, an aliased return marks a view) and its tags
  (``pointwise``, ``data_dependent_output``, ``dynamic_output_shape``, ``nondeterministic_seeded``);
* :class:`NodeFacts` answers them for a node of a traced loss from the aten ops the node *ran*
  while shapes were propagated (:mod:`fxpasses.analysis.meta` records them under fake tensors), so
  a functional, a Tensor method, an operator or a torch module is classified by what it does,
  never by its name. Whether the node's target is torch's own code (``torch_code``) is the one
  fact about the Python target: user functions and modules may have effects no op shows.

The row-independence rules (:mod:`.row_rules`), the capture verdicts (:mod:`.capture_rules`) and
the pairing pass's reordering check all read these facts.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..ir.trace_ops import set_item

NODE_FACTS = "fxpasses.facts"  # node.meta key of a NodeFacts


def _tagged(op: Any, name: str) -> bool:
    tag = getattr(torch.Tag, name, None)
    return tag is not None and tag in getattr(op, "tags", ())


@dataclass(frozen=True)
class AtenFacts:
    """What the schema and tags of one aten op say (see the module docstring)."""

    name: str
    mutates: tuple[str, ...]  # arguments written in place
    aliases: tuple[str, ...]  # arguments an output is a view of
    pointwise: bool
    data_dependent: bool  # tagged: its output's value (a host read) or shape may depend on data
    value_on_host: bool  # tagged data_dependent_output: it reads a value to the host (.item())
    random: bool
    computes: bool  # returns a tensor that is not a view of an argument: a kernel runs


# Ops whose schema does not mark arguments they write: batch norm updates its running statistics
# in training mode, but ``native_batch_norm``'s schema declares them read-only.
_UNDECLARED_WRITES = {"native_batch_norm": ("running_mean", "running_var"),
                      "cudnn_batch_norm": ("running_mean", "running_var"),
                      "miopen_batch_norm": ("running_mean", "running_var")}


@functools.lru_cache(maxsize=None)
def aten_facts(op: Any) -> AtenFacts:
    """The facts of an aten ``OpOverload`` (an op without a schema has none of them)."""
    schema = getattr(op, "_schema", None)
    arguments = schema.arguments if schema is not None else ()
    written = tuple(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)
    packet = getattr(getattr(op, "overloadpacket", None), "__name__", "")
    written += tuple(n for n in _UNDECLARED_WRITES.get(packet, ()) if n not in written)
    returns = schema.returns if schema is not None else ()
    aliased = tuple(a.name for a in arguments if a.alias_info is not None and not a.alias_info.is_write
                    and any(r.alias_info is not None for r in returns))
    return AtenFacts(
        name=str(op), mutates=written, aliases=aliased,
        pointwise=_tagged(op, "pointwise"),
        data_dependent=_tagged(op, "data_dependent_output") or _tagged(op, "dynamic_output_shape"),
        value_on_host=_tagged(op, "data_dependent_output"),
        random=_tagged(op, "nondeterministic_seeded"),
        computes=any(str(r.type) == "Tensor" and r.alias_info is None for r in returns))


@dataclass(frozen=True)
class NodeFacts:
    """What one node of a traced loss did while its shapes were propagated.

    ``ops``: the aten ops it ran, in order, each once. ``writes_input``: one of them wrote to the
    memory of a node input or of the module it calls (its parameters and buffers); ``writes``:
    those storages (ids of the fake storages, valid while the graph's metadata lives). ``host_read``:
    one of them reads tensor data on the host (``.item()``, ``nonzero``...), or the node's result
    has sizes known only from data. ``random``: one draws random numbers. ``computes``: one makes a new tensor (a
    kernel runs; views and metadata reads do not). ``complete``: shape
    propagation ran the node to the end (else the facts are partial and analyses assume the
    worst). ``torch_code``: the target is torch's own (not a user function or module).
    """

    ops: tuple[str, ...]
    writes_input: bool
    writes: frozenset[int]
    host_read: bool
    random: bool
    computes: bool
    complete: bool
    torch_code: bool


def node_facts(node: fx.Node) -> NodeFacts | None:
    return node.meta.get(NODE_FACTS)


_PYTHON_BUILTINS = (getattr, bool, int, float, abs, min, max, len)


def is_torch_code(node: fx.Node, module: nn.Module | None = None) -> bool:
    """Whether ``node``'s target is torch's own code (its effects are the ops it runs)."""
    if node.op == "call_function":
        target = node.target
        owner = getattr(target, "__module__", None) or ""
        return owner == "torch" or owner.startswith("torch.") or owner in ("_operator", "operator") \
            or target in _PYTHON_BUILTINS or target in vars(operator).values() \
            or target is set_item  # fxpasses' own expression form of ``x[i] = v``: its ops show
    if node.op == "call_method":
        return hasattr(torch.Tensor, node.target)
    if node.op == "call_module" and module is not None:
        return all(type(m).__module__.startswith("torch.nn.") for m in module.modules())
    return False


def _aten_packet(name: str) -> Any:
    """``torch.ops.aten.<name>`` if it is an op (not one of the namespace's own attributes)."""
    packet = getattr(torch.ops.aten, name, None) if not name.startswith("__") or name.startswith("__i") else None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


# Python's in-place operator protocol on tensors, as the aten ops that implement it
_IN_PLACE_DUNDERS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_",
                     "__itruediv__": "div_", "__ifloordiv__": "floor_divide_",
                     "__imod__": "remainder_", "__ipow__": "pow_"}


@functools.lru_cache(maxsize=None)
def method_writes_self(name: str) -> bool:
    """Whether ``tensor.<name>(...)`` writes to ``tensor``, from the schemas of the aten op of
    that name (``add_``: ``Tensor(a!) self``); ``x += y`` is ``__iadd__``, that is ``add_``."""
    packet = _aten_packet(_IN_PLACE_DUNDERS.get(name, name))
    if packet is None:
        return False
    return any(a.name == "self" and a.alias_info is not None and a.alias_info.is_write
               for overload in packet.overloads() for a in getattr(packet, overload)._schema.arguments)


# Python's in-place operators (``x += y`` traces as operator.iadd); conservative: a few extras
# such as ``index`` match the pattern too and count as writing.
_IN_PLACE_OPERATORS = frozenset(n for n in dir(operator) if n.startswith("i") and hasattr(operator, f"__{n}__"))


def may_write_inputs(node: fx.Node) -> bool:
    """For a node shape propagation never reached: whether its target may write to its inputs.

    Read from the schemas of the aten op of the same name (``x.add_`` -> ``aten.add_``: its
    ``self`` is written); a target that names no aten op, or is not torch's code, may.
    """
    if not is_torch_code(node):
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op == "call_function" and (node.target is getattr or node.target in vars(operator).values()):
        return str(name) in _IN_PLACE_OPERATORS  # operator.iadd and friends write; the rest read
    if isinstance(node.target, torch._ops.OpOverload):  # one overload: its own schema
        schemas = [node.target._schema]
    else:
        packet = _aten_packet(str(name)) if name else None
        if packet is None:
            return True
        schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    return any(a.alias_info is not None and a.alias_info.is_write and a.name != "out"
               for schema in schemas for a in schema.arguments)


def written_storages(op: Any, args: tuple, kwargs: dict) -> set[int]:
    """The storages (ids) that ``op`` called with these arguments writes to."""
    facts = aten_facts(op)
    if not facts.mutates:
        return set()
    schema = op._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    bound = dict(zip(positional, args)) | dict(kwargs)
    return {storage_id(t) for name in facts.mutates for t in _tensors(bound.get(name))}


def storage_id(t: torch.Tensor) -> int:
    """An identity of a tensor's storage (shared by its views); fake tensors have one too."""
    return t.untyped_storage()._cdata


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []
