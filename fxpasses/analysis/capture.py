"""Which nodes can be captured in a CUDA graph, and the regions they form.

Every node gets a :class:`~.capture_rules.Verdict` from the rows of
:mod:`fxpasses.analysis.capture_rules` (read from the node's facts and metadata). :func:`plan_regions`
groups capturable nodes into convex regions (fusing a region into one call must keep the graph
acyclic) that never span a *barrier* — a grad-mode switch, an op that writes its inputs, user code
whose effects are unknown — because fusing a region moves its nodes to one place in the graph,
which is only safe across pure nodes. The grouping is written by hand (see :func:`_grow_regions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.fx as fx

from .capture_rules import Verdict, launches_kernels, verdict


def classify(node: fx.Node, devices: Sequence[str] = ("cuda",)) -> Verdict:
    """Whether ``node`` can be captured, and if not, the reason code (see module docstring)."""
    return verdict(node, devices)[0]


@dataclass
class CapturePlan:
    verdicts: dict[fx.Node, Verdict]
    regions: list[list[fx.Node]] = field(default_factory=list)
    too_small: list[list[fx.Node]] = field(default_factory=list)

    @staticmethod
    def kernel_ops(region: list[fx.Node]) -> int:
        return sum(launches_kernels(n) for n in region)


def plan_regions(gm: fx.GraphModule, devices: Sequence[str] = ("cuda",),
                 min_region_ops: int = 4) -> CapturePlan:
    """Classify every node and group the capturable ones into regions (see module docstring)."""
    verdicts = {n: classify(n, devices) for n in gm.graph.nodes}
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
