"""Every training call of a fit's optimized criterion checked against the native criterion, at
equal inputs, inside the fit (``bench/fit.py --check-calls``).

The per-call GPU tests compare on generated predictions; a fit's predictions come from a model
being trained. :class:`CheckedCriterion` takes the trainer's own inputs at each call with grad
enabled: on three detached copies of the predictions it runs the native criterion twice (the
second run is the control: native's own call-to-call difference, e.g. CUDA's atomic
accumulations) and the optimized one once, takes each run's gradients (of the loss's sum) for
the predictions and the flow's parameters with ``torch.autograd.grad``, and records the
differences; then it returns the optimized criterion's call on the real predictions, so the fit
trains as the fxpasses arm does. Four loss runs a call: a diagnosis, not a timing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 difference; NaN where the two are not finite at the same places."""
    got, want = got.detach().double(), want.detach().double()
    if not torch.equal(torch.isfinite(got), torch.isfinite(want)):
        return float("nan")
    got, want = torch.nan_to_num(got), torch.nan_to_num(want)
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _copies(preds: Any) -> tuple[Any, list[torch.Tensor]]:
    copied = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad)
                             if isinstance(t, torch.Tensor) else t, preds)
    return copied, [t for t in pytree.tree_leaves(copied) if isinstance(t, torch.Tensor) and t.requires_grad]


def _flow_parameters(native: Any) -> list[torch.nn.Parameter]:
    holder = getattr(native, "one2many", native)
    flow = getattr(holder, "flow_model", None)
    return [p for p in flow.parameters() if p.requires_grad] if flow is not None else []


class CheckedCriterion:
    """``optimized`` (a criterion wrapping ``native``) with each grad-enabled call checked."""

    def __init__(self, optimized: Any, native: Any):
        self.__dict__.update(optimized=optimized, native=native, rows=[])

    def _run(self, criterion: Any, preds: Any, batch: Any, flow: list) -> tuple[torch.Tensor, list]:
        copied, leaves = _copies(preds)
        loss, _ = criterion(copied, batch)
        grads = torch.autograd.grad(loss.sum(), [*leaves, *flow], allow_unused=True)
        return loss.detach(), [torch.zeros_like(x) if g is None else g for g, x in zip(grads, [*leaves, *flow])]

    def __call__(self, preds: Any, batch: Any) -> Any:
        if torch.is_grad_enabled():
            flow = _flow_parameters(self.native)
            n = sum(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(preds))
            want, want_g = self._run(self.native, preds, batch, flow)
            again, again_g = self._run(self.native, preds, batch, flow)
            got, got_g = self._run(self.optimized, preds, batch, flow)
            self.rows.append({
                "loss": [_rel(got, want), _rel(again, want)],
                "pred_grads": [max(map(_rel, got_g[:n], want_g[:n]), default=0.0),
                               max(map(_rel, again_g[:n], want_g[:n]), default=0.0)],
                "flow_grads": [max(map(_rel, got_g[n:], want_g[n:]), default=0.0),
                               max(map(_rel, again_g[n:], want_g[n:]), default=0.0)]})
        return self.optimized(preds, batch)

    def __getattr__(self, name: str) -> Any:
        if "optimized" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["optimized"], name)

    def __reduce__(self) -> tuple:
        return self.optimized.__reduce__()


def summary(rows: list[dict]) -> dict:
    """Per quantity: the worst optimized-vs-native and control (native-vs-native) differences over
    the calls, and the calls where the optimized one exceeds 10 times the control's worst and 1e-3."""
    out: dict[str, Any] = {"calls": len(rows)}
    for key in ("loss", "pred_grads", "flow_grads"):
        got = [r[key][0] for r in rows]
        control = [r[key][1] for r in rows]
        worst_control = max(control, default=0.0)
        out[key] = {"worst": max(got, default=0.0), "worst_control": worst_control,
                    "median": sorted(got)[len(got) // 2] if got else None,
                    "outliers": [i for i, g in enumerate(got)
                                 if not g <= max(10 * worst_control, 1e-3)]}  # NaN is an outlier
    return out
