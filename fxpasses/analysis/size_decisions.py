"""Decisions on sizes: a size read, or Python arithmetic on sizes and constants.

Such a decision reads no tensor data and computes no kernel: it can be made as soon as the tensors
whose sizes it reads exist. :mod:`fxpasses.tracing.guard_order` moves the guards on them there;
:mod:`fxpasses.analysis.capture_rules` keeps one on the loss's input sizes out of every captured
region, so that it, and its guards, run before any region.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

_METADATA = frozenset(("size", "dim", "numel"))
_SCALAR_FUNCTIONS = frozenset((bool, int, float, abs, torch.sym_int, *(getattr(operator, name) for name in
                              "add sub mul truediv floordiv mod pow neg pos eq ne lt le gt ge not_ "
                              "and_ or_ xor".split())))


def is_size_read(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in _METADATA and isinstance(node.args[0], fx.Node)


def decision(node: Any, cone: dict[fx.Node, None]) -> bool:
    """Whether ``node`` is a size read or Python arithmetic on sizes and constants (its nodes
    gathered into ``cone``)."""
    if not isinstance(node, fx.Node):
        return True
    if node in cone:
        return True
    if is_size_read(node):
        cone[node] = None
        return True
    if node.op == "call_function" and node.target in _SCALAR_FUNCTIONS and not node.kwargs \
            and all(decision(a, cone) for a in node.args):
        cone[node] = None
        return True
    return False


def needs(cone: dict[fx.Node, None]) -> list[fx.Node]:
    """The nodes outside ``cone`` its nodes read (the tensors whose sizes are taken)."""
    return [a for n in cone for a in n.all_input_nodes if a not in cone]


def on_input_sizes(node: fx.Node) -> bool:
    """Whether ``node`` is a size read or Python arithmetic on sizes whose tensors are all the
    loss's inputs: a decision that can be made before anything of the graph runs."""
    cone: dict[fx.Node, None] = {}
    return decision(node, cone) and all(n.op == "placeholder" for n in needs(cone))
