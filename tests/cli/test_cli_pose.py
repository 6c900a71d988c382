"""``fxpasses explain`` on the reference workload, end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fxpasses import trace
from fxpasses.workloads import pose
from fxpasses.certificates.io import load
from fxpasses.certificates.verify import verify_report
from fxpasses.cli import EXIT_OK


@pytest.mark.slow
def test_explain_the_reference_workload_and_reverify_its_certificates(tmp_path):
    names = ["PairRLE", "CaptureLoss"]
    saved, dot = tmp_path / "pose.json", tmp_path / "pose.dot"
    done = subprocess.run(
        [sys.executable, "-m", "fxpasses.cli", "explain",
         "fxpasses.workloads.pose:DualBranchPoseLoss", "--inputs", "fxpasses.workloads.pose:make_batch", "--passes", ",".join(names),
         "--require-applied", "PairRLE", "--save", str(saved), "--dot", str(dot), "--brief"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == EXIT_OK, done.stderr
    report = load(saved)
    assert report["pipeline"] == names and report["stats"]["calls"] == 2
    assert "PairRLE: sites" in done.stdout and dot.read_text().startswith("digraph")
    again = verify_report(report, trace(pose.DualBranchPoseLoss(), (pose.make_batch(),)))
    assert again.ok and again.checked >= 1
