"""Which nodes' values follow the row count of the loss's target tables, which varies per call.

A training loss receives predictions (tensors that require gradients, their shapes fixed by
the model) and targets: tables with one row per labelled object (``batch_idx``, ``bboxes``,
``keypoints``), whose row count changes with every batch. The trace serves every row count (no
guard reads it), but a captured region replays one recording per signature of its inputs: a
region that takes a table's rows, or anything as long as the table, would record again for
nearly every batch. Such nodes run eagerly instead, in front of the regions that read what
they build (a per-image buffer of the most objects in an image, whose size is a capacity).

The row tables are the inputs that do not require gradients, beside inputs that do, whose
leading size is no size of those (an image tensor has the batch's, an anchor grid the anchors').
A row count that happens to equal such a size leaves that input out (its nodes are then planned
as before, recorded per row count). Which nodes follow
their row count is *measured*: the tables' metadata is propagated again at another row count
(:func:`varying_rows`), in the graph's own fake mode, through the nodes it reaches; a node whose
shapes or Python value change follows the row count, and so does every node that reads one of
those (a region holding it would receive the rows). Where that propagation fails at a node,
the node is counted as following them (it then runs eagerly: a slower plan, never another
result). This is a cost decision only: a replay is still keyed on its inputs' shapes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .ops import NODE_FACTS
from .meta import FAKE_MODE, FAKE_INPUTS, PartialFakeTensorProp, quiet_shape_env, value

_PROPAGATED = ("val", "unbacked_bindings", NODE_FACTS)


@dataclass(frozen=True)
class VaryingRows:
    """The row tables (placeholder name -> rows here, rows probed), the nodes whose value
    follows their row count, and the nodes that read one of those."""

    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    follow: frozenset[fx.Node] = frozenset()
    readers: frozenset[fx.Node] = frozenset()

    def __contains__(self, node: object) -> bool:
        return node in self.follow or node in self.readers


NONE = VaryingRows()


def _row_tables(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    inputs = gm.meta.get(FAKE_INPUTS, {})
    tensors = {name: t for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.dim() > 0}
    fixed = {d for t in tensors.values() if t.requires_grad for d in t.shape}
    if not fixed:  # no predictions: nothing says which sizes are the model's
        return {}
    return {name: t for name, t in tensors.items() if not t.requires_grad
            and isinstance(t.shape[0], int) and t.shape[0] not in fixed}


def _graph_sizes(gm: fx.GraphModule) -> set[int]:
    sizes: set[int] = set()
    for node in gm.graph.nodes:
        for leaf in pytree.tree_leaves(value(node)):
            if isinstance(leaf, torch.Tensor):
                sizes |= {d for d in leaf.shape if type(d) is int}
            elif type(leaf) is int:
                sizes.add(leaf)
    return sizes


def _probe_counts(rows: set[int], taken: set[int]) -> dict[int, int]:
    """Another row count for each count in ``rows``: odd, above every size the graph holds."""
    probe, found = max(taken | {1}) * 2 + 1, {}
    for count in sorted(rows):
        while probe in taken:
            probe += 2
        found[count] = probe
        taken.add(probe)
    return found


def _differs(old: Any, new: Any) -> bool:
    """Whether ``new`` (propagated at the probe row count) is not ``old`` in shape or Python
    value; data-dependent sizes (fresh symbols each time) compare equal to each other."""
    old_leaves, old_spec = pytree.tree_flatten(old)
    new_leaves, new_spec = pytree.tree_flatten(new)
    if old_spec != new_spec:
        return True
    for a, b in zip(old_leaves, new_leaves):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return True
        if isinstance(a, torch.Tensor):
            if a.dtype != b.dtype or a.dim() != b.dim() or any(
                    _size_differs(x, y) for x, y in zip(a.shape, b.shape)):
                return True
        elif _size_differs(a, b):
            return True
    return False


def _size_differs(a: Any, b: Any) -> bool:
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    if isinstance(a, symbolic) or isinstance(b, symbolic):
        return isinstance(a, symbolic) != isinstance(b, symbolic)
    try:
        return bool(a != b)
    except Exception:  # an object without a plain comparison: not a size
        return False


def _old_value(gm: fx.GraphModule, prop: PartialFakeTensorProp, node: fx.Node,
               saved: dict[fx.Node, dict]) -> Any:
    """What ``node`` was propagated to before the probe (its metadata as annotated)."""
    if node.op == "placeholder":
        return gm.meta[FAKE_INPUTS][node.name]
    if node.op == "get_attr":
        return prop.fetch_attr(node.target)
    return saved[node].get("val") if node in saved else value(node)


def varying_rows(gm: fx.GraphModule) -> VaryingRows:
    """The nodes of an annotated ``gm`` whose value follows the row count of its row tables, and
    their readers (see the module docstring); every node's metadata is left as it was."""
    tables = _row_tables(gm)
    mode = gm.meta.get(FAKE_MODE)
    if not tables or mode is None:
        return NONE
    probes = _probe_counts({t.shape[0] for t in tables.values()}, _graph_sizes(gm))
    prop = PartialFakeTensorProp(gm, mode)
    follow: set[fx.Node] = set()
    readers: set[fx.Node] = set()
    saved: dict[fx.Node, dict] = {}
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # an op failing at the probe count is a finding, not an error
    try:
        with mode, quiet_shape_env():
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    table = tables.get(node.name)
                    if table is not None:
                        shape = (probes[table.shape[0]], *table.shape[1:])
                        prop.env[node] = torch.empty(shape, dtype=table.dtype, device=table.device)
                        follow.add(node)
                    continue
                if node.op == "output" or follow.isdisjoint(node.all_input_nodes):
                    continue
                for arg in node.all_input_nodes:
                    if arg not in follow and arg not in prop.env:
                        prop.env[arg] = _old_value(gm, prop, arg, saved)
                saved[node] = {k: node.meta.pop(k) for k in _PROPAGATED if k in node.meta}
                old = saved[node].get("val")
                result = prop.run_node(node)
                failed = "val" not in node.meta and node.op.startswith("call")
                if failed or _differs(old, node.meta.get("val", result)):
                    follow.add(node)
                    prop.env[node] = result
                else:
                    readers.add(node)
    finally:
        fake_log.setLevel(level)
        for node, meta in saved.items():
            for key in _PROPAGATED:
                node.meta.pop(key, None)
            node.meta.update(meta)
        pending = getattr(mode.shape_env, "pending_fresh_unbacked_symbols", None)
        if pending:
            pending.clear()
    placeholders = {n for n in follow if n.op == "placeholder"}
    return VaryingRows({name: (t.shape[0], probes[t.shape[0]]) for name, t in tables.items()},
                       frozenset(follow - placeholders), frozenset(readers))
