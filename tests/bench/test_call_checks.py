"""bench/call_checks.py: a fit's criterion checked call by call at equal inputs. A criterion
equal to native gives no outlier; one off by a scale, or one that loses a gradient, is flagged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

SPEC = importlib.util.spec_from_file_location(
    "bench_call_checks", Path(__file__).resolve().parents[2] / "bench" / "call_checks.py")
call_checks = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(call_checks)


class Native:
    """A criterion shaped like Ultralytics': (preds dict, batch) -> (loss vector, items)."""

    def __init__(self):
        torch.manual_seed(0)
        self.one2many = nn.Module()
        self.one2many.flow_model = nn.Linear(3, 1)

    def __call__(self, preds, batch):
        flow = self.one2many.flow_model(preds["boxes"]).sum()
        loss = torch.stack([(preds["boxes"] - batch["target"]).pow(2).sum(), preds["scores"].sum() + flow])
        return loss, loss.detach()


WRONG = {
    "equal": lambda native: native,
    "scaled": lambda native: lambda p, b: (native(p, b)[0] * 1.01, None),
    "detached scores": lambda native: lambda p, b: native({**p, "scores": p["scores"].detach()}, b),
}


@pytest.mark.parametrize("kind", WRONG)
def test_a_wrong_call_is_an_outlier_and_the_training_call_is_the_optimized_one(kind):
    native = Native()
    optimized = WRONG[kind](native)
    checked = call_checks.CheckedCriterion(optimized, native)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        preds = {"boxes": torch.randn(4, 3, generator=g, requires_grad=True),
                 "scores": torch.randn(4, generator=g, requires_grad=True)}
        batch = {"target": torch.randn(4, 3, generator=g)}
        loss, _ = checked(preds, batch)
        torch.testing.assert_close(loss, optimized(preds, batch)[0])
        loss.sum().backward()  # the fit trains on the real predictions
        assert preds["boxes"].grad is not None
    with torch.no_grad():  # validation: not checked
        checked(preds, batch)
    summary = call_checks.summary(checked.rows)
    assert summary["calls"] == 3
    assert summary["loss"]["worst_control"] == 0.0
    flagged = summary["loss"]["outliers"] + summary["pred_grads"]["outliers"]
    assert (flagged == []) is (kind == "equal"), summary


def _preds(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ({"boxes": torch.randn(4, 3, generator=g).to(dtype).requires_grad_(),
             "scores": torch.randn(4, generator=g).to(dtype).requires_grad_()},
            {"target": torch.randn(4, 3, generator=g)})


def test_gradients_that_overflow_at_the_loss_scale_only_in_the_optimized_run_are_counted():
    native = Native()

    def overflowing(preds, batch):  # equal values; a gradient of 1e36, infinite at scale 2**16
        loss, items = native(preds, batch)
        steep = (preds["scores"] * 1e36).sum()
        return loss + (steep - steep.detach()), items

    checked = call_checks.CheckedCriterion(overflowing, native, scale=lambda: 2.0 ** 16)
    checked(*_preds(0))
    summary = call_checks.summary(checked.rows)
    assert checked.rows[0]["scale"] == 2.0 ** 16
    assert summary["nonfinite"] == {"optimized": 1, "native": 0, "differ": [0]}, summary
    assert summary["pred_grads"]["outliers"] == [0]


def test_under_autocast_both_runs_are_measured_against_float32():
    native = Native()
    checked = call_checks.CheckedCriterion(native, native, scale=lambda: 4.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for seed in range(2):
            checked(*_preds(seed, torch.bfloat16))
    summary = call_checks.summary(checked.rows)
    for key in ("pred_grads_vs_fp32", "flow_grads_vs_fp32"):
        got, native_error = summary[key]["median"]
        assert got == native_error and 0 < got < 0.1, summary  # bf16's rounding, the same in both
        assert summary[key]["beyond_twice_native"] == []
    assert summary["nonfinite"]["differ"] == []
    checked.rows.clear()
    checked(*_preds(0))  # autocast off: no reference run
    assert "flow_grads_vs_fp32" not in checked.rows[0]


@pytest.mark.parametrize("second_call_wrong", [False, True])
def test_the_trainers_own_backward_of_the_call_is_compared_with_native(second_call_wrong):
    """The check's runs use copies and come first; the training call's own gradients (what the
    model learns from), seen in the trainer's backward at its loss scale, are compared too: a
    criterion right on the check's run and wrong on the next is caught."""
    native, calls = Native(), []

    def optimized(preds, batch):
        calls.append(None)
        loss, items = native(preds, batch)
        return (loss * 1.01 if second_call_wrong and len(calls) == 2 else loss), items

    checked = call_checks.CheckedCriterion(optimized, native, scale=lambda: 8.0)
    preds, batch = _preds(0)
    loss, _ = checked(preds, batch)
    (loss.sum() * 8.0).backward()  # as GradScaler.scale(loss).backward()
    worst, received = checked.rows[0]["training_pred_grads"]
    assert received == 2 and len(calls) == 2
    summary = call_checks.summary(checked.rows)
    assert summary["pred_grads"]["outliers"] == []  # the check's own run was right
    assert summary["training_pred_grads"]["outliers"] == ([0] if second_call_wrong else []), worst
    assert summary["training_flow_grads"]["received"] == [2, 2]  # the flow's weight and bias
    assert summary["training_flow_grads"]["outliers"] == ([0] if second_call_wrong else [])
    checked(*_preds(1))  # the next call's check runs do not fire the last call's hooks
    assert checked.rows[0]["training_flow_grads"][1] == 2 and len(checked.handles) == 2
