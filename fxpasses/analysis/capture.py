"""Which nodes can be captured in a CUDA graph, and the regions they form.

:func:`classify` gives each node a :class:`Verdict` from the tables in
:mod:`fxpasses.analysis.capture_rules` and the node's metadata (shapes with data-dependent sizes are
dynamic; tensors off the capture devices are not capturable). :func:`plan_regions` groups
capturable nodes with torch.fx's ``CapabilityBasedPartitioner`` (which keeps the graph acyclic when
each group becomes one call) and then splits every group at *barriers* — grad-mode switches,
in-place ops and unknown ops — because fusing a group moves its nodes to one place in the graph,
which is only safe across pure nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx

from ..runtime import RuntimeOp
from . import capture_rules as rules
from .meta import is_dynamic, tensors_in, value


@dataclass(frozen=True)
class Verdict:
    capturable: bool
    code: str | None  # why not, from the registry
    op: str
    barrier: bool = False  # may not be reordered across (side effects or unknown)
    detail: str = ""


_STRUCTURAL = ("placeholder", "get_attr", "output")


def _device_ok(node: fx.Node, devices: Sequence[str]) -> bool:
    vals = [value(node)] + [value(a) for a in node.all_input_nodes]
    tensors = [t for v in vals for t in tensors_in(v)]
    return all(t.device.type in devices for t in tensors)


def _dynamic(node: fx.Node) -> bool:
    if "val" not in node.meta:
        return True
    return is_dynamic(value(node)) or any(is_dynamic(value(a)) for a in node.all_input_nodes)


def _known(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in rules.CAPTURABLE_FUNCTIONS
    if node.op == "call_method":
        return node.target in rules.CAPTURABLE_METHODS
    return False


def _host_sync(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in rules.HOST_SYNC_FUNCTIONS:
        return True
    if node.op == "call_method" and node.target in rules.HOST_SYNC_METHODS:
        return True
    rule = rules.ARGUMENT_RULES.get(node.target)
    return rule is not None and rule(node) == "host-sync"


def classify(node: fx.Node, gm: fx.GraphModule, devices: Sequence[str] = ("cuda",)) -> Verdict:
    """Whether ``node`` can be captured, and if not, the reason code (see module docstring)."""
    op = rules.op_name(node)
    if node.op in _STRUCTURAL:
        return Verdict(False, None, op)
    if node.target is torch._C._set_grad_enabled:
        return Verdict(False, "op-not-capturable", op, barrier=True, detail="grad-mode switch")
    if rules.is_mutation(node):
        return Verdict(False, "op-not-capturable", op, barrier=True, detail="in-place op")
    site = node.target if node.op == "call_function" and isinstance(node.target, RuntimeOp) else None
    if site is not None and not site.capturable:
        return Verdict(False, "op-not-capturable", op, barrier=not site.pure, detail=type(site).__name__)
    if _host_sync(node):
        return Verdict(False, "host-sync", op)
    known = site is not None or _known(node) or (
        node.op == "call_module" and isinstance(gm.get_submodule(node.target), rules.CAPTURABLE_MODULES))
    if not known:
        return Verdict(False, "op-not-capturable", op, barrier=True, detail="not in the capturable table")
    if _dynamic(node):
        return Verdict(False, "dynamic-shape", op)
    if not _device_ok(node, devices):
        return Verdict(False, "no-cuda", op, detail=f"a tensor is not on {'/'.join(devices)}")
    return Verdict(True, None, op)


def _launches(node: fx.Node) -> bool:
    """Whether a capturable node launches device work (getitem of tuples and sizes do not)."""
    if node.op == "call_method" and node.target in ("size", "dim", "numel"):
        return False
    if node.op == "call_function" and node.target is rules.operator.getitem:
        return isinstance(value(node.args[0]), torch.Tensor)
    return not (node.op == "call_function" and node.target is getattr)


@dataclass
class CapturePlan:
    verdicts: dict[fx.Node, Verdict]
    regions: list[list[fx.Node]] = field(default_factory=list)
    too_small: list[list[fx.Node]] = field(default_factory=list)

    @staticmethod
    def kernel_ops(region: list[fx.Node]) -> int:
        return sum(_launches(n) for n in region)


def plan_regions(gm: fx.GraphModule, devices: Sequence[str] = ("cuda",),
                 min_region_ops: int = 4) -> CapturePlan:
    """Classify every node and group the capturable ones into regions (see module docstring)."""
    verdicts = {n: classify(n, gm, devices) for n in gm.graph.nodes}
    plan = CapturePlan(verdicts)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for nodes in _grow_regions(gm.graph, verdicts):
        bucket = plan.regions if plan.kernel_ops(nodes) >= min_region_ops else plan.too_small
        bucket.append(sorted(nodes, key=order.__getitem__))
    plan.regions.sort(key=lambda r: order[r[0]])
    return plan


def _grow_regions(graph: fx.Graph, verdicts: dict[fx.Node, Verdict]) -> list[list[fx.Node]]:
    """Greedy convex regions in one pass over the nodes in graph order.

    ``leaves[n]`` is the set of regions with a path to ``n`` that leaves the region on the way.
    A capturable node may join region R only if R is not in the union of its inputs' ``leaves``:
    then contracting R stays acyclic. It tries the
    regions of its inputs first, then the latest region of its segment, else opens a new one.
    Regions never span a barrier (a new segment starts at each one).

    Written by hand: torch.fx's CapabilityBasedPartitioner (torch 2.13) loops forever when a
    boolean mask and the tensor it indexes both have only getitem users, as every x[mask] has.
    """
    region_of: dict[fx.Node, int] = {}
    leaves: dict[fx.Node, set[int]] = {}
    regions: list[list[fx.Node]] = []
    segment_of_region: list[int] = []
    segment = 0
    latest: int | None = None
    for node in graph.nodes:
        verdict = verdicts[node]
        if verdict.barrier:
            segment, latest = segment + 1, None
        inputs = node.all_input_nodes
        through: set[int] = set().union(*(leaves.get(i, set()) for i in inputs)) if inputs else set()
        if verdict.capturable:
            direct = [region_of[i] for i in inputs if i in region_of]
            candidates = [r for r in dict.fromkeys(reversed(direct)) if segment_of_region[r] == segment]
            if latest is not None:
                candidates.append(latest)
            chosen = next((r for r in candidates if r not in through), None)
            if chosen is None:
                chosen = len(regions)
                regions.append([])
                segment_of_region.append(segment)
            regions[chosen].append(node)
            region_of[node] = chosen
            latest = chosen
            leaves[node] = through | {r for r in direct if r != chosen}
        else:
            leaves[node] = through | {region_of[i] for i in inputs if i in region_of}
    return [r for r in regions if r]
