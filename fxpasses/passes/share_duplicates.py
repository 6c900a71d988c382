"""Work the loss does twice on the same inputs, done once: common subexpressions, proven pure.

A dual-branch loss prepares the same targets in each branch (the real YOLO26 criterion packs the
batch's boxes and keypoints per image in ``one2many`` and again in ``one2one``: ``unique``,
``bincount``, ``int(counts.max())``); each preparation reads a count on the host, a
synchronisation per branch. :func:`share_duplicates` keeps the first of two nodes that compute
the same thing and hands its value to the second's users.

Two nodes compute the same thing when they call the same torch op (function or method) with
the same arguments, node arguments compared after sharing (so a chain of duplicates is shared
node by node). That is enough for equal values when, besides, (checked per pair, each failure a
refusal with its code):

- the op is pure: no write to its inputs (``NodeFacts.writes_input``), no random draw, facts
  complete; fxpasses' own ops (guards, reads of the loss's state, set-item) are never shared;
- no node placed after either of the two writes in place to the memory of its value or of its
  inputs (every node's written storages from shape propagation; a node whose facts are partial or
  absent may write all its inputs), and no user resizes either value in place: the shared value
  is the same at every use as the two were;
- both run in the same grad mode (a ``no_grad`` block around one of them gives it no autograd
  history; shape metadata cannot tell, its inputs are detached; hooks on a traced tensor are
  refused by the trace, ``requires_grad_`` is a resize above), and the two values have the same
  dtypes, devices and kinds (else the op read state its arguments do not show: impure). A value with
  gradients shared by two uses gets their sum through one backward node: native's gradient up
  to rounding.

A buffer the loss makes and writes in place (the packed targets) is no pure node; the second of
two buffers whose write chains repeat each other step for step is the first
(:func:`~fxpasses.analysis.write_chains.mirrored_chain`: the second chain's nodes share the first
chain's, and what reads the second buffer after its last write reads the first). A node whose
Sizes read from two inputs of the same shape through the same ops (each branch's batch size,
read from its own predictions) count as one when that lets a duplicate share; the second is then
checked against the first on every call (``ExpectEqualSizes``: a call where they differ is
abandoned and runs natively), and none is taken after a write of an input or of the loss's state.
So are two reads of the loss's state that give one tensor (each branch's ``self.stride``, the
model's): the second read is checked to give the same object on every call (``ExpectSameObject``).

torch's own CSE (``torch.fx.passes.dialect.common.cse_pass``) assumes a functional graph; this
graph has in-place ops, hence the write check. The second node's unbacked sizes are renamed to
the first's in the shape environment (``rebind_unbacked``), so the metadata of everything
downstream stays true without propagating it again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import rebind_unbacked

from ..analysis.capture import is_state
from ..analysis.meta import ANNOTATED, FAKE_MODE, annotate_new, input_names, resizes_in_place, storages_of, value
from ..analysis.write_chains import chain_key, kinds, mirrored_chain, writer_positions, written_after
from ..analysis.ops import is_torch_code, node_facts
from ..ir.trace_ops import ExpectEqualSizes, ExpectSameObject, ReadSource, set_item
from ..certificates import Certificate, Check, Guard, Site
from ..locations import node_location
from .grad_switches import traced_grad_modes


def _node_key(node: fx.Node, name: Callable[[fx.Node], Any]) -> Any:
    if node.op not in ("call_function", "call_method"):
        return None
    if not is_torch_code(node) or node.target is set_item or not node.users \
            or getattr(node.target, "__name__", "").startswith("_"):
        return None  # (a write; an effect, as a grad-mode or autocast switch; torch's internals)
    return chain_key(node, name)


def _may_write(node: fx.Node) -> frozenset[int]:
    """The storages ``node`` writes; all its inputs' where its facts are partial or absent (a
    run-time op of an earlier pass, a node propagation did not finish)."""
    facts = node_facts(node)
    if facts is not None and facts.complete:
        return facts.writes
    if not node.op.startswith("call"):
        return frozenset()
    return frozenset().union(*(storages_of(a) for a in node.all_input_nodes))


def _visible_writes(writes: dict[fx.Node, frozenset[int]]) -> dict[fx.Node, fx.Node | None]:
    """Per node, the first earlier node that may write memory of an input or of the loss's state
    (a guard placed after it could not abandon the call without a visible effect), or None."""
    outside = frozenset().union(*(storages_of(n) for n in writes if n.op == "placeholder" or is_state(n)))
    found: dict[fx.Node, fx.Node | None] = {}
    first = None
    for node, written in writes.items():
        found[node] = first
        if first is None and written & outside:
            first = node
    return found


def _equal_sizes(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """``t2.size(d) -> t1.size(d)`` for sizes of two tensors made by the same ops from inputs
    of the same shape and dtype (the two branches' predictions): equal in this call, and
    equal in every call that the guard a share of them adds lets through (taken only where no
    write of an input or of the loss's state precedes the second size: an abandoned call has
    shown nothing)."""
    provenance: dict[fx.Node, Any] = {}
    for node in nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and \
                all(type(d) is int for d in val.shape):
            provenance[node] = ("input", tuple(val.shape), str(val.dtype))
        elif node.op in ("call_function", "call_method") and is_torch_code(node):
            provenance[node] = _node_key(node, lambda n: provenance.get(n, ("node", n.name)))
        if provenance.get(node) is None:
            provenance[node] = ("node", node.name)
    first: dict[Any, fx.Node] = {}
    equal: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_method" and node.target == "size" and len(node.args) == 2 and \
                type(node.args[1]) is int and not node.kwargs and type(node.meta.get("val")) is int:
            kept = first.setdefault((provenance[node.args[0]], node.args[1], node.meta["val"]), node)
            if kept.args[0] is not node.args[0]:
                equal[node] = kept
    return equal


def _same_objects(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """``read2 -> read1`` for reads of the loss's state at two paths (``one2one.stride``,
    ``one2many.stride``) that give the same tensor now: the same in every call that the guard a
    share of them adds lets through."""
    first: dict[int, fx.Node] = {}
    same: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and isinstance(node.target, ReadSource) and not node.args \
                and node.target.source is not None:
            held = node.target()
            if isinstance(held, torch.Tensor):
                kept = first.setdefault(id(held), node)
                if kept is not node:
                    same[node] = kept
    return same


def _refusal(kept: fx.Node, other: fx.Node, order: dict[fx.Node, int], writers: dict[int, list[int]],
             grad_modes: dict[fx.Node, Any]) -> tuple[str, dict] | None:
    """Why ``other`` may not take ``kept``'s value (a code and its evidence), or None."""
    for node in (kept, other):
        facts = node_facts(node)
        if facts is None or not facts.complete or facts.writes_input or facts.random:
            return "duplicate-impure", {"node": node.name, "facts": "none" if facts is None else {
                "complete": facts.complete, "writes_input": facts.writes_input, "random": facts.random}}
    # memory written before a node reads it (a buffer packed in place, then read) is final there
    touched = [n for node in (kept, other) for n in (node, *node.all_input_nodes)
               if written_after(n, order[node], writers)]
    if touched:
        return "duplicate-written", {"written_in_place": sorted({n.name for n in touched})}
    resized = [u.name for n in (kept, other) for u in n.users if resizes_in_place(u)]
    if resized:
        return "duplicate-written", {"resized_in_place_by": resized}
    if grad_modes[kept] != grad_modes[other]:
        return "duplicate-autograd", {"grad_mode": {kept.name: str(grad_modes[kept]),
                                                    other.name: str(grad_modes[other])}}
    if kinds(value(kept)) != kinds(value(other)):
        return "duplicate-impure", {"kinds_differ": {kept.name: str(kinds(value(kept))),
                                                     other.name: str(kinds(value(other)))}}
    return None


def _namer(*taken: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], Any]:
    """Names nodes for keys: a node that takes another's value (shared, in a repeated chain, an
    equal size or state read) by that one's name."""
    def name(node: fx.Node) -> Any:
        return ("node", next((t[node] for t in taken if node in t), node).name)
    return name


def _scan(nodes: list[fx.Node], mirrored: dict[fx.Node, fx.Node], equal: dict[fx.Node, fx.Node],
          order: dict[fx.Node, int], writers: dict[int, list[int]], grad_modes: dict[fx.Node, Any],
          ) -> tuple[dict[fx.Node, fx.Node], list[tuple[fx.Node, fx.Node, tuple[str, dict]]]]:
    """Each node that takes an earlier one's value (nodes of ``mirrored`` chains named by their
    counterparts), and each pair refused: (kept, other, why)."""
    shared: dict[fx.Node, fx.Node] = {}
    first: dict[Any, fx.Node] = {}
    refused = []
    for node in nodes:
        if node in mirrored:
            continue
        key = _node_key(node, _namer(shared, mirrored, equal))
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        why = _refusal(kept, node, order, writers, grad_modes)
        if why is None:
            shared[node] = kept
        else:
            refused.append((kept, node, why))
    return shared, refused


def share_duplicates(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Give each node that duplicates an earlier one (see the module docstring) the earlier
    one's value, erase it, and certify each group of shared nodes (one certificate per source
    location pair) and each duplicate refused. ``gm`` must carry shape metadata (annotate)."""
    nodes = list(gm.graph.nodes)
    if any(n.op.startswith("call") and node_facts(n) is None and "val" not in n.meta for n in nodes):
        return []  # propagation stopped somewhere: writes are not all known
    order = {n: i for i, n in enumerate(nodes)}
    writes = {n: _may_write(n) for n in nodes}
    writers = writer_positions(writes, order)
    visible = _visible_writes(writes)  # a guard after a write of an input or state: not abandonable
    equal = {other: kept for other, kept in (_equal_sizes(nodes) | _same_objects(nodes)).items()
             if visible[other] is None}
    grad_modes = traced_grad_modes(gm, nodes)
    mirrored: dict[fx.Node, fx.Node] = {}  # a buffer's write chain -> the earlier chain it repeats
    while True:  # until no chain newly shown to repeat another lets more nodes share
        shared, refused = _scan(nodes, mirrored, equal, order, writers, grad_modes)
        name = _namer(shared, mirrored, equal)
        found: dict[fx.Node, fx.Node] = {}
        for kept, other, why in refused:
            if why[0] != "duplicate-written":  # (only a buffer written in place may head a chain)
                continue
            chain = mirrored_chain(kept, other, nodes, order, writes, writers, name, grad_modes) or {}
            if found.keys().isdisjoint({*chain, *chain.values()}):  # each node in one chain at most
                found.update(chain)
        if not found:
            break
        mirrored.update(found)
    refused = [_certificate(pass_name, kept, [other], why) for kept, other, why in refused]
    shared = {**shared, **mirrored}
    # only where it let a duplicate share; not for a size shared itself with the one it equals
    # (it computes that one's value from the same inputs: its guard would compare a node with itself)
    equal = {other: kept for other, kept in equal.items()
             if any(u in shared for u in other.users) and shared.get(other) is not kept}
    if not shared:
        return refused
    guards = {other: _guard(gm, kept, other) for other, kept in equal.items()}
    guarded_by = {n: [guards[o] for o in n.all_input_nodes if o in guards] for n in shared}
    mode = gm.meta[FAKE_MODE]
    for other, kept in shared.items():
        rebind_unbacked(mode.shape_env, other, value(kept))
    readers = {u for other in [*shared, *equal] for u in other.users if u not in shared}
    # a reader of a chain's view now reads the other buffer's memory: propagated again below
    viewers = {u for other in mirrored for u in other.users if u not in shared}
    for other, kept in shared.items():
        other.replace_all_uses_with(kept)
    for other, kept in equal.items():  # the guard alone reads the second size
        other.replace_all_uses_with(kept, delete_user_cb=lambda user, g=guards[other]: user is not g)
    for reader in readers - viewers:  # rewired to a node of the same value: nothing to propagate again
        if ANNOTATED in reader.meta:
            reader.meta[ANNOTATED] = input_names(reader)
    groups: dict[tuple[str, str, bool], list[fx.Node]] = defaultdict(list)
    for other in shared:
        groups[(node_location(shared[other]), node_location(other), other in mirrored)].append(other)
    for other in sorted(shared, key=order.__getitem__, reverse=True):
        gm.graph.erase_node(other)
    gm.recompile()
    if viewers:
        annotate_new(gm)
    return [_certificate(pass_name, shared[group[0]], group, None, [shared[o] for o in group],
                         [_guard_record(g) for g in dict.fromkeys(g for n in group for g in guarded_by[n])],
                         writes=sum(bool(writes[o]) for o in group) if chain else None)
            for (_, _, chain), group in groups.items()] + refused


def _guard(gm: fx.GraphModule, kept: fx.Node, other: fx.Node) -> fx.Node:
    """``ExpectEqualSizes(kept, other)`` (``ExpectSameObject`` for reads of the loss's state)
    just after ``other``: a call where they differ is abandoned before anything computed with
    ``kept`` for ``other`` is used."""
    location = node_location(other)
    check = ExpectSameObject if isinstance(other.target, ReadSource) else ExpectEqualSizes
    with gm.graph.inserting_after(other):
        guard = gm.graph.call_function(check(f"expect_equal_{other.name}", location or other.name),
                                       (kept, other))
    guard.meta["stack_trace"] = other.meta.get("stack_trace")
    return guard


def _guard_record(guard: fx.Node) -> Guard:
    kept, other = guard.args
    what = "object" if isinstance(guard.target, ExpectSameObject) else "sizes"
    return Guard(guard.name, f"{other.name} == {kept.name}: the {what} the shared nodes took as "
                 "equal are, else the call is abandoned", "guard-failed",
                 {"kept": kept.name, "other": other.name, "location": node_location(other)})


def _certificate(pass_name: str, kept: fx.Node, others: list[fx.Node], why: tuple[str, dict] | None,
                 kept_all: list[fx.Node] | None = None, guards: list[Guard] = (),
                 writes: int | None = None) -> Certificate:
    """``writes``: for nodes of a write chain that repeats an earlier one, how many of them write."""
    kept_all = kept_all or [kept]
    where = [loc for loc in dict.fromkeys(node_location(n) for n in (*kept_all, *others)) if loc]
    names = [n.name for n in others]
    evidence = {"kept": [n.name for n in kept_all], "shared": names,
                "ops": sorted({n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                               for n in others})}
    if writes is not None:
        evidence["write_chain"] = (f"{len(others)} node(s), {writes} writing in place, repeat the earlier "
                                   "buffer's chain step for step; read after its last write")
    checks = [Check("duplicate-computes-the-same", why is None,
                    evidence | (why[1] if why else {}), why[0] if why else None)]
    site = Site(tuple(names), tuple(where),
                f"{len(names)} node(s) computing what {', '.join(n.name for n in kept_all[:3])}"
                f"{'...' if len(kept_all) > 3 else ''} computed: "
                f"{'shared' if why is None else 'kept separate'}")
    effect = {"nodes_removed": len(names)} if why is None else {}
    return Certificate.from_checks(pass_name, site, checks, effect=effect, guards=tuple(guards))
