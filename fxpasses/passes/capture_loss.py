"""CaptureLoss: CUDA-graph capture of the loss's capturable regions, forward and backward.

The graph is partitioned (:mod:`fxpasses.analysis.capture`) into maximal regions of capturable
nodes; each region is fused into a submodule (:mod:`fxpasses.analysis.fusion`) and its call is
replaced by a :class:`~fxpasses.runtime.capture.CapturedRegion`, which records and replays it
(:mod:`fxpasses.runtime.capture`). Everything else runs eagerly between regions. Certificates: one
per region (applied), one per source line whose nodes stay eager (a check per node, with its
code), and one per call proven row-independent by an earlier pass (``fxpasses.ir.proofs``): inside a region when its shapes are static; otherwise, when the rows are on
a capture device and zero padding rows are inert (a float64 witness), its one flow call is recorded
per power-of-two row bucket (:mod:`fxpasses.runtime.paired_capture`).

Before planning, work the loss does twice on the same inputs is done once (:mod:`.share_duplicates`:
the two branches' packing of the same targets, each with its host reads; a certificate per group
of shared nodes and per duplicate kept), host reads of the loss's constant tensor state are folded into the graph
(:mod:`.fold_state`, a certificate and an ``unchanged`` assumption each), list indices of device
tensors become constant index tensors on the device (no copy from the host each call), and in-place writes of
the loss's own memory that no region could hold run on a copy where that computes the same
values (:mod:`.copy_writes`, a certificate per such write, copied or kept as a barrier); copies
are undone when no region is captured. Zero buffers sized from data become capacities where a
witness allows (:mod:`.pad_capacity`), grad-mode switches to the mode in effect are dropped
(:mod:`.grad_switches`), and the loss's later host reads of scalars join its first in one transfer
(:mod:`.prefetch_reads`), as does the count work of a later count read, which merges it with an
earlier one (:mod:`.early_counts`). Once planned, work a region does only for a later one beyond
barriers moves into that one where the regions then hold fewer static buffers
(:mod:`.sink_to_regions`). After fusing, count reads that now follow each other with their counts
ready become one wait (:mod:`.merge_reads`), and the nodes after each read that need neither its
counts nor anything computed from them are issued before it, while the counts travel
(:mod:`.overlap_reads`).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..analysis.capture import (CapturePlan, NoGradBlock, Verdict, bucketed_symbols, is_grad_switch, is_state,
                                plan_regions)
from ..analysis.fusion import fuse_region
from ..analysis.fused_order import fused_places, late_reads
from ..analysis.meta import carry_fused_metadata, is_dynamic, tensors_in, value
from ..analysis.witness import padding_witness, witness_holds
from .. import options
from ..certificates import Certificate, Check, Guard, Site
from ..guards import HOOKS, SiteGuard
from ..ir.proofs import RowIndependentCall, proven
from ..pipeline import PassResult, copy_graph_module
from ..ir.runtime_op import RuntimeOp
from ..ir.trace_ops import WriteAttribute
from ..runtime.capture import REGION_GUARDS, SIGNATURE, CaptureRecorder, CapturedRegion
from ..runtime.copy_on_write import OnACopy
from ..runtime.grad_mode import GradOff, GradRestore
from ..runtime.ownership import OwnedOutputs
from ..runtime.paired_capture import PADDED_GUARDS, CapturedPairedCall
from ..locations import node_location
from ..tracing.guard_order import hoist_guards
from .copy_writes import plan_with_copies
from .bounded_counts import bounded_counts
from .unique_counts import unique_count_max
from .fold_constants import device_constants
from .fold_state import device_indices, fold_constant_reads
from .grad_switches import drop_redundant_switches
from .early_counts import early_counts
from .merge_reads import merge_reads
from .overlap_reads import overlap_reads
from .prefetch_reads import prefetch_reads
from .scalar_inputs import scalar_inputs
from .pad_capacity import pad_capacities
from .share_duplicates import share_duplicates
from .sink_to_regions import sink_to_regions

_PREFIX = "capture_region_"
def _histogram(nodes: Sequence[fx.Node], verdicts: dict[fx.Node, Verdict]) -> dict[str, int]:
    return dict(Counter(verdicts[n].op for n in nodes).most_common(12))


def _reentering(nodes: Sequence[fx.Node]) -> tuple[str, ...]:
    """``out -> in`` for each region node reached again from a node outside the region that a
    region node feeds (fusing such a region into one call would make the graph cyclic)."""
    inside = set(nodes)
    found, stack, seen = [], [(u, n) for n in nodes for u in n.users if u not in inside], set()
    while stack:
        node, source = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user in inside:
                found.append(f"{source.name} -> {node.name} -> {user.name}")
            else:
                stack.append((user, source))
    return tuple(found)


def _growing_symbols(gm: fx.GraphModule) -> frozenset:
    """The size symbols of the ints that only grow (``RuntimeOp.only_grows``: capacities, padded
    sizes), as shape propagation gave them."""
    return frozenset(leaf.node.expr for n in gm.graph.nodes
                     if n.op == "call_function" and getattr(n.target, "only_grows", False)
                     for leaf in pytree.tree_leaves(value(n)) if isinstance(leaf, torch.SymInt))


def _growing(args: Sequence[object], grows: frozenset) -> dict[int, tuple[int, ...] | None]:
    """The region arguments that carry a size that only grows: None where the argument is such
    an int (the op's value), else the dims of a tensor argument whose size is one of ``grows``."""
    found: dict[int, tuple[int, ...] | None] = {}
    for i, arg in enumerate(args):
        if not isinstance(arg, fx.Node):
            continue
        if getattr(arg.target, "only_grows", False):
            found[i] = None
            continue
        tensor = value(arg)
        dims = tuple(d for d, size in enumerate(tensor.shape)
                     if isinstance(size, torch.SymInt) and size.node.expr in grows) \
            if isinstance(tensor, torch.Tensor) else ()
        if dims:
            found[i] = dims
    return found


def _switching_off(gm: fx.GraphModule, nodes: list[fx.Node],
                   blocks: Sequence[tuple[NoGradBlock, list[fx.Node]]]) -> list[fx.Node]:
    """``nodes`` with gradients switched off around the nodes of each no_grad block they hold,
    held whole or partitioned (a GradOff before the first, a GradRestore after the last: the
    region runs them as the block did, wherever it is called, restoring the mode it found;
    :mod:`fxpasses.runtime.grad_mode`). The block's own switches leave the region; they are
    dropped once every region is fused (:meth:`CaptureLoss._fuse`).

    ``nodes`` are in the plan's order, the graph's before any region was fused, in which a
    block's nodes are the stretch between its switches; the switches go into that order. (The
    graph's order now may differ: fusing a region moves the users of its values after it, and a
    switch, with no data edge, stays where it was.)"""
    switches = {s for block, _ in blocks for s in (block.off, block.on)}
    ordered = [n for n in nodes if n not in switches]
    for block, held in blocks:
        with gm.graph.inserting_before(held[0]):
            off = gm.graph.call_function(GradOff(f"grad_off_{block.off.name}_{held[0].name}"), ())
        with gm.graph.inserting_after(held[-1]):
            on = gm.graph.call_function(GradRestore(f"grad_restore_{block.on.name}_{held[-1].name}"), (off,))
        off.meta, on.meta = dict(block.off.meta), dict(block.on.meta)
        ordered.insert(ordered.index(held[0]), off)
        ordered.insert(ordered.index(held[-1]) + 1, on)
    stray = [n.name for n in ordered if is_grad_switch(n)]
    if stray:  # a switch whose block this region does not switch: it would leave the mode changed
        raise RuntimeError(f"CaptureLoss: grad-mode switch(es) {stray} in a region without their block")
    return ordered


class CaptureLoss:
    """Capture the loss's static regions in CUDA graphs (see the module docstring).

    Args:
        max_recordings (int): recordings a region keeps (a new signature then replaces the least
            recently replayed); it records at most four times as many in all, then runs new ones
            eagerly.
        record_after (int): the call on which a signature is recorded (the earlier ones run
            eagerly): the second by default, so that a shape seen once (a data-dependent one)
            costs no recording.
        min_region_ops (int): regions launching fewer ops are not worth a replay.
        count_copies (bool): a region must also launch more kernels than a replay adds launches
            (its copies in and out, its two graph launches); False captures every region of
            ``min_region_ops`` kernels (tests of the replay machinery on tiny regions).
        min_bucket (int): the smallest padded row count of a captured paired call.
        recorder (CaptureRecorder, optional): how regions are recorded (default: CUDA graphs; tests
            pass :class:`~fxpasses.runtime.emulated.EmulatedRecorder`).
        devices (Sequence[str]): device types whose tensors may be captured.

    Raises:
        TypeError: an option of the wrong type (a recorder without ``record()`` and
            ``new_pool()``); the message names it.
        ValueError: a count below 1.
    """

    name = "CaptureLoss"

    def __init__(self, *, max_recordings: int = 8, record_after: int = 2, min_region_ops: int = 4,
                 min_bucket: int = 1024, count_copies: bool = True,
                 recorder: CaptureRecorder | None = None, devices: Sequence[str] = ("cuda",)):
        self.max_recordings = options.count("max_recordings", max_recordings, 1)
        self.record_after = options.count("record_after", record_after, 1)
        self.count_copies = options.flag("count_copies", count_copies)
        self.min_region_ops = options.count("min_region_ops", min_region_ops, 1)
        self.min_bucket = options.count("min_bucket", min_bucket, 1)
        if recorder is not None and not all(callable(getattr(recorder, m, None))
                                            for m in ("record", "new_pool")):
            raise TypeError(f"recorder must have record() and new_pool() (a GraphRecorder), "
                            f"got {type(recorder).__name__}: {recorder!r}")
        self.recorder = recorder
        self.devices = options.items("devices", devices, lambda d: isinstance(d, str) and bool(d),
                                     "device types (str)")

    def __repr__(self) -> str:
        return (f"CaptureLoss(max_recordings={self.max_recordings}, record_after={self.record_after}, "
                f"min_region_ops={self.min_region_ops})")

    def run(self, gm: fx.GraphModule) -> PassResult:
        """Replace each capturable region of ``gm`` by a recorded and replayed call.

        Args:
            gm (fx.GraphModule): a traced loss (:func:`fxpasses.trace`), rewritten in place.

        Returns:
            PassResult: ``gm``, whether it changed, and one certificate per region (too small
            ones refused), per source line that stays eager and per row-independent call (one
            refusal when no tensor is on a capture device, or CUDA is unavailable).
        """
        devices = {t.device.type for n in gm.graph.nodes for t in tensors_in(value(n))}
        on_device = bool(devices & set(self.devices))
        cuda_ok = "cuda" not in self.devices or torch.cuda.is_available() or "cuda" not in devices
        if not on_device or not cuda_ok:
            checks = [Check("tensors-on-capture-device", on_device, {
                              "devices_seen": tuple(sorted(devices)), "capture_devices": self.devices},
                            None if on_device else "not-on-capture-device"),
                      Check("cuda-available", cuda_ok, {"cuda_available": torch.cuda.is_available()},
                            None if cuda_ok else "cuda-unavailable")]
            return PassResult(gm, False, [Certificate.from_checks(self.name, Site((), (), "whole loss"),
                                                                  checks)])
        shared = share_duplicates(gm, self.name)
        folded = fold_constant_reads(gm, self.name) + device_indices(gm, self.name, self.devices) + \
            device_constants(gm, self.name, self.devices) + scalar_inputs(gm, self.name, self.devices) + \
            bounded_counts(gm, self.name) + unique_count_max(gm, self.name)
        padded = pad_capacities(gm, self.name)
        prefetched = prefetch_reads(gm, self.name) + early_counts(gm, self.name)
        switches = drop_redundant_switches(gm, self.name)
        unfolded_copies = copy_graph_module(gm)
        plan, writes = plan_with_copies(gm, self.name, self.devices, self.min_region_ops, self.count_copies)
        plan, sunk = sink_to_regions(gm, plan, self.name, lambda: plan_regions(
            gm, self.devices, self.min_region_ops, self.count_copies))
        if not plan.regions and any(c.applied for c in writes):  # copies that gain nothing: undone
            gm = unfolded_copies
            plan = plan_regions(gm, self.devices, self.min_region_ops, self.count_copies)
            writes = [c for c in writes if not c.applied]
        region_certs = [self._region_certificate(gm, i, nodes, plan) for i, nodes in enumerate(plan.regions)]
        if any(not cert.applied and plan.parts_in(nodes) for nodes, cert in zip(plan.regions, region_certs)):
            # a partitioned block's nodes would run eagerly without its switches: none is
            plan = plan_regions(gm, self.devices, self.min_region_ops, self.count_copies, partition=False)
            region_certs = [self._region_certificate(gm, i, nodes, plan) for i, nodes in enumerate(plan.regions)]
        certificates = shared + folded + padded + switches + prefetched + writes + sunk + self._refusals(plan) + \
            self._too_small(plan)
        names = [f"{_PREFIX}{i}" for i, cert in enumerate(region_certs) if cert.applied]
        plan.regions = [nodes for nodes, cert in zip(plan.regions, region_certs) if cert.applied]
        calls = [(node, fact) for node in gm.graph.nodes
                 if (fact := proven(node, RowIndependentCall.kind)) is not None]
        paired = [self._row_independent_call(gm, node, fact, plan) for node, fact in calls]
        regions = [self._capture_padded(gm, node, fact) for (node, fact), cert in zip(calls, paired)
                   if cert.applied and not any(node in r for r in plan.regions)]  # (else in a region)
        if plan.regions:
            regions += self._fuse(gm, plan, names)
        read_certs = merge_reads(gm, self.name) + overlap_reads(gm, self.name) if plan.regions else []
        late = late_reads(gm.graph, fused_places(gm))
        if late:  # the planner replays the fusion to prevent it; a read too late is never run
            raise RuntimeError(f"CaptureLoss: count read(s) {sorted(n.name for n in late)} after their "
                               "check points once fused")
        if regions:
            self._own_outputs(gm, regions)
            # the trace put each size guard just after what it needs; moves since (reads prefetched,
            # regions fused where their last node was) can leave it behind a region: again
            hoist_guards(gm.graph)
        modified = regions or any(c.applied for c in shared + folded + padded + switches + prefetched)
        return PassResult(gm, bool(modified),
                          region_certs + paired + certificates + read_certs)

    def _capture_padded(self, gm: fx.GraphModule, node: fx.Node, fact: RowIndependentCall) -> CapturedRegion:
        """Replace a row-independent call by one that replays it per row bucket (the node keeps
        its arguments: the module, then the rows)."""
        captured = CapturedPairedCall(f"captured_{node.name}", fact.method, devices=self.devices,
                                      min_bucket=self.min_bucket, max_recordings=self.max_recordings,
                                      record_after=self.record_after, recorder=self.recorder)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(captured, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return captured.region

    # -- rewrite --------------------------------------------------------------------------
    def _fuse(self, gm: fx.GraphModule, plan: CapturePlan, names: list[str]) -> list[CapturedRegion]:
        switched = {}  # each no_grad block a fused region switches off around (all of a partitioned one's)
        fused = []
        for name, nodes in zip(names, plan.regions):
            blocks = plan.switched_off_in(nodes)
            switched.update(blocks)
            fused.append(fuse_region(gm, _switching_off(gm, nodes, blocks), name))
        for block in switched:
            gm.graph.erase_node(block.off)
            gm.graph.erase_node(block.on)
        regions = []
        grows = _growing_symbols(gm)
        for node in fused:
            # parameters, buffers and other state read by the graph are used in place, never copied
            identity = frozenset(i for i, a in enumerate(node.args) if is_state(a))
            region = CapturedRegion(node.target, gm.get_submodule(node.target), identity=identity,
                                    max_recordings=self.max_recordings, record_after=self.record_after,
                                    recorder=self.recorder,
                                    input_names=[a.name if isinstance(a, fx.Node) else repr(a) for a in node.args],
                                    growing=_growing(node.args, grows))
            with gm.graph.inserting_before(node):
                call = gm.graph.call_function(region, node.args, node.kwargs)
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            carry_fused_metadata(call, gm.get_submodule(node.target))  # nothing to propagate again
            regions.append(region)
        return regions

    @staticmethod
    def _own_outputs(gm: fx.GraphModule, regions: list[CapturedRegion]) -> None:
        """Route the graph's outputs through one OwnedOutputs (see fxpasses.runtime.ownership),
        and each tensor the loss stores in its own state (``self.anc_strides = ...``) through
        another: the loss keeps it past the call, as a caller keeps an output, so a later
        replay must not write it (nor would the region replay while it holds the memory)."""
        for write in [n for n in gm.graph.nodes if isinstance(n.target, WriteAttribute)]:
            stored = write.args[1]
            if not isinstance(stored, fx.Node) or not tensors_in(value(stored)):
                continue
            with gm.graph.inserting_before(write):
                owned = gm.graph.call_function(OwnedOutputs(f"own_{write.name}", regions), (stored,))
                first = gm.graph.call_function(operator.getitem, (owned, 0))
            write.args = (write.args[0], first, *write.args[2:])
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        leaves = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        with gm.graph.inserting_before(output):
            owned = gm.graph.call_function(OwnedOutputs("own_outputs", regions), tuple(leaves))
        output.args = (owned,) if isinstance(output.args[0], (tuple, list)) else \
            (gm.graph.call_function(operator.getitem, (owned, 0)),)

    # -- certificates ---------------------------------------------------------------------
    def _region_certificate(self, gm: fx.GraphModule, index: int, nodes: list[fx.Node],
                            plan: CapturePlan) -> Certificate:
        inside = set(nodes)
        inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside}
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        the_checks = self._region_checks(gm, nodes, plan)
        effect = {"region": f"{_PREFIX}{index}", "nodes": len(nodes),
                  "kernel_ops": plan.kernel_ops(nodes), "inputs": len(inputs),
                  "outputs": len(outputs),
                  "copy_in": "tensor inputs are copied into static buffers before a replay; "
                             "parameters and buffers are read in place and receive gradients",
                  "copy_out": "every input gradient is cloned out of graph memory; outputs that "
                              "reach the caller are cloned when they lie in graph memory",
                  "memory_pool": "one private pool per region (forward, backward, all recordings)"}
        guards = (*self._run_time_guards(REGION_GUARDS), Guard("no-new-hooks", "whole-loss guard", HOOKS.code))
        site = Site(tuple(n.name for n in nodes), tuple(dict.fromkeys(
            loc for n in nodes if (loc := node_location(n)))), f"capture region {index}")
        return Certificate.from_checks(self.name, site, the_checks, effect=effect, guards=guards)

    def _run_time_guards(self, guards: Sequence[SiteGuard]) -> tuple[Guard, ...]:
        """The certificate's form of a region's run-time guards; the recording one with its budget."""
        budget = {"max_recordings": self.max_recordings, "record_after": self.record_after}
        return tuple(g.as_guard(**budget) if g.code == SIGNATURE.code else g.as_guard() for g in guards)

    def _region_checks(self, gm: fx.GraphModule, nodes: list[fx.Node], plan: CapturePlan) -> list[Check]:
        """What fusing ``nodes`` into one replayed call needs, read from the graph and the plan."""
        inside = set(nodes)
        refused = {n.name: plan.verdicts[n].code for n in nodes if not plan.verdicts[n].capturable}
        static = bucketed_symbols(gm)
        dynamic = tuple(n.name for n in nodes if is_dynamic(value(n), static))
        devices = tuple(sorted({t.device.type for n in nodes for t in tensors_in(value(n))}))
        elsewhere = tuple(d for d in devices if d not in self.devices)
        order = list(gm.graph.nodes)
        position = {n: i for i, n in enumerate(order)}
        span = order[min(map(position.__getitem__, nodes)):max(map(position.__getitem__, nodes)) + 1]
        spanned = [n for n in span if n not in inside and plan.verdicts[n].barrier]
        reentering = _reentering(nodes)
        return [
            Check("ops-capturable", not refused, {"ops": _histogram(nodes, plan.verdicts), "refused": refused,
                                                  "table": "fxpasses.analysis.capture_rules.ROWS"},
                  next(iter(refused.values()), None) or (None if not refused else "op-unknown")),
            Check("static-shapes", not dynamic, {"data_dependent": dynamic, "evidence": "unbacked "
                                                 "sizes in FakeTensorProp metadata, bucketed capacities "
                                                 "excepted (a recording per bucket)"},
                  None if not dynamic else "dynamic-shape"),
            Check("on-capture-device", not elsewhere, {"devices": devices, "capture_devices": self.devices},
                  None if not elsewhere else "device-not-captured"),
            Check("no-barrier-inside", not spanned, {
                "barriers_spanned": tuple(n.name for n in spanned),
                "partitioner": "fxpasses convex greedy regions; fxpasses.analysis.fusion",
                "split_at": "grad-mode switches, ops writing their inputs, user code, nodes without metadata",
                "no_grad_blocks_held_whole": tuple(f"{b.off.name}..{b.on.name} ({len(b.inner)} nodes)"
                                                   for b in plan.blocks_in(nodes)),
                "no_grad_blocks_partitioned": tuple(f"{b.off.name}..{b.on.name} ({len(held)} of its "
                                                    f"{len(b.inner)} nodes here, gradients off around them)"
                                                    for b, held in plan.parts_in(nodes))},
                  None if not spanned else plan.verdicts[spanned[0]].code or "op-unknown"),
            Check("region-convex", not reentering, {"paths_out_and_back": reentering},
                  None if not reentering else "region-not-convex"),
        ]

    def _refusals(self, plan: CapturePlan) -> list[Certificate]:
        """One certificate per source line whose nodes stay eager, a check per node."""
        by_line: dict[str, list[fx.Node]] = {}
        for node, verdict in plan.verdicts.items():
            if verdict.code and (not isinstance(node.target, RuntimeOp) or isinstance(node.target, OnACopy)):
                by_line.setdefault(node_location(node), []).append(node)
        certs = []
        for location, nodes in by_line.items():
            checks = [Check(f"capturable {n.name}", False, {
                "op": plan.verdicts[n].op, "statement": n.format_node()[:200],
                "row": plan.verdicts[n].detail}, plan.verdicts[n].code) for n in nodes]
            codes = ", ".join(dict.fromkeys(c.code for c in checks))
            site = Site(tuple(n.name for n in nodes), (location,) if location else (),
                        f"{len(nodes)} node(s) stay eager: {codes}")
            certs.append(Certificate.from_checks(self.name, site, checks))
        return certs

    def _too_small(self, plan: CapturePlan) -> list[Certificate]:
        certs = []
        for nodes in plan.too_small:
            check = Check("region-size", False, {"kernel_ops": plan.kernel_ops(nodes),
                                                 "copies": plan.copies(nodes),
                                                 "min_region_ops": self.min_region_ops,
                                                 "ops": _histogram(nodes, plan.verdicts)},
                          "region-too-small")
            certs.append(Certificate.from_checks(self.name, Site(tuple(n.name for n in nodes)), [check]))
        return certs

    def _row_independent_call(self, gm: fx.GraphModule, node: fx.Node, fact: RowIndependentCall,
                              plan: CapturePlan) -> Certificate:
        """A call proven row-independent: inside a region if static; else recorded per row
        bucket if padding is safe (the proof licenses padding; a float64 witness checks it)."""
        verdict = plan.verdicts[node]
        where = Site((node.name,), (node_location(node),), f"row-independent call {node.name}")
        inside = any(node in r for r in plan.regions)
        if inside or verdict.code != "dynamic-shape":
            check = Check("call-in-region", inside, {"runs": "inside a region" if inside else
                                                     "eagerly between regions",
                                                     "reason": verdict.detail or verdict.code or ""},
                          None if inside else (verdict.code or "op-unknown"))
            return Certificate.from_checks(self.name, where, [check])
        rows = [value(a) for a in node.args[1:]]
        module = gm.get_submodule(fact.module)
        on_device = all(isinstance(r, torch.Tensor) and r.device.type in self.devices for r in rows)
        checks = [
            Check("rows-on-capture-device", on_device, {"devices": tuple(str(r.device) for r in rows
                                                                          if isinstance(r, torch.Tensor))},
                  None if on_device else "device-not-captured"),
        ]
        witness = None
        if on_device:
            trailing = tuple(int(d) for d in rows[0].shape[1:])
            witness = padding_witness(module, fact.method, trailing)
            holds = witness_holds(witness)
            checks.append(Check("zero-padding-rows-are-inert", holds, {
                "max_abs_value_diff": witness.max_abs_value_diff,
                "max_abs_grad_diff": witness.max_abs_grad_diff}, None if holds else "padding-unsafe"))
        effect = {"runs": "one CUDA graph per power-of-two row bucket", "reason": "row count is data-dependent",
                  "licence": f"row independence of {fact.module}.{fact.method}, proved by certificate "
                             f"{fact.certificate}",
                  "min_bucket": self.min_bucket, "max_recordings": self.max_recordings,
                  "record_after": self.record_after,
                  "copy_in": "the stacked rows, padded with zero rows; parameters and buffers used in place",
                  "copy_out": "every gradient cloned out of graph memory"}
        guards = self._run_time_guards(PADDED_GUARDS)
        return Certificate.from_checks(self.name, where, checks, effect=effect, guards=guards,
                                       witness=witness)
