"""What may live inside a CUDA graph: the capture verdict of a node, as rows of one table.

Each row is a condition on a node's facts (:mod:`fxpasses.analysis.ops`: the aten ops the node ran
under fake tensors, its metadata) and the verdict when it holds; the first row that holds decides.
A *barrier* is a node no region may be moved across (its effects are not only its outputs), so a
region never spans one. To change what is captured, change a row; nothing else decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..certificates.codes import note
from ..ir.runtime_op import RuntimeOp
from ..ir.trace_ops import WriteAttribute
from .size_decisions import on_input_sizes
from .meta import node_is_dynamic, tensor_from_host_data, tensors_in, value
from .ops import NodeFacts, node_facts


@dataclass(frozen=True)
class Verdict:
    capturable: bool
    code: str | None  # why not, from the registry
    op: str
    barrier: bool = False  # may not be reordered across (side effects or unknown)
    detail: str = ""

    def __post_init__(self) -> None:
        if self.code is not None:  # a registered code, noted as occurring (see codes.observe)
            note(self.code)


@dataclass(frozen=True)
class Probe:
    """What a row may look at: the node, its facts, and the devices that may be captured."""

    node: fx.Node
    facts: NodeFacts | None
    devices: Sequence[str]
    static: frozenset = frozenset()  # data-dependent sizes that are static per recording (buckets)
    absorbed: frozenset = frozenset()  # grad-mode switches of blocks a region holds whole
    local_writes: frozenset = frozenset()  # in-place writes one region holds with every alias
    eager_views: frozenset = frozenset()  # views a region would hand out apart from their memory
    varying: Any = frozenset()  # nodes following the per-call row count of an input table (or reading one)

    @property
    def runtime_op(self) -> RuntimeOp | None:
        target = self.node.target
        return target if self.node.op == "call_function" and isinstance(target, RuntimeOp) else None


@dataclass(frozen=True)
class Row:
    """``when`` holds -> this verdict (``code`` None: capturable, or nothing to capture)."""

    name: str
    when: Callable[[Probe], bool]
    capturable: bool
    code: str | None
    barrier: bool = False


def _structural(p: Probe) -> bool:
    return p.node.op in ("placeholder", "get_attr", "output")


def _grad_switch(p: Probe) -> bool:
    return p.node.op == "call_function" and p.node.target is torch._C._set_grad_enabled


def _absorbed_switch(p: Probe) -> bool:
    return p.node in p.absorbed


def _has_effects(p: Probe) -> bool:
    op = p.runtime_op
    return op is not None and not op.pure


def _writes_attribute(p: Probe) -> bool:
    return isinstance(p.runtime_op, WriteAttribute)


def _runtime_uncapturable(p: Probe) -> bool:
    op = p.runtime_op
    return op is not None and not op.capturable


def _host_read_stopped_propagation(p: Probe) -> bool:
    return p.facts is not None and not p.facts.complete and p.facts.host_read


def _no_facts(p: Probe) -> bool:
    return p.runtime_op is None and (p.facts is None or not p.facts.complete)


def _user_code(p: Probe) -> bool:
    return p.runtime_op is None and not p.facts.torch_code


def _writes_input(p: Probe) -> bool:
    return p.facts is not None and p.facts.writes_input and p.node not in p.local_writes


def _host_read(p: Probe) -> bool:
    return p.facts is not None and p.facts.host_read


def _random(p: Probe) -> bool:
    return p.facts is not None and p.facts.random


def _dynamic(p: Probe) -> bool:
    return any(node_is_dynamic(n, p.static) for n in (p.node, *p.node.all_input_nodes))


def _eager_view(p: Probe) -> bool:
    return p.node in p.eager_views


def _off_device(p: Probe) -> bool:
    vals = [value(p.node)] + [value(a) for a in p.node.all_input_nodes]
    return any(t.device.type not in p.devices for v in vals for t in tensors_in(v))


def _varying_rows(p: Probe) -> bool:
    return p.node in p.varying


ROWS: tuple[Row, ...] = (
    Row("graph structure", _structural, False, None),
    Row("grad-mode switch bounding a no_grad block of capturable nodes", _absorbed_switch, True, None),
    Row("grad-mode switch", _grad_switch, False, "op-grad-mode", barrier=True),
    Row("writes an attribute of the loss (no captured op reads one; the planner keeps it in order "
        "among the reads and writes of that attribute)", _writes_attribute, False, "op-attribute-write"),
    Row("run-time op with effects", _has_effects, False, "op-unknown", barrier=True),
    Row("run-time op that records itself", _runtime_uncapturable, False, "op-unknown"),
    Row("reads device data on the host; propagation stopped there", _host_read_stopped_propagation,
        False, "host-sync", barrier=True),
    Row("not reached by shape propagation", _no_facts, False, "op-no-metadata", barrier=True),
    Row("user code (effects unknown)", _user_code, False, "op-unknown", barrier=True),
    Row("writes its inputs or module state", _writes_input, False, "op-in-place", barrier=True),
    Row("reads device data on the host", _host_read, False, "host-sync"),
    Row("copies host data to the device inside a constructor (a blocking copy)",
        lambda p: tensor_from_host_data(p.node), False, "host-sync"),
    Row("draws random numbers", _random, False, "op-random"),
    Row("data-dependent shape", _dynamic, False, "dynamic-shape"),
    Row("tensor off the capture devices", _off_device, False, "device-not-captured"),
    Row("shares memory written in place later with a value outside its region", _eager_view, False,
        "view-of-written-memory"),
    Row("follows the per-call row count of an input table, or reads what does", _varying_rows, False,
        "rows-vary-per-call"),
    Row("host arithmetic on the loss's input sizes (runs before every region, as its guards)",
        lambda p: on_input_sizes(p.node), False, None),
    Row("capturable", lambda p: True, True, None),
)


def verdict(node: fx.Node, devices: Sequence[str] = ("cuda",), static: frozenset = frozenset(),
            absorbed: frozenset = frozenset(), local_writes: frozenset = frozenset(),
            eager_views: frozenset = frozenset(), varying: Any = frozenset()) -> tuple[Verdict, Row]:
    """The verdict of the first row of :data:`ROWS` that holds for ``node``, and that row.
    ``static``: data-dependent sizes to treat as static (bucketed capacities); ``absorbed``:
    grad-mode switches whose no_grad block a region may hold whole; ``local_writes``: in-place
    writes a region may hold, with every node that touches the memory they write;
    ``eager_views``: nodes a region would hand out as a copy of memory that another value outside
    it shares and a later write changes (:func:`fxpasses.analysis.capture.plan_regions` decides
    the last three); ``varying``: nodes following the per-call row count of an input table
    (:func:`fxpasses.analysis.varying_rows.varying_rows`)."""
    probe = Probe(node, node_facts(node), tuple(devices), static, absorbed, local_writes, eager_views,
                  varying)
    row = next(r for r in ROWS if r.when(probe))
    detail = "" if row.capturable or row.code is None else row.name
    return Verdict(row.capturable, row.code, op_name(node), row.barrier, detail), row


def launches_kernels(node: fx.Node) -> bool:
    """Whether the node ran an op that computes a new tensor (views and metadata reads do not)."""
    facts = node_facts(node)
    return facts.computes if facts is not None else isinstance(node.target, RuntimeOp)


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module {node.target}"
    target = node.target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")
