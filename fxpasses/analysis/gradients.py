"""Whether a gradient of a graph's outputs reaches a node's value: yes, no, or cannot be told.

    # x.grad is None after backward  iff  no path from x to an output carries a gradient

A walk over the node's users, op by op, each step looked up in :func:`_step`:

* ``stop``: ``detach``, an op run with gradients off (unless it writes into memory made below
  the node: the written tensor keeps the value's history), a result holding no floating tensor
  (a comparison, ``argmax``, an integer cast, ``.item()``), a guard;
* ``carry``: torch's own code with complete shape-propagation facts, an in-place write into
  memory made below the node included (the value moves along the walk);
* ``escape``: torch's own code, with gradients on, writing into memory not made below the node
  (``buffer[mask] = value``): the written tensor carries the value on, and is followed, but
  other views of that memory may read it too, so only a path found to an output decides;
* ``through``: code the trace kept whole (a leaf function or module, a pure run-time op of
  fxpasses) that wrote no Python state, no memory outside the walk and is not impure: its
  arguments' gradients are taken to come only through its results, which the walk follows
  (none when they hold no floating tensor); whether they carry a gradient is not known, so an
  output reached through it leaves the answer undecided;
* ``unknown``: anything else (a node without complete facts, kept-whole code that wrote Python
  state or memory not made below the node, a run-time op with effects): the value may go where
  the walk cannot follow.

The answer is True when an output is reached by ``carry`` and ``escape`` steps alone, False
when every path stops, None (undecided) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ir.proofs import KEPT_WHOLE
from ..ir.runtime_op import RuntimeOp
from ..ir.trace_ops import GuardOp
from .graph import grad_modes
from .meta import value
from .ops import node_facts, storage_id


@dataclass(frozen=True)
class GradientReach:
    """``reaches``: True, False or None (see the module docstring). ``undecided``: the nodes
    that leave it undecided (an ``unknown`` step, or kept-whole code on a path to an output);
    ``through``: the kept-whole calls a False answer looks through (it holds while their
    arguments' gradients come only through their results)."""

    reaches: bool | None
    undecided: tuple[str, ...] = ()
    through: tuple[str, ...] = ()


def gradient_reach(node: fx.Node) -> GradientReach:
    """Whether a gradient of ``node``'s graph's outputs may flow back into ``node``'s value."""
    contained = _fresh_storages_below(node)
    modes = grad_modes(node.graph)
    # (node, the first kept-whole call on the path to it, or None while every step carried)
    stack: list[tuple[fx.Node, str | None]] = [(u, None) for u in node.users]
    seen: set[tuple[fx.Node, str | None]] = set()
    undecided: dict[str, None] = {}
    through: dict[str, None] = {}
    while stack:
        n, via = stack.pop()
        if (n, via) in seen:
            continue
        seen.add((n, via))
        if n.op == "output":
            if via is None:
                return GradientReach(True)
            undecided[via] = None
            continue
        step = _step(n, modes, contained)
        if step in ("unknown", "escape"):
            undecided[n.name] = None
            if step == "unknown":
                continue
        if step == "through":
            through[n.name] = None
            via = via or n.name
            if _stops_gradient(n, value(n)):
                continue
        if step != "stop":
            stack.extend((u, via) for u in n.users)
    if undecided:
        return GradientReach(None, tuple(undecided))
    return GradientReach(False, through=tuple(through))


def _step(n: fx.Node, modes: dict[fx.Node, bool], contained: set[int]) -> str:
    """How a gradient moves from ``n``'s result back to its arguments (module docstring)."""
    target = n.target
    if isinstance(target, GuardOp):
        return "stop"
    facts = node_facts(n)
    if facts is None or not facts.complete:
        return "unknown"
    # an in-place op into memory that the walked value or a computation below it made (whose
    # views and readers are all below it, walked too) moves the value along this walk; a write
    # anywhere else carries it into memory other nodes may read too
    if facts.writes_input and not facts.writes <= contained:
        if not facts.torch_code:
            return "unknown"
        return "escape" if modes[n] else "stop"
    if facts.torch_code:
        if not (modes[n] or facts.writes_input) or _stops_gradient(n, value(n)):
            return "stop"
        return "carry"
    if isinstance(target, RuntimeOp):
        return "through" if target.pure else "unknown"
    kept = n.meta.get(KEPT_WHOLE)
    if kept is None or kept.writes or n.is_impure():
        return "unknown"
    return "through"


def _fresh_storages_below(node: fx.Node) -> set[int]:
    """Storages of ``node``'s value and of every value computed (a kernel ran, not a view) from
    it, transitively: memory that only ``node``'s descendants can reach."""
    found, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        facts, val = node_facts(n), n.meta.get("val")
        fresh = n is node or (facts is not None and facts.complete and facts.computes
                              and not facts.writes_input)
        if fresh and isinstance(val, torch.Tensor):
            found.add(storage_id(val))
        stack.extend(n.users)
    return found


def _stops_gradient(node: fx.Node, val: object) -> bool:
    """``node`` is a detach, or its known result holds no floating tensor (nor a symbolic number)."""
    if node.target in ("detach", torch.detach, torch.Tensor.detach):
        return True
    leaves = pytree.tree_leaves(val)
    known = val is not None and all(isinstance(t, (torch.Tensor, bool, int, float)) for t in leaves)
    return known and not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves)
