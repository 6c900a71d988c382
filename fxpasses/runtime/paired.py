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
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..guards import SiteGuard, ambient_state
from ..ir.runtime_op import RuntimeOp

ROW_GUARDS = (  # in the order they are checked
    SiteGuard("rows-plain-tensors", "every branch's rows are plain torch.Tensor", "pair-tensor-subclass",
              lambda rows: all(type(r) is torch.Tensor for r in rows)),
    SiteGuard("rows-one-dtype", "all branches' rows share one dtype", "pair-dtype-mismatch",
              lambda rows: all(r.dtype == rows[0].dtype for r in rows)),
    SiteGuard("rows-one-device", "all branches' rows share one device", "pair-device-mismatch",
              lambda rows: all(r.device == rows[0].device for r in rows)),
)


def _static(sizes: Any) -> bool:
    return all(type(d) is int for d in sizes)


def _same_size(a: Any, b: Any) -> bool:
    """Equal sizes, a symbolic one by its expression (comparing would guard on it)."""
    if type(a) is int and type(b) is int:
        return a == b
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr


def _one_row_per_row(out: list[Any], rows: torch.Tensor) -> bool:
    """Every result is a tensor on the rows' device with one row per row and static trailing sizes."""
    return all(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.device == rows.device
               and _same_size(t.shape[0], rows.shape[0]) and _static(t.shape[1:]) for t in out)


def _propagation_key(module: nn.Module, method: str, rows: torch.Tensor) -> tuple | None:
    """What a branch's propagated results depend on besides its row count; None (run it every
    time) where the rows are real (``propagate`` also computes values: a witness runs the flow
    through it) or their trailing sizes are not plain ints."""
    if not isinstance(rows, FakeTensor) or not _static(rows.shape[1:]):
        return None
    state = tuple((t.dtype, t.device, t.requires_grad) for t in (*module.parameters(), *module.buffers()))
    return (id(module), type(module), method, tuple(rows.shape[1:]), rows.dtype, rows.device,
            rows.requires_grad, state, ambient_state())


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
        self._propagated: dict[tuple, tuple[list, Any]] = {}  # see propagate

    def bound(self, module: nn.Module) -> Callable[[torch.Tensor], Any]:
        return module if self.method == "forward" else getattr(module, self.method)

    def propagate(self, module: nn.Module, *rows: torch.Tensor) -> tuple[Any, ...]:
        """Fake results as the paired call makes them (views of one stacked result), from each
        branch's own call: the row analysis proved ``f(cat(x, y)) == cat(f(x), f(y))``, and on
        torch 2.4 fake propagation of the method on a sum of data-dependent row counts guards
        (``x[:, 0]`` asks whether ``u1 + u3`` is the largest int) where on each count it does not.

        On fake rows, a branch's call is propagated once per :func:`_propagation_key` (the
        rows' trailing sizes, dtype, device and grad flag, the module's tensors' dtypes and
        devices, grad mode and autocast): its results have one row per row (row independence),
        so later ones are made with the leaf sizes, dtypes and flags it gave (the stacked result
        is a new contiguous tensor either way)."""
        call = self.bound(module)
        flat = [self._branch_result(module, call, r) for r in rows]
        leaves = [torch.cat(parts) for parts in zip(*(f[0] for f in flat))]
        return split_rows(pytree.tree_unflatten(leaves, flat[0][1]), [r.shape[0] for r in rows])

    def _branch_result(self, module: nn.Module, call: Callable, rows: torch.Tensor) -> tuple[list, Any]:
        key = _propagation_key(module, self.method, rows)
        made = self._propagated.get(key) if key is not None else None
        if made is not None:
            leaves, spec = made
            return [rows.new_empty((rows.shape[0], *trailing), dtype=dtype).requires_grad_(grad)
                    for trailing, dtype, grad in leaves], spec
        out, spec = pytree.tree_flatten(call(rows))
        if key is not None and _one_row_per_row(out, rows):
            self._propagated[key] = ([(tuple(t.shape[1:]), t.dtype, t.requires_grad) for t in out], spec)
        return out, spec

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
