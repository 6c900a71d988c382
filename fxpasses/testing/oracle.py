"""A float64 equivalence oracle: do two callables compute the same values and gradients?

``compare(reference, candidate, args, kwargs)`` runs each callable on its own copy of the inputs,
in float64 on the CPU, and compares:

* every output leaf (outputs may be any pytree, e.g. :class:`DualLossOutput`), NaN positions
  and infinities included: a NaN matches only a NaN, an inf only the same inf;
* the gradient of every input tensor that requires grad, by key path (``args[0].o2m.scores``);
* the gradient of every parameter, by name. A parameter outside the autograd graph (gradient
  None) differs from one with a zero gradient: DDP needs every parameter used.

The scalar that is differentiated (:func:`weighted_objective`) is ``sum_i (out_i * w_i).sum()``
over the floating output leaves, with fixed random weights ``w_i`` (seeded by position), so every
output's gradient path is exercised. Preparation: the callable and the inputs are deep-copied
together (modules they share stay shared); the copied modules (the callable itself if it is a
Module, else the Modules among its attributes) and the floating input tensors move to CPU
float64; inputs that required grad become fresh leaves. A plain function is not copied: modules it
reaches through globals or closures are used as they are. Each call runs under
``torch.manual_seed(seed)`` in a forked RNG. A copied :class:`~fxpasses.optimize.OptimizedLoss` is
built afresh (its pickling state is the loss and its options), so it traces again, in float64.

A pass is ``|cand - ref| <= atol + rtol * |ref|`` elementwise; the report's ``worst`` is the item
with the largest ratio ``|cand - ref| / (atol + rtol * |ref|)``.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Comparison:
    """One compared item: an output leaf, an input gradient or a parameter gradient.

    Attributes:
        where (str): what was compared (``output .total``, ``grad args[0].o2m.scores``,
            ``grad param flow.w``).
        ok (bool): within the tolerances, structure and non-finite positions equal.
        kind (str): what differed: value, shape, nan, missing, type, structure, requires-grad.
        ratio (float): the worst ``|cand - ref| / (atol + rtol |ref|)``; inf for a structural
            difference.
        max_abs (float), max_rel (float): the largest absolute and relative differences.
        index (tuple[int, ...]): where the worst element is.
        reference, candidate: the worst element's two values (or a description).
    """

    where: str  # "output .total", "grad args[0].o2m.scores", "grad param flow.masks"
    ok: bool
    kind: str  # value | shape | nan | missing | type | structure | requires-grad
    ratio: float  # worst |cand - ref| / (atol + rtol |ref|); inf for structural differences
    max_abs: float = 0.0
    max_rel: float = 0.0
    index: tuple[int, ...] = ()
    reference: Any = None  # the reference value at ``index`` (or a description)
    candidate: Any = None

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        at = f" at {list(self.index)}" if self.index else ""
        return (f"{status} {self.where}: {self.kind}, max abs {self.max_abs:.3g}, max rel "
                f"{self.max_rel:.3g}{at} (reference {self.reference}, candidate {self.candidate})")


@dataclass(frozen=True)
class EquivalenceReport:
    """Every comparison made, the tolerances, and the worst difference.

    Attributes:
        comparisons (tuple[Comparison, ...]): one per output leaf and gradient.
        rtol (float), atol (float): the tolerances they were judged by.
        ok (bool): every comparison passed.
        failures (tuple[Comparison, ...]): those that did not.
        worst (Optional[Comparison]): the largest ratio, failures first (None: nothing compared).

    ``str(report)`` is the readable summary.
    """

    comparisons: tuple[Comparison, ...]
    rtol: float
    atol: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def failures(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if not c.ok)

    @property
    def worst(self) -> Comparison | None:
        return max(self.comparisons, key=lambda c: (not c.ok, c.ratio), default=None)

    def __str__(self) -> str:
        head = (f"equivalent: {len(self.comparisons)} items within rtol={self.rtol:g}, "
                f"atol={self.atol:g}" if self.ok else
                f"NOT equivalent: {len(self.failures)} of {len(self.comparisons)} items differ "
                f"beyond rtol={self.rtol:g}, atol={self.atol:g}")
        worst = self.worst
        lines = [head] + ([f"worst: {worst.line()}"] if worst else [])
        lines += [f"  {c.line()}" for c in self.failures if c is not worst]
        return "\n".join(lines)


@dataclass
class _Run:
    outputs: list[Any]
    out_spec: Any
    input_grads: dict[str, Tensor | None]
    param_grads: dict[str, Tensor | None]


def compare(reference: Callable, candidate: Callable, args: tuple = (), kwargs: dict | None = None,
            *, rtol: float = 1e-7, atol: float = 1e-9, seed: int = 0,
            parameters: bool = True) -> EquivalenceReport:
    """Compare ``reference(*args, **kwargs)`` and ``candidate(...)``; see the module docstring.

    Args:
        reference (Callable): the callable trusted (the native loss).
        candidate (Callable): the callable checked (an optimized loss).
        args (tuple): positional arguments, any pytree; each callable gets its own float64 copy.
        kwargs (dict, optional): keyword arguments, likewise.
        rtol (float): relative tolerance of each element.
        atol (float): absolute tolerance of each element.
        seed (int): ``torch.manual_seed`` of each call (the same for both).
        parameters (bool): compare parameter gradients; False skips them (e.g. a candidate that
            is a plain function).

    Returns:
        EquivalenceReport: every comparison (output leaves, input and parameter gradients) and
        the worst; ``report.ok`` when all are within tolerance. A different output structure is
        one failed comparison.

    Raises:
        Exception: what ``reference`` or ``candidate`` raises (a call is not compared if it
            fails).
    """
    kwargs = dict(kwargs or {})
    ref = _run(reference, args, kwargs, seed)
    cand = _run(candidate, args, kwargs, seed)
    if ref.out_spec != cand.out_spec:
        item = Comparison("output structure", False, "structure", math.inf,
                          reference=str(ref.out_spec), candidate=str(cand.out_spec))
        return EquivalenceReport((item,), rtol, atol)
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(ref.outputs, ref.out_spec))[0]]
    items = [compare_leaf(f"output {path}", r, c, rtol, atol)
             for path, r, c in zip(paths, ref.outputs, cand.outputs)]
    items += _compare_grads("grad", ref.input_grads, cand.input_grads, rtol, atol)
    if parameters:
        items += _compare_grads("grad param", ref.param_grads, cand.param_grads, rtol, atol)
    return EquivalenceReport(tuple(items), rtol, atol)


def assert_equivalent(reference: Callable, candidate: Callable, args: tuple = (),
                      kwargs: dict | None = None, **options: Any) -> EquivalenceReport:
    """:func:`compare`, raising unless equivalent.

    Args:
        reference, candidate, args, kwargs: as :func:`compare`.
        **options: ``rtol``, ``atol``, ``seed``, ``parameters`` of :func:`compare`.

    Returns:
        EquivalenceReport: the report, every comparison within tolerance.

    Raises:
        AssertionError: some comparison is not; the message is the report (the worst item
            first, then every failure).
    """
    report = compare(reference, candidate, args, kwargs, **options)
    if not report.ok:
        raise AssertionError(str(report))
    return report


def _run(fn: Callable, args: tuple, kwargs: dict, seed: int) -> _Run:
    fn, args, kwargs = copy.deepcopy((fn, _detached(args), _detached(kwargs)))
    modules = _modules_of(fn)
    for module in modules.values():
        module.to(device="cpu", dtype=torch.float64)
    (args, kwargs), leaves = _to_float64_leaves((args, kwargs))
    params = {f"{prefix}{name}": p for prefix, m in modules.items()
              for name, p in m.named_parameters()}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        out = fn(*args, **kwargs)
    outputs, out_spec = pytree.tree_flatten(out)
    targets = {**leaves, **params}
    grads = _gradients(outputs, list(targets.values()))
    named = dict(zip(targets, grads))
    return _Run(outputs, out_spec, {k: named[k] for k in leaves}, {k: named[k] for k in params})


def _detached(tree: Any) -> Any:
    """Tensors detached (deep-copyable even when not leaves); ``requires_grad`` kept as a flag.

    A tensor that appears twice becomes one :class:`_Flagged`, so its copies stay one tensor.
    """
    memo: dict[int, _Flagged] = {}

    def flag(leaf: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return leaf
        return memo.setdefault(id(leaf), _Flagged(leaf))

    return pytree.tree_map(flag, tree)


class _Flagged:
    """A detached tensor and whether the original required grad (survives deepcopy)."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor, self.requires_grad = tensor.detach(), tensor.requires_grad


def _to_float64_leaves(tree: Any) -> tuple[Any, dict[str, Tensor]]:
    """Flagged tensors -> CPU (float64 if floating) tensors; grad-requiring ones as fresh leaves."""
    memo: dict[int, Tensor] = {}
    leaves: dict[str, Tensor] = {}
    pairs, spec = pytree.tree_flatten_with_path(tree)  # an unregistered _Flagged is a leaf
    values = []
    for path, leaf in pairs:
        if isinstance(leaf, _Flagged):
            if id(leaf) not in memo:
                floating = leaf.tensor.is_floating_point()
                t = leaf.tensor.to("cpu", torch.float64) if floating else leaf.tensor.to("cpu")
                memo[id(leaf)] = t.requires_grad_(leaf.requires_grad and floating)
                if memo[id(leaf)].requires_grad:
                    leaves[_input_name(path)] = memo[id(leaf)]
            leaf = memo[id(leaf)]
        values.append(leaf)
    return pytree.tree_unflatten(values, spec), leaves


def _input_name(path: tuple) -> str:
    """``args[0].o2m.scores`` / ``kwargs['alpha']`` from a key path into ``(args, kwargs)``."""
    head = "args" if getattr(path[0], "idx", None) == 0 else "kwargs"
    return head + pytree.keystr(path[1:])


def _modules_of(fn: Any) -> dict[str, nn.Module]:
    """Modules owned by a (copied) callable, by name prefix for their parameters."""
    if inspect.isfunction(fn):
        return {}
    owner = getattr(fn, "__self__", fn)  # a bound method's object, or the callable itself
    if isinstance(owner, nn.Module):
        return {"": owner}
    attributes = getattr(owner, "__dict__", {})
    return {f"{k}.": v for k, v in attributes.items() if isinstance(v, nn.Module)}


def weighted_objective(outputs: list[Any]) -> Tensor | None:
    """``sum_i (out_i * w_i).sum()`` over the floating output leaves that require grad, with
    fixed random weights ``w_i`` seeded by leaf position; None when no leaf requires grad."""
    objective = None
    for position, out in enumerate(outputs):
        if isinstance(out, Tensor) and out.is_floating_point() and out.requires_grad:
            weight = torch.randn(out.shape, dtype=out.dtype,
                                 generator=torch.Generator().manual_seed(position))
            term = (out * weight.to(out.device)).sum()
            objective = term if objective is None else objective + term
    return objective


def _gradients(outputs: list[Any], targets: list[Tensor]) -> list[Tensor | None]:
    objective = weighted_objective(outputs)
    if objective is None or not targets:
        return [None] * len(targets)
    return list(torch.autograd.grad(objective, targets, allow_unused=True))


def _compare_grads(prefix: str, ref: dict[str, Tensor | None], cand: dict[str, Tensor | None],
                   rtol: float, atol: float) -> list[Comparison]:
    items = []
    for name in list(ref) + [k for k in cand if k not in ref]:
        items.append(compare_leaf(f"{prefix} {name}", ref.get(name, _ABSENT),
                                   cand.get(name, _ABSENT), rtol, atol))
    return items


_ABSENT = object()  # a name on one side only


def _describe(value: Any) -> str:
    if value is None:
        return "no gradient"
    return "absent" if value is _ABSENT else type(value).__name__


def compare_leaf(where: str, ref: Any, cand: Any, rtol: float, atol: float) -> Comparison:
    """One item compared: tensors elementwise (NaN matches only NaN), None only with None (a
    missing gradient), Python scalars by value, anything else by ``==``."""
    if isinstance(ref, Tensor) and isinstance(cand, Tensor):
        return _compare_tensors(where, ref, cand, rtol, atol)
    if ref is None and cand is None:  # a gradient neither computes: the input is unused by both
        return Comparison(where, True, "unused", 0.0)
    if any(v is None or v is _ABSENT for v in (ref, cand)):
        return Comparison(where, False, "missing", math.inf, reference=_describe(ref),
                          candidate=_describe(cand))
    if isinstance(ref, Tensor) or isinstance(cand, Tensor) or type(ref) is not type(cand):
        return Comparison(where, False, "type", math.inf, reference=_describe(ref),
                          candidate=_describe(cand))
    if isinstance(ref, (bool, int, float)):
        return _compare_tensors(where, torch.tensor(ref), torch.tensor(cand), rtol, atol)
    same = bool(ref == cand)
    return Comparison(where, same, "value", 0.0 if same else math.inf, reference=ref,
                      candidate=cand)


def _compare_tensors(where: str, ref: Tensor, cand: Tensor, rtol: float, atol: float) -> Comparison:
    if ref.shape != cand.shape:
        return Comparison(where, False, "shape", math.inf, reference=tuple(ref.shape),
                          candidate=tuple(cand.shape))
    if ref.requires_grad != cand.requires_grad:
        return Comparison(where, False, "requires-grad", math.inf, reference=ref.requires_grad,
                          candidate=cand.requires_grad)
    a, b = ref.detach().to("cpu", torch.float64), cand.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return Comparison(where, True, "value", 0.0)
    same = (a == b) | (a.isnan() & b.isnan())  # equal infinities and NaN positions match
    diff = torch.where(same, 0.0, (a - b).abs().nan_to_num(math.inf, math.inf, math.inf))
    scale = torch.where(a.isfinite(), a.abs(), 0.0)
    ratio = diff / (atol + rtol * scale)
    rel = torch.where(diff == 0, 0.0, diff / scale)
    flat = int(ratio.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    worst_ratio = float(ratio.flatten()[flat])
    nan_mismatch = bool((a.isnan() ^ b.isnan()).any())
    return Comparison(where, worst_ratio <= 1.0, "nan" if nan_mismatch else "value", worst_ratio,
                      float(diff.max()), float(rel.max()), index, float(a.flatten()[flat]),
                      float(b.flatten()[flat]))
