"""Two buffers the loss makes and writes in place by the same steps: the same final value.

    a = torch.zeros(n, k); a[idx, j] = v; a[..., :2] *= s      # one branch packs its targets
    b = torch.zeros(n, k); b[idx, j] = v; b[..., :2] *= s      # the other packs them again

Common-subexpression elimination compares pure nodes; a buffer written in place is not one, so
each branch of the real YOLO26 criterion packs the batch's targets again (``preprocess``,
``_batch_keypoints``: eager, rows varying per call). :func:`mirrored_chain` says when the second
buffer's *chain* — every node from the allocation up to the last write of its memory that
depends on it (views, writes, values read from it in between) — repeats the first's node for
node, each with the same op and the same arguments once the second chain's nodes are named by
the first's and earlier shared nodes by what they share: then, read after its last write, the
second buffer holds what the first holds after its own. It holds when, besides (each refused
otherwise, by returning None):

- the first chain ends before the second buffer is made;
- every chain node is torch code (a write as ``set_item`` or an in-place method) or a guard
  of the trace (checking what its counterpart checks), its facts
  complete, no random draw, no gradient (a value without autograd history: targets), the same
  grad mode and dtypes as its counterpart;
- a chain writes only memory of its own nodes (never an input's, nor the loss's state), and no
  node after a chain's last write writes its memory again;
- no memory a chain node reads from outside the chain is written after that node reads it.

Users of the second chain's nodes come after its last write (a node between depends on the
buffer, so it is a chain node): given the first chain's counterpart, they read the same values.
Written by hand: torch.fx's CSE (``cse_pass``) assumes a graph without in-place writes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ir.trace_ops import GuardOp, set_item
from .meta import storages_of, value
from .ops import is_torch_code, node_facts
from .structure_key import argument_key


def writer_positions(writes: dict[fx.Node, frozenset[int]], order: dict[fx.Node, int]) -> dict[int, list[int]]:
    """Storage id -> the positions of the nodes that may write it, in order."""
    found: dict[int, list[int]] = {}
    for node, written in writes.items():
        for storage in written:
            found.setdefault(storage, []).append(order[node])
    return found


def written_after(node: fx.Node, position: int, writers: dict[int, list[int]]) -> bool:
    """Whether memory of ``node``'s value is written by a node placed after ``position``."""
    return any(p > position for s in storages_of(node) for p in writers.get(s, ()))


def chain_key(node: fx.Node, name: Callable[[fx.Node], Any]) -> Any:
    """The op and arguments of a chain node (nodes by ``name``), or None where it may not be in
    a chain (not torch code nor a trace's guard, arguments that cannot be compared). A guard of
    the second chain checks what its counterpart checked, on the same values."""
    guard = node.op == "call_function" and isinstance(node.target, GuardOp)
    if node.op not in ("call_function", "call_method") or not (guard or is_torch_code(node)):
        return None
    args, kwargs = argument_key(node.args, name), argument_key(dict(node.kwargs), name)
    if args is None or kwargs is None:
        return None
    target = node.target.structure() if guard else \
        node.target if node.op == "call_method" or node.target is set_item else id(node.target)
    return (node.op, target, args, kwargs)


def _chain(head: fx.Node, last: fx.Node, order: dict[fx.Node, int], nodes: list[fx.Node]) -> list[fx.Node]:
    """``head`` and the nodes up to ``last`` that depend on it, in order."""
    inside = {head}
    for node in nodes[order[head] + 1:order[last] + 1]:
        if any(a in inside for a in node.all_input_nodes):
            inside.add(node)
    return [n for n in nodes[order[head]:order[last] + 1] if n in inside]


def _gradless(node: fx.Node) -> bool:
    return all(not t.requires_grad for t in pytree.tree_leaves(value(node)) if isinstance(t, torch.Tensor))


def kinds(val: Any) -> tuple:
    """What must agree between two shared values: per leaf, its type, and for a tensor its
    dtype, device, rank and whether it requires grad (sizes may be different symbols)."""
    return tuple((type(leaf).__name__, leaf.dtype, leaf.device, leaf.dim(), leaf.requires_grad)
                 if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                 for leaf in pytree.tree_leaves(val))


def mirrored_chain(first: fx.Node, second: fx.Node, nodes: list[fx.Node], order: dict[fx.Node, int],
                   writes: dict[fx.Node, frozenset[int]], writers: dict[int, list[int]],
                   name: Callable[[fx.Node], Any], grad_modes: dict[fx.Node, Any]) -> dict[fx.Node, fx.Node] | None:
    """Each node of ``second``'s chain -> its counterpart in ``first``'s (see the module
    docstring), or None where the chains are not shown to end equal. ``name`` names a node
    outside the chains as the sharing so far does."""
    mine, theirs = storages_of(first), storages_of(second)
    if not mine or not theirs or mine & theirs:
        return None
    lasts = [max((p for s in memory for p in writers.get(s, ())), default=-1) for memory in (mine, theirs)]
    if min(lasts) < 0 or not lasts[0] < order[second]:
        return None
    chains = [_chain(head, nodes[last], order, nodes) for head, last in zip((first, second), lasts)]
    if len(chains[0]) != len(chains[1]):
        return None
    for chain, last in zip(chains, lasts):
        memory = frozenset().union(*map(storages_of, chain))
        for node in chain:
            facts = node_facts(node)
            if facts is None or not facts.complete or facts.random or not _gradless(node) \
                    or not writes[node] <= memory:
                return None
            if any(written_after(x, order[node], writers) for x in node.all_input_nodes if x not in chain):
                return None
        if any(p > last for s in memory for p in writers.get(s, ())):
            return None
    counterpart: dict[fx.Node, fx.Node] = {second: first}
    for kept, other in zip(*chains):
        if other is not second:
            key = chain_key(kept, name)
            if key is None or key != chain_key(other, lambda n: name(counterpart.get(n, n))):
                return None
        if grad_modes[kept] != grad_modes[other] or kinds(value(kept)) != kinds(value(other)):
            return None
        counterpart[other] = kept
    return counterpart
