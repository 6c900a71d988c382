"""bench/train.py runs on a CPU (the CUDA arms skipped, with the reason) and its arms agree."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fxpasses import log

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "train.py"


@pytest.fixture
def restored_logging():
    """The script turns fxpasses' logging on (a handler on this test's captured stderr)."""
    handlers, level, handler = list(log.logger.handlers), log.logger.level, log._handler
    yield
    log.logger.handlers[:] = handlers
    log.logger.setLevel(level)
    log._handler = handler


@pytest.mark.slow
def test_training_benchmark_on_a_cpu_in_float64(tmp_path, capsys, monkeypatch, restored_logging):
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # it imports bench/measure.py beside it
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--dtype", "float64", "--batch", "2", "--image-size", "64",
                       "--steps", "20", "--settle", "1", "--widths", "4,8,8,16,16", "--hidden", "8",
                       "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train.json").read_text())
    arms = report["result"]["arms"]
    assert set(arms) == {"native", "optimized", "network-only", "native-perturbed"}
    assert set(report["result"]["skipped"]) == {"graphed", "both"}
    assert report["result"]["steps_per_arm"] == 1 + 1 + 20 + 1 + 20
    agreement = arms["optimized"]["agreement"]
    assert agreement["loss_max_rel"] < 1e-10 and agreement["params_max_rel_l2"] < 1e-10, agreement
    control = arms["native-perturbed"]["agreement"]
    assert 0 < control["params_max_rel_l2"] < 1e-10, control  # rounding-sized, and not zero
    stats = arms["optimized"]["loss_stats"]  # realistic batches: a rare decision runs natively once
    assert stats["optimized"] + sum(stats["native"].values()) == 43 and stats["optimized"] >= 41
    assert set(stats["native"]) <= {"guard-failed"} and stats["exceptions"] == []
    assert "PairRLE: applied" in arms["optimized"]["certificates"]
    text = (tmp_path / "train.md").read_text()
    assert "| optimized |" in text and "skipped: needs CUDA" in text
    assert text in capsys.readouterr().out
