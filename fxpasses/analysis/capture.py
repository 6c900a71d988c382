"""Which nodes can be captured in a CUDA graph, and the regions they form.

Every node gets a :class:`~.capture_rules.Verdict` from the rows of
:mod:`fxpasses.analysis.capture_rules` (read from the node's facts and metadata). :func:`plan_regions`
groups capturable nodes into convex regions (fusing a region into one call must keep the graph
acyclic) that never span a *barrier* — a grad-mode switch, an op that writes its inputs, user code
whose effects are unknown — because fusing a region moves its nodes to one place in the graph,
which is only safe across pure nodes. The grouping is written by hand (see :func:`_grow_regions`).

A no_grad block (:func:`no_grad_blocks`: the trace's switch off, the nodes it ran without
gradients, the switch back on) is no barrier when one region can hold it whole: every node in it
is capturable, a parameter read, or a run-time op whose work does not depend on the grad mode
(a read of the loss's state, a host check: it runs outside the region, before or after it), and
the block's capturable nodes fall into one region. That region then switches gradients off
around the block's nodes and restores the mode it found (:mod:`fxpasses.runtime.grad_mode`); the
block's own switches are dropped. A block that no one region can hold (an eager node on a path
between two of its nodes: a selection's count read in the Ultralytics assigner) is *partitioned*
when every eager node in it does the same with gradients on (a run-time op that says so: a count
read, a guard, a read or a write of the loss's attributes; a torch op none of whose inputs can
require gradients on any call): its capturable nodes fall into regions as any others, and each
region switches gradients off around the block's nodes it holds. A node of it in a class too
small to capture runs eagerly with gradients on, so it must be such a node too; otherwise the
block keeps its barriers.

An in-place write is a barrier too, unless it writes only memory the loss made itself (no
input, parameter, buffer or tensor of its state, nor a view of one: ``y = x.clone();
y[..., :2] *= 2``) and one captured region holds the write together with every node whose value
shares that memory, every reader of those nodes coming before the last write, and the op making the memory.
Then the write happens inside the replay, in graph order among the nodes that can see it, and a
node outside reads the memory only after the region, where its value is the final one (graph
order put it after the last write). :func:`plan_regions` tries every such write as capturable and
makes the ones whose condition the resulting regions break barriers again, until none does.

A replay hands out each output in a buffer of its own. An output sharing memory with one of
the region's inputs or another of its outputs (a view) would so come apart from that memory:
where a write outside the region changes the memory after it, the output is computed eagerly
instead (code ``view-of-written-memory``), and the regions are planned again.

A count read of SelectRows must run before its check point (the first node that could show or
suffer from a count that does not fit). It is eager, and fusing moves it after the region that
computes its count; where that region also holds the check point, the read is made a barrier
and the regions planned again (:mod:`.fused_order` replays the fusion to tell). A read that
follows one of its check points in the graph's own order (no plan can help) is a ValueError.

A region is worth a replay when it launches at least ``min_region_ops`` kernels *and* more
kernels than the launches a replay adds: its two graph launches (forward, backward), and a copy
for each tensor it receives (into the recording's static buffer; parameters and buffers are read
in place) and each tensor it hands on (cloned out of graph memory where the caller sees it),
mirrored in the backward.
A region of small ops between data-dependent shapes (five kernels, nine tensors crossing) would
run slower replayed than eagerly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..ir.proofs import BucketedSizes, proven
from ..ir.runtime_op import RuntimeOp
from ..ir.trace_ops import ReadSource, ReadState
from .capture_rules import Verdict, launches_kernels, verdict
from .fused_order import fused_order, late_reads, moved_writes
from .meta import metadata_unchanged, storages_of, tensors_in, value
from .varying_rows import NONE as NO_VARYING_ROWS, VaryingRows, varying_rows
from .ops import node_facts


def is_state(arg: object) -> bool:
    """A value the graph reads from the loss's state (a parameter, a buffer, a tensor attribute)
    rather than computes or receives as input: replays read it in place."""
    if not isinstance(arg, fx.Node):
        return False
    return arg.op == "get_attr" or (arg.op == "call_function" and isinstance(arg.target, (ReadState, ReadSource)))


def classify(node: fx.Node, devices: Sequence[str] = ("cuda",), static: frozenset = frozenset(),
             absorbed: frozenset = frozenset(), local_writes: frozenset = frozenset(),
             eager_views: frozenset = frozenset(), varying: VaryingRows = NO_VARYING_ROWS) -> Verdict:
    """Whether ``node`` can be captured, and if not, the reason code (see module docstring)."""
    return verdict(node, devices, static, absorbed, local_writes, eager_views, varying)[0]


def local_write_candidates(graph: fx.Graph) -> dict[fx.Node, frozenset[int]]:
    """In-place writes (complete facts, torch's code) of memory that no input, state read or view
    of one holds: each with the storages it writes (see the module docstring)."""
    external: set[int] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr") or is_state(node):
            external |= storages_of(node)
    found = {}
    for node in graph.nodes:
        facts = node_facts(node)
        if facts is not None and facts.writes_input and facts.complete and facts.torch_code \
                and facts.writes and not facts.writes & external:
            found[node] = facts.writes
    return found


def _broken_local_writes(graph: fx.Graph, candidates: dict[fx.Node, frozenset[int]],
                         region_of: dict[fx.Node, int]) -> set[fx.Node]:
    """The candidate writes whose region does not hold all that touches their memory: a node
    sharing it outside the write's captured region, or a reader of one outside the region that
    graph order puts before the memory's last write."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    held = {n: storages_of(n) for n in graph.nodes}  # once, not once per candidate
    broken = set()
    for write, written in candidates.items():
        region = region_of.get(write)
        if region is None:
            broken.add(write)
            continue
        last = max(order[w] for w, s in candidates.items() if s & written)
        for node in graph.nodes:
            if not held[node] & written:
                continue
            if region_of.get(node) != region or any(
                    region_of.get(u) != region and order[u] < last for u in node.users):
                broken.add(write)
                break
    return broken


def _handed_apart(graph: fx.Graph, regions: list[list[fx.Node]]) -> set[fx.Node]:
    """Region outputs that share memory with one of the region's inputs or other outputs, when
    a write outside the region changes that memory after them: eagerly they are one memory, the
    write seen through each; replayed, each output is a buffer of its own."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes = [(n, facts.writes) for n in graph.nodes
              if (facts := node_facts(n)) is not None and facts.writes_input]
    found = set()
    for region in regions:
        inside = set(region)
        handed = [n for n in region if any(u not in inside for u in n.users)]
        received = {a for n in region for a in n.all_input_nodes if a not in inside}
        for node in handed:
            shared = storages_of(node)
            if not shared or not any(storages_of(o) & shared for o in (*received, *handed) if o is not node):
                continue
            if any(w not in inside and order[w] > order[node] and written & shared for w, written in writes):
                found.add(node)
    return found


@dataclass(frozen=True)
class NoGradBlock:
    """A stretch the trace ran without gradients, entered with gradients on."""

    off: fx.Node  # _set_grad_enabled(False)
    on: fx.Node  # _set_grad_enabled(True)
    inner: tuple[fx.Node, ...]  # the nodes between, in graph order


def is_grad_switch(node: fx.Node) -> bool:
    """A ``torch._C._set_grad_enabled`` node: the one mode switch a trace records."""
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled


def no_grad_blocks(graph: fx.Graph) -> list[NoGradBlock]:
    """Every off-then-on pair of grad-mode switches with no other switch between them."""
    blocks, off, inner, mode = [], None, [], True
    for node in graph.nodes:
        if not is_grad_switch(node):
            if off is not None:
                inner.append(node)
            continue
        enabled = node.args[0] if isinstance(node.args[0], bool) else None
        if mode is True and enabled is False:
            off, inner = node, []
        elif off is not None and enabled is True:
            blocks.append(NoGradBlock(off, node, tuple(inner)))
            off = None
        else:  # a switch inside a block, to a mode the trace did not record as a constant, ...
            off = None
        mode = enabled
    return blocks


def _outside_block_ok(node: fx.Node) -> bool:
    """An eager node of a block that may run outside it, before or after the region."""
    return node.op == "get_attr" or (node.op == "call_function" and isinstance(node.target, RuntimeOp)
                                     and node.target.grad_free and node.target.pure)


def _grad_free_nodes(block: NoGradBlock) -> frozenset[fx.Node]:
    """The nodes of ``block`` whose work is the same with gradients on (a partitioned block's eager
    nodes must be): a run-time op that says so; a torch op that makes no tensor (a size, a host
    value); or a torch op none of whose tensor inputs can require gradients on any call
    (:func:`_never_requires_grad`), whose result then has no autograd history in either mode, and
    that writes in place only memory a node of the block made (not a view: one made without
    gradients of a tensor that requires them raises when written with gradients on)."""
    inner = frozenset(block.inner)
    made: set[int] = set()  # the storages the block's nodes make (hold, and none of their inputs holds)
    for node in inner:
        made |= storages_of(node) - set().union(*(storages_of(a) for a in node.all_input_nodes))
    seen: dict[fx.Node, bool] = {}

    def free(node: fx.Node) -> bool:
        if node.op == "get_attr":
            return True
        if node.op == "call_function" and isinstance(node.target, RuntimeOp):
            return node.target.grad_free
        facts = node_facts(node)
        if facts is None or not facts.complete or not facts.torch_code:
            return False
        if not facts.writes_input and not tensors_in(value(node)):
            return True
        return all(_never_requires_grad(a, inner, seen) for a in node.all_input_nodes) and facts.writes <= made

    return frozenset(n for n in inner if free(n))


def _never_requires_grad(node: fx.Node, block: frozenset[fx.Node], seen: dict[fx.Node, bool]) -> bool:
    """Whether ``node``'s tensors require gradients on no call, whatever the inputs' flags (the
    call signature does not fix them): made inside the no_grad ``block``, integer or boolean,
    a ``detach``, or a pure torch op on such values. An input or a parameter may require them."""
    if node in seen:
        return seen[node]
    seen[node] = False  # (a cycle cannot occur; this bounds the walk)
    tensors = tensors_in(value(node))
    facts = node_facts(node)
    found = node in block or not tensors or all(not t.is_floating_point() and not t.is_complex() for t in tensors) \
        or node.target in ("detach", torch.detach, torch.Tensor.detach) \
        or (node.op in ("call_function", "call_method") and not isinstance(node.target, RuntimeOp)
            and facts is not None and facts.complete and facts.torch_code and not facts.writes_input
            and all(_never_requires_grad(a, block, seen) for a in node.all_input_nodes))
    seen[node] = found
    return found


def bucketed_symbols(gm: fx.GraphModule) -> frozenset:
    """The data-dependent sizes that are bucketed capacities (:class:`~fxpasses.ir.proofs.BucketedSizes`):
    static for one recording, as each bucket value is a recording of its own."""
    found: set = set()
    for node in gm.graph.nodes:
        fact = proven(node, BucketedSizes.kind)
        if fact is not None and isinstance(value(node), tuple):
            for size in value(node)[:fact.buckets]:
                found |= set(free_unbacked_symbols(size))
    return frozenset(found)


REPLAY_LAUNCHES = 2  # a replay launches two graphs: the forward's and the backward's


def _held_in(region: list[fx.Node], blocks: Sequence[NoGradBlock]) -> list[tuple[NoGradBlock, list[fx.Node]]]:
    inside = set(region)
    return [(b, held) for b in blocks if (held := [n for n in b.inner if n in inside])]


@dataclass
class CapturePlan:
    verdicts: dict[fx.Node, Verdict]
    regions: list[list[fx.Node]] = field(default_factory=list)
    too_small: list[list[fx.Node]] = field(default_factory=list)
    blocks: list[NoGradBlock] = field(default_factory=list)  # each held whole by one region
    parts: list[NoGradBlock] = field(default_factory=list)  # partitioned: its switches dropped
    # writes of the loss's own memory that no region holds with all that touches it: barriers
    barrier_writes: dict[fx.Node, frozenset[int]] = field(default_factory=dict)
    static: frozenset = frozenset()  # data-dependent sizes static per recording (bucketed)
    varying: VaryingRows = NO_VARYING_ROWS  # nodes following the per-call row count of an input table

    def blocks_in(self, region: list[fx.Node]) -> list[NoGradBlock]:
        inside = set(region)
        return [b for b in self.blocks if b.off in inside]

    def parts_in(self, region: list[fx.Node]) -> list[tuple[NoGradBlock, list[fx.Node]]]:
        """(partitioned block, its nodes in ``region``, in graph order) for each it has nodes in."""
        return _held_in(region, self.parts)

    def switched_off_in(self, region: list[fx.Node]) -> list[tuple[NoGradBlock, list[fx.Node]]]:
        """(block, its nodes in ``region``) for each block held whole there and each partitioned
        one with nodes there: the region switches gradients off around them."""
        return _held_in(region, [*self.blocks_in(region), *self.parts])

    @staticmethod
    def kernel_ops(region: list[fx.Node]) -> int:
        return sum(launches_kernels(n) for n in region)

    @staticmethod
    def copies(region: list[fx.Node]) -> int:
        """Tensors a replay copies: those the region receives (not state, read in place) and
        those it hands on (see the module docstring)."""
        inside = set(region)
        received = {a for n in region for a in n.all_input_nodes if a not in inside and not is_state(a)}
        handed = {n for n in region if any(u not in inside for u in n.users)}
        return sum(len(tensors_in(value(n))) for n in (*received, *handed))

    def worth_capturing(self, region: list[fx.Node], min_region_ops: int, count_copies: bool = True) -> bool:
        kernels = self.kernel_ops(region)
        if kernels < min_region_ops:
            return False
        return not count_copies or kernels >= self.copies(region) + REPLAY_LAUNCHES


def plan_regions(gm: fx.GraphModule, devices: Sequence[str] = ("cuda",),
                 min_region_ops: int = 4, count_copies: bool = True, partition: bool = True) -> CapturePlan:
    """Classify every node and group the capturable ones into regions (see module docstring);
    ``partition`` False: a block no one region holds keeps its barriers."""
    static = bucketed_symbols(gm)
    varying = varying_rows(gm)  # (propagates again: before the metadata is taken as fixed)
    with metadata_unchanged():
        return _plan_regions(gm, devices, min_region_ops, count_copies, static, varying, partition)


def _plan_regions(gm: fx.GraphModule, devices: Sequence[str], min_region_ops: int,
                  count_copies: bool, static: frozenset, varying: VaryingRows,
                  partition: bool = True) -> CapturePlan:
    local = candidates = local_write_candidates(gm.graph)
    eager_views: set[fx.Node] = set()
    pinned: set[fx.Node] = set()  # count reads that fusing would move past a check point, attribute
    # writes it would move past a read or write of their attribute: barriers
    while True:  # local writes whose regions do not hold what touches their memory: barriers;
        # outputs that would leave the memory a later write changes: eager; count reads and
        # attribute writes that the fused regions would move too far: barriers
        plan = _plan(gm, devices, min_region_ops, count_copies, static, frozenset(candidates),
                     frozenset(eager_views), varying, partition, frozenset(pinned))
        region_of = {n: i for i, region in enumerate(plan.regions) for n in region}
        broken = _broken_local_writes(gm.graph, candidates, region_of)
        apart = _handed_apart(gm.graph, plan.regions + plan.too_small) - eager_views
        place = {n.name: i for n, i in fused_order(gm.graph, plan.regions).items()} \
            if not broken and not apart and plan.regions else {}
        late_now = late_reads(gm.graph, place) if place else set()
        moved = moved_writes(gm.graph, place) - pinned if place else set()
        if not broken and not apart and not late_now and not moved:
            plan.barrier_writes = {w: s for w, s in local.items() if w not in candidates}
            plan.static = static
            plan.varying = varying
            return plan
        if not broken and not apart and not moved and late_now <= pinned:  # barriers already: no plan helps
            raise ValueError(f"count read(s) {sorted(n.name for n in late_now)} follow a check point "
                             "in the graph's own order: SelectRows places each read before its check points")
        candidates = {w: s for w, s in candidates.items() if w not in broken}
        eager_views |= apart
        pinned |= late_now | moved


def _plan(gm: fx.GraphModule, devices: Sequence[str], min_region_ops: int, count_copies: bool,
          static: frozenset, local_writes: frozenset, eager_views: frozenset = frozenset(),
          varying: VaryingRows = NO_VARYING_ROWS, partition: bool = True,
          pinned: frozenset = frozenset()) -> CapturePlan:
    verdicts = {n: classify(n, devices, static, local_writes=local_writes, eager_views=eager_views,
                            varying=varying) for n in gm.graph.nodes}
    for node in pinned:  # a count read or attribute write that regions around it would move too far
        verdicts[node] = dataclasses.replace(verdicts[node], barrier=True)
    found = [b for b in no_grad_blocks(gm.graph) if any(verdicts[n].capturable for n in b.inner)]
    blocks = [b for b in found if all((verdicts[n].capturable or _outside_block_ok(n)) and not verdicts[n].barrier
                                      for n in b.inner)]  # (a barrier inside: its switches fall in two segments)
    free = {b: _grad_free_nodes(b) for b in found if partition and b not in blocks}
    parts = [b for b in free if all(verdicts[n].capturable or n in free[b] for n in b.inner)]
    plan_of = CapturePlan(verdicts)
    while True:  # a block whose capturable nodes fall into two regions is partitioned, or keeps its
        # barriers; so does a partitioned one with nodes in a region too small to capture
        absorbed = frozenset(s for b in (*blocks, *parts) for s in (b.off, b.on))
        verdicts.update({s: classify(s, devices, static, absorbed, local_writes, eager_views, varying)
                         for b in no_grad_blocks(gm.graph) for s in (b.off, b.on)})
        classes, split = _grow_regions(gm.graph, verdicts, blocks, parts)
        if split:
            blocks = [b for b in blocks if b not in split]
            parts += [b for b in split if partition]
            free.update({b: _grad_free_nodes(b) for b in split if partition})
            continue
        uncaptured = set().union(*(nodes for nodes in classes if parts and not plan_of.worth_capturing(
            nodes, min_region_ops, count_copies)))  # (run eagerly: with gradients on, once partitioned)
        small = [b for b in parts if any(n in uncaptured and n not in free[b] for n in b.inner)]
        if not small:
            break
        parts = [b for b in parts if b not in small]
    plan = CapturePlan(verdicts, blocks=blocks, parts=parts)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for nodes in classes:
        bucket = plan.regions if plan.worth_capturing(nodes, min_region_ops, count_copies) else plan.too_small
        bucket.append(sorted(nodes, key=order.__getitem__))
    plan.regions.sort(key=lambda r: order[r[0]])
    return plan


def _grow_regions(graph: fx.Graph, verdicts: dict[fx.Node, Verdict], blocks: list[NoGradBlock],
                  parts: Sequence[NoGradBlock] = ()) -> tuple[list[list[fx.Node]], list[NoGradBlock]]:
    """Regions as classes of capturable nodes with the same (segment, stage); and the no_grad
    ``blocks`` that cannot be held by one class (see below).

    A *segment* is the stretch of graph between two barriers: regions never span one. The
    *stage* of a node orders it against the eager nodes (not capturable, e.g. a host read) of its
    segment, as late as possible: for ``n`` feeding ``u`` in the same segment,
    ``stage(u) >= stage(n) + 1`` when ``n`` is eager and ``stage(u) >= stage(n)`` otherwise, every
    node at the largest stage this allows. Along any path the segment never decreases, and within
    a segment the stage never decreases and grows after an eager node, so contracting every region
    keeps the graph acyclic; a segment has one region per eager node it must wait for, plus one.

    A block's capturable nodes must share a stage: each is bounded by the lowest among them and
    the stages are propagated again (lowering a node lowers what feeds it; the inequalities still
    hold), until they agree. They cannot when a path from one of them to another passes an eager
    node; such a block is returned, its switches to stay barriers. The switches, which have
    neither inputs nor users, take their block's stage. Those of the partitioned ``parts`` are in
    no class: they are dropped.

    Written by hand: torch.fx's CapabilityBasedPartitioner (torch 2.13) loops forever when a
    boolean mask and the tensor it indexes both have only getitem users, as every x[mask] has.
    """
    nodes = list(graph.nodes)
    segment_of, segment = {}, 0
    for node in nodes:
        if verdicts[node].barrier:
            segment += 1
        segment_of[node] = segment

    def eager(node: fx.Node) -> bool:
        return not verdicts[node].capturable and node.op not in ("placeholder", "get_attr", "output")

    members = {b: [n for n in b.inner if verdicts[n].capturable] for b in blocks}
    split = [b for b in blocks if _eager_between(members[b], eager)]
    kept = [b for b in blocks if b not in split]
    bound: dict[fx.Node, int] = {}
    for _ in range(len(nodes) + 1):  # the bounds only fall; a few rounds (one per chain of blocks)
        stage: dict[fx.Node, int] = {}
        for node in reversed(nodes):  # users in a later segment come later whatever their stage
            stage[node] = min((stage[u] - eager(node) for u in node.users
                               if segment_of[u] == segment_of[node]), default=len(nodes))
            stage[node] = min(stage[node], bound.get(node, stage[node]))
        lowest = {b: min(stage[n] for n in members[b]) for b in kept}
        if all(stage[n] == lowest[b] for b in kept for n in members[b]):
            break
        bound = {n: lowest[b] for b in kept for n in members[b]}
    else:  # cannot happen (see above); the blocks then keep their barriers
        return _grow_regions(graph, verdicts, [], parts)[0], blocks
    for block in kept:
        stage[block.off] = stage[block.on] = lowest[block]
    dropped = {s for b in parts for s in (b.off, b.on)}
    classes: dict[tuple[int, int], list[fx.Node]] = {}
    for node in nodes:
        if verdicts[node].capturable and node not in dropped:
            classes.setdefault((segment_of[node], stage[node]), []).append(node)
    return list(classes.values()), split


def _eager_between(members: list[fx.Node], eager) -> bool:
    """Whether a path from one of ``members`` to another passes an eager node."""
    inside = set(members)
    frontier = [(u, eager(m)) for m in members for u in m.users]
    seen: set[tuple[fx.Node, bool]] = set()
    while frontier:
        node, through = frontier.pop()
        if (node, through) in seen:
            continue
        seen.add((node, through))
        if through and node in inside:
            return True
        frontier += [(u, through or eager(node)) for u in node.users]
    return False
