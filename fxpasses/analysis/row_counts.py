"""Where a selection's row count, read back from its rows as a Python size, goes.

A loss reads the count of its selected rows as a size (``rows.shape[0]``, ``rows.numel()``); the
trace keeps such a size a node whose value is the space's unbacked symbol ``u`` times a constant
``k`` (``numel`` of ``(u, 17)`` rows is ``17 u``). Gathered into a capacity ``C``, the rows make
that size ``k C``, so each use is judged by what it needs:

* a *size* (``repeat``, ``view``, ``new_zeros``...): ``k C`` is right, and the row walk checks
  that the op keeps the padding rows apart (nothing to do here);
* a *value* in floating arithmetic (``loss / rows.shape[0]``): the true count is needed; the
  rewrite divides by ``k * count`` on the device (:class:`CountUse`);
* a *decision* (a guard): only ``bool(k u)`` with ``k > 0``, true for every count the read lets
  through (a count of 0 abandons the call), keeps its outcome under padding; any other guard
  on a size (``if len(rows) > 3``, an exact size) would decide on ``C``: refused
  (:func:`size_decisions`).

A value of the count is a 0-dim integer tensor where native code had a Python int: for a
floating result the arithmetic is the same; an integer result could promote differently, so only
floating results take the count.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..locations import node_location
from ..ir.trace_ops import GuardOp
from .meta import value

_SYMBOLIC = (torch.SymInt, torch.SymBool, torch.SymFloat)
# floating arithmetic whose size operand is a value, not a shape
_ARITHMETIC_FUNCTIONS = frozenset({
    operator.truediv, operator.mul, operator.add, operator.sub, operator.itruediv, operator.imul,
    operator.iadd, operator.isub, torch.div, torch.true_divide, torch.mul, torch.add, torch.sub})
_ARITHMETIC_METHODS = frozenset({
    "__truediv__", "__rtruediv__", "__rdiv__", "__idiv__", "__itruediv__", "__mul__", "__rmul__",
    "__imul__", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "div",
    "div_", "true_divide", "mul", "mul_", "add", "add_", "sub", "sub_"})


@dataclass(frozen=True)
class CountUse:
    """``user`` reads the size node ``size`` (``factor`` times the row count) as a value."""

    user: str
    size: str
    factor: int


def count_factor(val: Any, symbols: frozenset) -> int | None:
    """``k`` when ``val`` is a SymInt equal to ``k * u`` for a symbol ``u`` of ``symbols`` and a
    positive integer ``k``; else None."""
    if not isinstance(val, torch.SymInt):
        return None
    expr = val.node.expr
    found = expr.free_symbols
    if len(found) != 1 or not found <= symbols:
        return None
    factor = sympy.simplify(expr / next(iter(found)))
    return int(factor) if factor.is_Integer and factor > 0 else None


def _scalar(node: fx.Node) -> bool:
    """A Python-level value (a size, a comparison of sizes), not a tensor."""
    val = value(node)
    return not isinstance(val, torch.Tensor) and (
        isinstance(val, (*_SYMBOLIC, int, float, bool)) or val is None)


def _arithmetic(node: fx.Node) -> bool:
    val = value(node)
    if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
        return False
    if node.op == "call_method":
        return node.target in _ARITHMETIC_METHODS
    return node.op == "call_function" and node.target in _ARITHMETIC_FUNCTIONS


def count_uses(nodes: list[fx.Node], symbols: frozenset) -> list[CountUse]:
    """Every floating arithmetic node among ``nodes`` that takes a size of the rows as an operand."""
    inside = set(nodes)
    uses = []
    for node in nodes:
        factor = count_factor(value(node), symbols)
        if factor is None:
            continue
        uses += [CountUse(user.name, node.name, factor) for user in node.users
                 if user in inside and _arithmetic(user) and node in user.args]
    return uses


def _expected_true(guard: Any) -> bool:
    return getattr(guard, "expected", None) is True


def _truth_of_a_multiple(guard: fx.Node, symbols: frozenset) -> bool:
    """``guard`` checks ``bool(k u) is True`` (``if rows.numel():``), directly or through bool()."""
    if not _expected_true(guard.target) or len(guard.args) != 1 or \
            not isinstance(guard.args[0], fx.Node):
        return False
    checked = guard.args[0]
    if checked.op == "call_function" and checked.target is bool and len(checked.args) == 1 \
            and isinstance(checked.args[0], fx.Node):
        checked = checked.args[0]
    return count_factor(value(checked), symbols) is not None


def size_decisions(nodes: list[fx.Node], symbols: frozenset) -> list[dict]:
    """The guards on a size of the rows (followed through Python-level values) whose outcome
    could change under padding: each as evidence (guard, line, what it checks)."""
    sizes = [n for n in nodes if _scalar(n) and isinstance(value(n), _SYMBOLIC)
             and value(n).node.expr.free_symbols & symbols]
    seen, found, todo = set(sizes), [], list(sizes)
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and isinstance(user.target, GuardOp):
                if not _truth_of_a_multiple(user, symbols):
                    found.append({"guard": user.name, "source": node_location(user) or None,
                                  "checks": user.args[0].format_node()[:160]
                                  if isinstance(user.args[0], fx.Node) else repr(user.args[0]),
                                  "expected": repr(getattr(user.target, "expected", None))})
            elif _scalar(user):
                todo.append(user)
    return found
