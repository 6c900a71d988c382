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
