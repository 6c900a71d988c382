"""The run-time half of call pairing: one call on stacked rows, split back per branch.

    # f(cat(x, y)) == cat(f(x), f(y))   when f maps each row from that row alone

A :class:`PairedCall` is the ``call_function`` target the pairing pass puts in the graph. On every
call it checks the per-call guards (:data:`ROW_GUARDS`: all branches' rows are plain
``torch.Tensor`` of one dtype and one device) and otherwise runs the branches' separate native
calls, counting the reason. The split
uses each branch's row count of *this* call (unequal and zero counts included); weights are never
stacked or copied.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..guards import SiteGuard
from ..ir.runtime_op import RuntimeOp

ROW_GUARDS = (  # in the order they are checked
    SiteGuard("rows-plain-tensors", "every branch's rows are plain torch.Tensor", "pair-tensor-subclass",
              lambda rows: all(type(r) is torch.Tensor for r in rows)),
    SiteGuard("rows-one-dtype", "all branches' rows share one dtype", "pair-dtype-mismatch",
              lambda rows: all(r.dtype == rows[0].dtype for r in rows)),
    SiteGuard("rows-one-device", "all branches' rows share one device", "pair-device-mismatch",
              lambda rows: all(r.device == rows[0].device for r in rows)),
)


_STACKED_PROPAGATION = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 11)


def guard_failure(rows: tuple[torch.Tensor, ...]) -> str | None:
    """The code of the first of :data:`ROW_GUARDS` these rows fail (they must not be stacked), or None."""
    return next((guard.code for guard in ROW_GUARDS if not guard.holds(rows)), None)


def split_rows(out: Any, counts: list[int]) -> tuple[Any, ...]:
    """The per-branch parts of ``out`` (a tensor or a structure of tensors carrying the rows)."""
    if isinstance(out, torch.Tensor):
        return torch.split(out, counts)
    leaves, spec = pytree.tree_flatten(out)
    parts = [torch.split(leaf, counts) for leaf in leaves]
    return tuple(pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(len(counts)))


class PairedCall(RuntimeOp):
    """``op(module, *rows) -> tuple(method(r) for r in rows)``, as one call when guards hold.

    Pure and capturable: the row analysis admitted only row-preserving ops without state changes.
    """

    pure = True
    capturable = True

    def __init__(self, op_id: str, method: str):
        super().__init__(op_id)
        self.method = method

    def bound(self, module: nn.Module) -> Callable[[torch.Tensor], Any]:
        return module if self.method == "forward" else getattr(module, self.method)

    def propagate(self, module: nn.Module, *rows: torch.Tensor) -> tuple[Any, ...]:
        """Fake results as the paired call makes them (views of one stacked result): from the
        paired call itself where propagation was tested to hold (torch 2.11 and 2.13); before,
        from each branch's own call (the row analysis proved ``f(cat(x, y)) == cat(f(x),
        f(y))``), because torch 2.4's fake propagation of the method on a sum of data-dependent
        row counts guards (``x[:, 0]`` asks whether ``u1 + u3`` is the largest int) where on
        each count it does not."""
        if _STACKED_PROPAGATION:
            return self.paired(module, rows)
        call = self.bound(module)
        flat = [pytree.tree_flatten(call(r)) for r in rows]
        leaves = [torch.cat(parts) for parts in zip(*(f[0] for f in flat))]
        return split_rows(pytree.tree_unflatten(leaves, flat[0][1]), [r.shape[0] for r in rows])

    def __call__(self, module: nn.Module, *rows: torch.Tensor) -> tuple[Any, ...]:
        reason = guard_failure(rows)
        if reason is not None:
            self.count_code(reason)
            call = self.bound(module)
            return tuple(call(r) for r in rows)
        self.count_event("paired")
        return self.paired(module, rows)

    def paired(self, module: nn.Module, rows: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        return split_rows(self.bound(module)(torch.cat(rows)), [r.shape[0] for r in rows])
