"""One training step of a loss, and how far two losses' steps differ.

    from fxpasses.steps import step, differences
    step(fast, batch, objective=lambda out: out.total)        # forward, backward into batch's .grad
    value_diff, grad_diff = differences(loss_fn, fast, batch, objective=lambda out: out.total)

A loss here is called with one argument (``fn(inputs)``; any pytree of tensors), and
``objective(out)`` picks the scalar to differentiate from its output (by default the output
itself). Gradients go into ``.grad`` of the inputs' tensors that require grad. ``fxpasses demo``
and the scripts in ``bench/`` time and compare losses through these two functions.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree


def _identity(out: Any) -> Any:
    return out


def grad_leaves(inputs: Any) -> list[torch.Tensor]:
    """The tensors of ``inputs`` that require grad, in pytree order."""
    return [t for t in pytree.tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.requires_grad]


def step(fn: Callable[[Any], Any], inputs: Any,
         objective: Callable[[Any], torch.Tensor] = _identity) -> Any:
    """One training step: clear the inputs' ``.grad``, ``out = fn(inputs)``, backward of
    ``objective(out)``; returns ``out``."""
    for leaf in grad_leaves(inputs):
        leaf.grad = None
    out = fn(inputs)
    objective(out).backward()
    return out


def _value_and_grads(fn: Callable, inputs: Any, objective: Callable) -> tuple[torch.Tensor, list]:
    out = step(fn, inputs, objective)
    grads = [leaf.grad.detach().double().clone() if leaf.grad is not None else None
             for leaf in grad_leaves(inputs)]
    return objective(out).detach().double(), grads


def differences(reference: Callable[[Any], Any], candidate: Callable[[Any], Any], inputs: Any,
                objective: Callable[[Any], torch.Tensor] = _identity) -> tuple[float, float]:
    """(relative difference of the objective, worst relative L2 difference of an input's
    gradient) of ``candidate`` against ``reference`` on one step each. A gradient present on one
    side only counts as an infinite difference; a zero reference value divides by 1 instead."""
    ref_value, ref_grads = _value_and_grads(reference, inputs, objective)
    value, grads = _value_and_grads(candidate, inputs, objective)
    scale = ref_value.abs() if ref_value != 0 else torch.ones_like(ref_value)
    value_diff = ((value - ref_value).abs() / scale).item()
    worst = 0.0
    for got, ref in zip(grads, ref_grads):
        if (got is None) != (ref is None):
            return value_diff, float("inf")
        if got is not None:
            worst = max(worst, ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item())
    return value_diff, worst
