"""Witnesses: float64 comparisons of a rewrite against the native computation on sample rows."""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..certificates import Witness


def relative_gap(a: Any, b: Any, nonfinite_kind: bool = True) -> float:
    """Worst ``|a - b| / (1 + |a|)``; inf for a shape, type or non-finite mismatch (the positions
    of non-finite entries, and with ``nonfinite_kind`` their values: NaN, +inf or -inf)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return 0.0 if a == b else math.inf
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if not a.numel() or torch.equal(a, b):  # equal: the same numbers, none NaN
        return 0.0
    finite = a.isfinite()
    if not (bool(finite.all()) and bool(b.isfinite().all())):  # else: every entry compared
        same = (a == b) | (a.isnan() & b.isnan())
        if not torch.equal(finite, b.isfinite()) or nonfinite_kind and not bool(same[~finite].all()):
            return math.inf
        if not finite.any():
            return 0.0
        a, b = a[finite], b[finite]
    return float(((a - b).abs() / (1 + a.abs())).max())


def _max_abs(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        if x.shape != y.shape:
            return float("inf")
        if x.numel():  # a NaN or inf on one side only is an infinite difference, never 0
            same = (x == y) | (x.isnan() & y.isnan())
            gap = torch.where(same, 0.0, (x - y).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
            worst = max(worst, gap.max().item())
    return worst


def _gradient_gap(reference: list[torch.Tensor], candidate: list[torch.Tensor],
                  wrt: list[torch.Tensor], cotangents: list[torch.Tensor]) -> float:
    """Worst |difference| of the gradients of two computations (unused inputs count as zero).

    A non-finite candidate gradient is an infinite gap: NaN must never pass as rounding.
    """
    def grads(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        found = torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True)
        return [torch.zeros_like(w) if g is None else g for g, w in zip(found, wrt)]

    expected, got = grads(reference), grads(candidate)
    if not all(torch.isfinite(g).all() for g in got):
        return float("inf")
    return _max_abs(expected, got)


def _probe(module: nn.Module, method: str) -> tuple[Any, list[torch.Tensor]]:
    probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    call = probe if method == "forward" else getattr(probe, method)
    return call, [p for p in probe.parameters() if p.requires_grad]


def pairing_witness(module: nn.Module, method: str, trailing: Sequence[int],
                    row_counts: Sequence[Sequence[int]], seed: int = 0) -> Witness:
    """Compare ``method`` called per branch with one call on the stacked rows, in float64 on CPU.

    For each tuple of per-branch row counts (zeros allowed), random rows and random output
    cotangents are drawn; values and the gradients of the rows and of every parameter are
    compared. The worst absolute differences over all draws are the witness.
    """
    call, params = _probe(module, method)
    gen = torch.Generator().manual_seed(seed)
    worst_value = worst_grad = 0.0
    for counts in row_counts:
        rows = [torch.randn(n, *trailing, generator=gen, dtype=torch.float64, requires_grad=True)
                for n in counts]
        native = [pytree.tree_leaves(call(r)) for r in rows]
        stacked = pytree.tree_leaves(call(torch.cat(rows)))
        paired = [[leaf.split(list(counts))[i] for leaf in stacked] for i in range(len(rows))]
        cotangents = [[torch.randn(leaf.shape, generator=gen, dtype=torch.float64) for leaf in out]
                      for out in native]
        flat_native = [leaf for out in native for leaf in out]
        flat_paired = [leaf for out in paired for leaf in out]
        flat_cot = [c for out in cotangents for c in out]
        worst_value = max(worst_value, _max_abs(flat_native, flat_paired))
        worst_grad = max(worst_grad, _gradient_gap(flat_native, flat_paired, [*rows, *params], flat_cot))
    return Witness(seed=seed, dtype="torch.float64",
                   shapes={"row_counts": tuple(tuple(c) for c in row_counts),
                           "trailing": tuple(trailing)},
                   max_abs_value_diff=worst_value, max_abs_grad_diff=worst_grad,
                   compared=("values", "row gradients", f"{len(params)} parameter gradients"))


def witness_holds(witness: Witness, tolerance: float = 1e-9) -> bool:
    """Whether the differences are float64 rounding (NaN or inf never holds)."""
    values: Any = (witness.max_abs_value_diff, witness.max_abs_grad_diff)
    return all(v == v and v <= tolerance for v in values)


def padding_witness(module: nn.Module, method: str, trailing: Sequence[int],
                    row_counts: Sequence[tuple[int, int]] = ((3, 5), (0, 4), (6, 1)),
                    seed: int = 0) -> Witness:
    """Compare ``method`` on real rows with the same rows followed by zero (padding) rows.

    In float64 on CPU: the real rows' values, and the gradients of the rows and of every
    parameter when only the real rows' outputs are used. A padding row whose derivatives are not
    finite would turn those zero gradients into NaN; that shows here as an infinite difference.
    """
    call, params = _probe(module, method)
    gen = torch.Generator().manual_seed(seed)
    worst_value = worst_grad = 0.0
    for real, padding in row_counts:
        rows = torch.randn(real, *trailing, generator=gen, dtype=torch.float64, requires_grad=True)
        padded = torch.cat([rows, torch.zeros(padding, *trailing, dtype=torch.float64)])
        plain = pytree.tree_leaves(call(rows))
        kept = [leaf[:real] for leaf in pytree.tree_leaves(call(padded))]
        cotangents = [torch.randn(leaf.shape, generator=gen, dtype=torch.float64) for leaf in plain]
        worst_value = max(worst_value, _max_abs(plain, kept))
        worst_grad = max(worst_grad, _gradient_gap(plain, kept, [rows, *params], cotangents))
    return Witness(seed=seed, dtype="torch.float64",
                   shapes={"real_and_padding_rows": tuple(row_counts), "trailing": tuple(trailing)},
                   max_abs_value_diff=worst_value, max_abs_grad_diff=worst_grad,
                   compared=("values of real rows", "row gradients", f"{len(params)} parameter gradients"))
