"""Every training call of a fit's optimized criterion checked against the native criterion, at
equal inputs, inside the fit (``bench/fit.py --check-calls``).

The per-call GPU tests compare on generated predictions; a fit's predictions come from a model
being trained. :class:`CheckedCriterion` takes the trainer's own inputs at each call with grad
enabled: on three detached copies of the predictions it runs the native criterion twice (the
second run is the control: native's own call-to-call difference, e.g. CUDA's atomic
accumulations) and the optimized one once, takes each run's gradients for the predictions and
the flow's parameters with ``torch.autograd.grad``, and records the differences; then it returns
the optimized criterion's call on the real predictions, so the fit trains as the fxpasses arm
does. The gradients are those of the loss's sum times the trainer's current loss scale (its
GradScaler's; divided out before comparing), so a run whose scaled gradients overflow where
native's do not (a step the scaler would skip) is seen. Under autocast a fourth run, native in
float32 with autocast off, is the reference both are measured against: an optimized difference
from it no larger than native's own is rounding. The check's runs are on copies and come first;
hooks on the real predictions and the flow's parameters then compare the gradients the trainer's
own backward of the training call gives them with native's, so a criterion right on the copy and
wrong on the call the model learns from is seen too. Up to five loss runs a call: a diagnosis,
not a timing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def _rel(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """Relative L2 difference (None: an unused input's zero gradient); NaN where the two are not
    finite at the same places."""
    if got is None and want is None:
        return 0.0
    got = torch.zeros_like(want) if got is None else got
    want = torch.zeros_like(got) if want is None else want
    if not torch.equal(torch.isfinite(got), torch.isfinite(want)):
        return float("nan")
    got, want = torch.nan_to_num(got), torch.nan_to_num(want)
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _copies(preds: Any, float32: bool = False) -> tuple[Any, list[torch.Tensor]]:
    def copy(t: torch.Tensor) -> torch.Tensor:
        detached = t.detach().float() if float32 and t.is_floating_point() else t.detach()
        return detached.clone().requires_grad_(t.requires_grad)

    copied = pytree.tree_map(lambda t: copy(t) if isinstance(t, torch.Tensor) else t, preds)
    return copied, [t for t in pytree.tree_leaves(copied) if isinstance(t, torch.Tensor) and t.requires_grad]


def _autocast_device(preds: Any) -> str | None:
    """The device type whose autocast is on for these predictions, None when it is off."""
    tensors = [t for t in pytree.tree_leaves(preds) if isinstance(t, torch.Tensor)]
    kind = tensors[0].device.type if tensors else "cpu"
    return kind if torch.is_autocast_enabled(kind) else None


def _flow_parameters(native: Any) -> list[torch.nn.Parameter]:
    holder = getattr(native, "one2many", native)
    flow = getattr(holder, "flow_model", None)
    return [p for p in flow.parameters() if p.requires_grad] if flow is not None else []


class CheckedCriterion:
    """``optimized`` (a criterion wrapping ``native``) with each grad-enabled call checked."""

    def __init__(self, optimized: Any, native: Any, scale: Any = lambda: 1.0):
        self.__dict__.update(optimized=optimized, native=native, scale=scale, rows=[], handles=[])

    def _run(self, criterion: Any, preds: Any, batch: Any, flow: list, scale: float,
             float32: bool = False) -> tuple[torch.Tensor, list, bool]:
        """The loss, its gradients (unscaled; None for an input it does not use) and whether any
        scaled gradient was non-finite."""
        copied, leaves = _copies(preds, float32)
        loss, _ = criterion(copied, batch)
        grads = torch.autograd.grad(loss.sum() * scale, [*leaves, *flow], allow_unused=True)
        nonfinite = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        return loss.detach(), [None if g is None else g.double() / scale for g in grads], nonfinite

    def __call__(self, preds: Any, batch: Any) -> Any:
        while self.handles:  # the last training call's hooks on the flow's parameters
            self.handles.pop().remove()
        if torch.is_grad_enabled():
            flow = _flow_parameters(self.native)
            leaves = [t for t in pytree.tree_leaves(preds) if isinstance(t, torch.Tensor) and t.requires_grad]
            n = len(leaves)
            scale = float(self.scale())
            want, want_g, want_skip = self._run(self.native, preds, batch, flow, scale)
            again, again_g, _ = self._run(self.native, preds, batch, flow, scale)
            got, got_g, got_skip = self._run(self.optimized, preds, batch, flow, scale)
            row = {"scale": scale, "nonfinite": [got_skip, want_skip],
                   "loss": [_rel(got, want), _rel(again, want)],
                   "pred_grads": [_worst(got_g[:n], want_g[:n]), _worst(again_g[:n], want_g[:n])],
                   "flow_grads": [_worst(got_g[n:], want_g[n:]), _worst(again_g[n:], want_g[n:])]}
            device = _autocast_device(preds)
            if device is not None:
                with torch.autocast(device, enabled=False):
                    _, ref_g, _ = self._run(self.native, preds, batch, flow, 1.0, float32=True)
                row["pred_grads_vs_fp32"] = [_worst(got_g[:n], ref_g[:n]), _worst(want_g[:n], ref_g[:n])]
                row["flow_grads_vs_fp32"] = [_worst(got_g[n:], ref_g[n:]), _worst(want_g[n:], ref_g[n:])]
            self.rows.append(row)
            _watch_training_backward(row, "training_pred_grads", leaves, want_g[:n], scale)
            self.handles.extend(_watch_training_backward(row, "training_flow_grads", flow, want_g[n:], scale))
        return self.optimized(preds, batch)

    def __getattr__(self, name: str) -> Any:
        if "optimized" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["optimized"], name)

    def __reduce__(self) -> tuple:
        return self.optimized.__reduce__()


def _watch_training_backward(row: dict, key: str, tensors: list[torch.Tensor],
                             want: list[torch.Tensor | None], scale: float) -> list:
    """Hooks comparing the gradients the trainer's own backward of this call gives ``tensors``
    (at its loss scale) with native's ``want``: ``row[key]`` is the worst relative difference so
    far and how many received one. What the model learns from, not a copy's. Tensors native does
    not use are left out: a model's raw outputs (``feats``) beside the tensors made from them
    receive those tensors' gradients in the trainer's backward. Returns the hooks' handles."""
    if len({id(t) for t in tensors}) != len(tensors):  # one tensor twice: its copies split its gradient
        return []
    row[key] = [0.0, 0]

    def hook(i: int):
        def compare(grad: torch.Tensor) -> None:
            got, (worst, received) = _rel(grad.double() / scale, want[i]), row[key]
            row[key] = [got if got != got or not got <= worst else worst, received + 1]
        return compare

    return [t.register_hook(hook(i)) for i, t in enumerate(tensors) if want[i] is not None]


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative difference over the pairs; NaN if any pair's is (``max`` would drop it)."""
    differences = [_rel(g, w) for g, w in zip(got, want)]
    return float("nan") if any(d != d for d in differences) else max(differences, default=0.0)


def summary(rows: list[dict]) -> dict:
    """Per quantity: the worst optimized-vs-native and control (native-vs-native) differences over
    the calls, and the calls where the optimized one exceeds 10 times the control's worst and 1e-3;
    the calls whose scaled gradients were non-finite in each; under autocast, both runs' differences
    from float32 (medians, worsts) and the calls where the optimized one exceeds twice native's."""
    out: dict[str, Any] = {"calls": len(rows)}
    for key in ("loss", "pred_grads", "flow_grads"):
        got = [r[key][0] for r in rows]
        control = [r[key][1] for r in rows]
        worst_control = max(control, default=0.0)
        out[key] = {"worst": max(got, default=0.0), "worst_control": worst_control,
                    "median": sorted(got)[len(got) // 2] if got else None,
                    "outliers": [i for i, g in enumerate(got)
                                 if not g <= max(10 * worst_control, 1e-3)]}  # NaN is an outlier
    for key, control in (("training_pred_grads", "pred_grads"), ("training_flow_grads", "flow_grads")):
        training = [r[key] for r in rows if key in r]
        if training:  # the trainer's backward of each call against native's (its control: the copies')
            out[key] = {"worst": max((t[0] for t in training), key=lambda d: (d != d, d)),
                        "received": [min(t[1] for t in training), max(t[1] for t in training)],
                        "outliers": [i for i, r in enumerate(rows) if key in r and not
                                     r[key][0] <= max(10 * out[control]["worst_control"], 1e-3)]}
    out["nonfinite"] = {"optimized": sum(r["nonfinite"][0] for r in rows),
                        "native": sum(r["nonfinite"][1] for r in rows),
                        "differ": [i for i, r in enumerate(rows) if r["nonfinite"][0] != r["nonfinite"][1]]}
    for key in ("pred_grads_vs_fp32", "flow_grads_vs_fp32"):  # under autocast: both against float32
        pairs = [r[key] for r in rows if key in r]
        finite = [p for p in pairs if p[0] == p[0] and p[1] == p[1]]  # NaN: not finite alike
        if pairs:
            got, native = sorted(p[0] for p in finite), sorted(p[1] for p in finite)
            out[key] = {"median": [got[len(got) // 2], native[len(native) // 2]] if finite else None,
                        "worst": [got[-1], native[-1]] if finite else None,
                        "not_finite": len(pairs) - len(finite),
                        "beyond_twice_native": [i for i, r in enumerate(rows) if key in r
                                                and not r[key][0] <= max(2 * r[key][1], 1e-3)
                                                and not all(d != d for d in r[key])]}  # NaN in both: left out
    return out
