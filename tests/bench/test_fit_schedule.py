"""bench/fit.py's bookkeeping without a fit: which pair still fits the deadline, and the per-arm
summary of finished and failed runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_fit", Path(__file__).resolve().parents[2] / "bench" / "fit.py")
fit = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fit)


def _run(arm: str, process_s: float, fit_s: float | None = None, **extra) -> dict:
    return {"arm": arm, "batch": 4, "process_s": process_s, "fit_s": fit_s or process_s - 5,
            "peak_reserved_mib": None, "train_losses": {"box_loss": 1.0}, "metrics": {"m": 0.5},
            **extra}


@pytest.mark.parametrize("elapsed, deadline, fits", [
    (0.0, None, True), (500.0, None, True),  # no deadline
    (100.0, 200.0, True),  # 100 + 40 + 60 = 200: ends at the deadline
    (100.5, 200.0, False), (0.0, 99.0, False)])
def test_a_pair_starts_only_when_both_slowest_runs_fit_before_the_deadline(elapsed, deadline, fits):
    runs = [_run("native", 30.0), _run("fxpasses", 60.0), _run("fxpasses", 50.0),
            _run("native", 40.0)]
    assert fit.next_pair_fits(runs, elapsed, deadline) is fits


def test_the_first_pair_always_starts():
    assert fit.next_pair_fits([], 1e9, 1.0)


def test_failed_runs_are_counted_not_timed():
    runs = [_run("native", 30.0, 20.0), _run("fxpasses", 25.0, 10.0),
            {"arm": "fxpasses", "batch": 4, "failed": 1, "process_s": 3.0, "log_tail": "boom"},
            _run("native", 50.0, 40.0), _run("fxpasses", 35.0, 30.0)]
    summary = fit.summarize(runs)
    assert (summary["native"]["runs"], summary["native"]["failed"]) == (2, 0)
    assert (summary["fxpasses"]["runs"], summary["fxpasses"]["failed"]) == (2, 1)
    assert summary["fxpasses"]["process_s"]["values"] == [25.0, 35.0]
    assert summary["native"]["fit_s"] == {"median": 30.0, "min": 20.0, "max": 40.0,
                                          "values": [20.0, 40.0]}
    assert summary["fit_s_change"] == pytest.approx(20.0 / 30.0 - 1)
    assert summary["peak_reserved_mib_change"] is None  # no CUDA: no memory to compare
    assert summary["native"]["train_losses"] == [{"box_loss": 1.0}] * 2  # per run, not pooled


def test_an_arm_without_a_finished_run_has_no_change():
    summary = fit.summarize([_run("native", 30.0),
                             {"arm": "fxpasses", "batch": 4, "failed": 1, "process_s": 3.0}])
    assert summary["fxpasses"]["fit_s"] is None and summary["fit_s_change"] is None


def test_merge_joins_the_pairs_of_separate_processes_per_batch(tmp_path):
    import json

    first = {"config": {"pairs": 1}, "batches": {
        "4": {"runs": [_run("native", 30.0, 20.0), _run("fxpasses", 25.0, 10.0)]},
        "16": {"runs": [_run("native", 10.0, 8.0), _run("fxpasses", 12.0, 9.0)]}}}
    second = {"config": {"pairs": 1, "first_pair": 2}, "batches": {
        "4": {"runs": [_run("fxpasses", 35.0, 30.0), _run("native", 50.0, 40.0)]}}}
    paths = []
    for i, part in enumerate((first, second)):
        paths.append(str(tmp_path / f"part{i}.json"))
        Path(paths[-1]).write_text(json.dumps(part))
    assert fit.main(["--merge", *paths, "--out", str(tmp_path / "all.json")]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    assert merged["merged"] == paths
    assert merged["batches"]["4"]["summary"]["native"]["fit_s"]["values"] == [20.0, 40.0]
    assert merged["batches"]["4"]["summary"]["fxpasses"]["fit_s"]["values"] == [10.0, 30.0]
    assert merged["batches"]["16"]["summary"]["native"]["runs"] == 1


def test_the_rounding_control_scales_only_the_loss_and_survives_a_deepcopy():
    import copy

    import torch

    class Native:
        hyp = "settings"

        def __call__(self, preds, batch):
            return preds.sum() * 3, preds.detach()

    rounded = fit.RoundedCriterion(Native())
    preds = torch.tensor([1.0, 2.0], dtype=torch.float64)
    loss, items = rounded(preds, {})
    assert loss.item() == 9.0 * (1 + 2 ** -20) and torch.equal(items, preds)
    assert rounded.hyp == "settings" and copy.deepcopy(rounded).hyp == "settings"
