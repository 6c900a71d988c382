"""The scripts in bench/ answer --help and run on a CPU with tiny settings, writing their JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("bench.py", "interleaved.py", "flow_pairing.py", "ddp.py", "host_profile.py", "guard_cost.py", "peak_memory.py",
           "fit.py", "trajectory.py", "kernels.py", "pool_hazard.py", "host_timers.py", "region_handoffs.py",
           "capacity_headroom.py", "annotate_cost.py", "sync_events.py", "background_thread.py",
           "first_call.py")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    done = run(script, "--help")
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


@pytest.mark.slow
def test_tiny_cpu_runs_write_their_results(tmp_path):
    done = run("bench.py", "--device", "cpu", "--batch", "1", "--arms", "eager,pair",
               "--steps", "2", "--warmup", "0", "--rotate", "1", "--no-profile",
               "--out", str(tmp_path / "bench"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "bench" / "results.json").read_text())["rows"]
    assert [r["arm"] for r in rows] == ["eager", "pair"] and all(r["ok"] for r in rows)
    assert rows[1]["linear_calls"] * 2 == rows[0]["linear_calls"]

    done = run("interleaved.py", "--device", "cpu", "--batch", "1", "--image-size", "64",
               "--rounds", "2", "--rotate", "0", "--arms", "pair,all", "--out", str(tmp_path / "il"))
    assert done.returncode == 0, done.stderr[-3000:]
    arms = json.loads((tmp_path / "il" / "interleaved.json").read_text())["arms"]
    assert set(arms) == {"eager", "pair", "all"} and arms["eager"]["ratio"] == 1.0
    for name in ("pair", "all"):  # first call, 2 warm-up, 2 rounds, 1 to 4 profiled
        calls = arms[name]["optimized_calls"] + sum(arms[name]["native_calls"].values())
        assert 6 <= calls <= 9 and arms[name]["profiled_step"]

    done = run("interleaved.py", "--loss", "wild", "--device", "cpu", "--batch", "1",
               "--image-size", "64", "--rounds", "1", "--arms", "pair", "--out", str(tmp_path / "w"))
    assert done.returncode == 0, done.stderr[-3000:]
    arms = json.loads((tmp_path / "w" / "interleaved.json").read_text())["arms"]
    assert arms["pair"]["specializations"] >= 1 and arms["pair"]["optimized_calls"] >= 1

    done = run("guard_cost.py", "--device", "cpu", "--batch", "1", "--image-size", "64", "--rounds", "5",
               "--parts")
    assert done.returncode == 0 and "whole-loss check: 5 times" in done.stdout, done.stderr[-3000:]
    for part in ("all", "hooks", "loss callables", "modules", "classes"):  # reference loss: an nn.Module
        assert f"part alone: {part}: 1 times" in done.stdout, done.stdout

    done = run("host_profile.py", "--device", "cpu", "--batch", "1", "--image-size", "64", "--steps", "1",
               "--arm", "pair", "--out", str(tmp_path / "prof"))
    assert done.returncode == 0 and (tmp_path / "prof" / "reference_pair.txt").exists(), done.stderr[-3000:]

    done = run("flow_pairing.py", "--device", "cpu", "--batch", "1", "--steps", "2",
               "--out", str(tmp_path / "flow"))
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "flow" / "flow_pairing.json").read_text())["results"]
    assert result["pass_applied"] == [True] and "eager" in result and "cuda_graph" not in result


def _tiny_fit(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """bench/fit.py on the CPU: one epoch, 8 + 4 images of 160 px, batch 4, to tmp_path/fit.json."""
    return run("fit.py", "--epochs", "1", "--train-images", "8", "--val-images", "4", "--imgsz", "160",
               "--device", "cpu", "--batch", "4", "--workers", "0", "--work", str(tmp_path / "work"),
               "--out", str(tmp_path / "fit.json"), *args)


@pytest.mark.slow
def test_a_tiny_cpu_fit_pair_writes_both_arms(tmp_path):
    pytest.importorskip("ultralytics", minversion="8.4")
    out = tmp_path / "fit.json"
    done = _tiny_fit(tmp_path, "--pairs", "2", "--deadline-s", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["stopped_by_deadline"] == [4]  # the first pair ran, the second would not fit
    summary = results["batches"]["4"]["summary"]
    for arm in ("native", "fxpasses"):
        assert len(summary[arm]["fit_s"]["values"]) == 1 and summary[arm]["train_losses"][0]
        assert summary[arm]["metrics"][0] and summary[arm]["process_s"]["median"] > 0
        assert f"{arm}_b4_1: epoch 1/1 at" in done.stderr  # progress of each epoch
    runs = results["batches"]["4"]["runs"]
    assert [r["arm"] for r in runs] == ["native", "fxpasses"]
    (fast,) = [r for r in runs if r["arm"] == "fxpasses"]
    assert fast["fxpasses"]["stats"]["optimized"] >= 1
    assert all(r["amp_check"] == {"ran": True, "answer": False, "s": r["amp_check"]["s"]}
               for r in runs)  # on a CPU the trainer's check answers False at once
    assert all(0 < r["setup_s"] < r["epochs_s"][0] < r["fit_s"] and len(r["epochs_s"]) == 1
               for r in runs)
    # each of the epoch's 2 batches (8 images of batch 4): when its step was issued, in order
    assert all(len(r["batch_ends_s"]) == 2 and r["setup_s"] < r["batch_ends_s"][0] < r["batch_ends_s"][1]
               < r["epochs_s"][0] for r in runs)
    assert all(r["seed"] == 0 and r["grad_scale_final"] is None for r in runs)  # no AMP on a CPU
    for r in runs:  # the trainer's results.csv, one row per epoch, validation losses included
        (epoch,) = r["per_epoch"]
        assert epoch["epoch"] == 1 and epoch["val/box_loss"] > 0 and "metrics/mAP50(B)" in epoch
    assert all(summary[arm]["val_losses"][0]["box_loss"] > 0 for arm in ("native", "fxpasses"))
    assert (tmp_path / "fit_fxpasses_b4.txt").read_text().strip()
    assert "fxpasses losses box" in done.stderr and "last epoch's val box" in done.stderr and "would end after --deadline-s" in done.stderr


@pytest.mark.slow
def test_a_tiny_cpu_fit_runs_one_arm_with_another_seed(tmp_path):
    pytest.importorskip("ultralytics", minversion="8.4")
    out = tmp_path / "fit.json"
    done = _tiny_fit(tmp_path, "--pairs", "1", "--arms", "native", "--seed", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    (only,) = json.loads(out.read_text())["batches"]["4"]["runs"]
    assert only["arm"] == "native" and only["seed"] == 3


@pytest.mark.slow
def test_tiny_cpu_trajectory_under_autocast_counts_skipped_steps(tmp_path):
    pytest.importorskip("ultralytics", minversion="8.4")
    done = run("trajectory.py", "--device", "cpu", "--batch", "2", "--image-size", "64", "--steps", "2",
               "--accumulate", "2", "--amp", "--out", str(tmp_path / "traj"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "traj" / "trajectory.json").read_text())
    # the scaler starts at 2**16: the first steps overflow in float16 and are skipped, by every arm alike
    assert set(result["skipped_steps"]) == {"native", "native-again", "native-rounded", "fxpasses"}
    assert all(r["native_skipped"] in (0, 1) for r in result["rows"])
    calls = result["fxpasses"]  # two batches a step, their gradients summed: every call counted
    assert calls["calls"] == calls["optimized"] + sum(calls["native"].values()) == 4 and calls["optimized"] >= 1


@pytest.mark.slow
def test_tiny_cpu_region_handoffs_name_each_regions_inputs(tmp_path):
    pytest.importorskip("ultralytics", minversion="8.4")
    done = run("region_handoffs.py", "--batch", "2", "--image-size", "64", "--calls", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["regions"] and all(r["held"] >= 1 for r in report["regions"].values())
    origins = {w for r in report["regions"].values() for w in r["inputs_mib"]}
    assert any(w.startswith("region ") for w in origins), origins  # a region's input is another's output
    # the predictions (loss inputs) are copied into the assigner's region; an argument whose value
    # is a tuple gives one input per leaf, and origins after it keep their place (none is "state")
    assert "loss input" in origins and "state" not in origins, origins
