"""The run-time half of call pairing: one call on stacked rows, split back per branch.

    # f(cat(x, y)) == cat(f(x), f(y))   when f maps each row from that row alone

A :class:`PairedCall` is the ``call_function`` target the pairing pass puts in the graph. On every
call it checks the per-site guards — all branches' rows are plain ``torch.Tensor`` of one dtype and
one device — and otherwise runs the branches' separate native calls, counting the reason. The split
uses each branch's row count of *this* call (unequal and zero counts included); weights are never
stacked or copied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import RuntimeSite, is_propagating


def guard_failure(rows: tuple[torch.Tensor, ...]) -> str | None:
    """The reason code why these rows must not be stacked, or None."""
    first = rows[0]
    if any(type(r) is not torch.Tensor for r in rows):
        return "pair-tensor-subclass"
    if any(r.dtype != first.dtype for r in rows):
        return "pair-dtype-mismatch"
    if any(r.device != first.device for r in rows):
        return "pair-device-mismatch"
    return None


class PairedCall(RuntimeSite):
    """``site(module, *rows) -> tuple(method(r) for r in rows)``, as one call when guards hold.

    Pure and capturable: the row analysis admitted only row-preserving ops without state changes.
    """

    pure = True
    capturable = True

    def __init__(self, site_id: str, method: str):
        super().__init__(site_id)
        self.method = method

    def __call__(self, module: nn.Module, *rows: torch.Tensor) -> tuple[Any, ...]:
        call = module if self.method == "forward" else getattr(module, self.method)
        if is_propagating():
            return self._paired(call, rows)
        reason = guard_failure(rows)
        if reason is not None:
            self.counters[reason] += 1
            return tuple(call(r) for r in rows)
        self.counters["paired"] += 1
        return self._paired(call, rows)

    @staticmethod
    def _paired(call: Any, rows: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        counts = [r.shape[0] for r in rows]
        out = call(torch.cat(rows))
        if isinstance(out, torch.Tensor):
            return torch.split(out, counts)
        leaves, spec = pytree.tree_flatten(out)  # several outputs, each carrying the rows
        parts = [torch.split(leaf, counts) for leaf in leaves]
        return tuple(pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(len(rows)))
