"""First use of the command line: imports of a user's files, ``python -m fxpasses``, ``--version``,
and the demo's answers to options it cannot run with."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxpasses
from fxpasses import demo
from fxpasses.cli import EXIT_OK, EXIT_USAGE, main
from fxpasses.timing import ArmTiming

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "report" / "samples.py"

LOSS_FILE = """
    import torch
    from fxpasses_sibling_helper import SCALE   # a sibling module of this file

    def make_loss():
        return lambda x: (x * SCALE).sum()

    def make_inputs():
        return (torch.ones(3, requires_grad=True),)
"""


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    """A loss file importing a sibling module, in its own folder; sys.path/modules restored."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "fxpasses_sibling_helper.py").write_text("SCALE = 2.0\n")
    (folder / "fxpasses_sibling_loss.py").write_text(textwrap.dedent(LOSS_FILE))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield folder
    for name in ("fxpasses_sibling_helper", "fxpasses_sibling_loss"):
        sys.modules.pop(name, None)


def test_a_loss_file_importing_a_sibling_loads_from_another_directory(user_files, monkeypatch,
                                                                      capsys):
    monkeypatch.chdir(user_files.parent)
    spec = str(user_files / "fxpasses_sibling_loss.py")
    assert main(["explain", f"{spec}:make_loss", "--inputs", f"{spec}:make_inputs",
                 "--calls", "1", "--brief"]) == EXIT_OK
    assert "calls: 1  optimized: 1" in capsys.readouterr().out


def test_a_module_in_the_working_directory_loads(user_files, monkeypatch, capsys):
    monkeypatch.chdir(user_files)  # as the console script runs: the cwd is not on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(user_files))])
    assert main(["explain", "fxpasses_sibling_loss:make_loss", "--inputs",
                 "fxpasses_sibling_loss:make_inputs", "--calls", "1", "--brief"]) == EXIT_OK
    assert "calls: 1  optimized: 1" in capsys.readouterr().out


def test_python_dash_m_fxpasses_and_version():
    done = subprocess.run([sys.executable, "-m", "fxpasses", "--version"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout.startswith(f"fxpasses {fxpasses.__version__} (torch {torch.__version__}")


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--batch", "-3"], "--batch must be at least 1, got -3"),
    (["--image-size", "8"], "--image-size must be at least 32, got 8"),
    (["--device", "tpu"], "is not a torch device"),
    (["--device", "meta"], "the demo runs on cpu or cuda"),
    pytest.param(["--device", "cuda"], "sees no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_demo_options_it_cannot_run_with_are_one_line_exit_2(argv, says, capsys):
    assert main(["demo", *argv]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err and "Traceback" not in err


# -- a newcomer's path: the demo's verdict, and explain's answers to options it cannot run with
@pytest.mark.long  # the whole pose loss, traced and run 14 times each way
def test_the_demo_ends_with_a_one_line_verdict_and_a_spread_of_ten_rounds(capsys):
    assert main(["demo", "--batch", "1", "--image-size", "64", "--steps", "10",
                 "--device", "cpu"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "(p10-p90 " in out
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("verdict: values match (")
    assert ("CaptureLoss needs CUDA: on this CPU only PairRLE applies (36 -> 18 linear calls)"
            in verdict)
    assert any(word in verdict for word in ("faster than native", "as fast as native",
                                            "slower than native"))


def _timing(ratios):
    return ArmTiming("optimized", tuple(1.0 for _ in ratios), tuple(ratios))


@pytest.mark.parametrize("ratios, says", [
    ([2.0] * 9, "speed not judged from 9 rounds (it takes 10)"),
    ([2.0] * 10, "2.00x faster than native"), ([1.02] * 10, "as fast as native (1.02x)"),
    ([0.5] * 10, "slower than native (0.50x)")])
def test_the_speed_verdict_takes_ten_rounds(ratios, says):
    assert demo._speed(_timing(ratios)) == says
    assert ("p10-p90" in demo._spread(_timing(ratios))) == (len(ratios) >= demo.SPREAD_ROUNDS)


def test_values_that_differ_are_the_verdict_not_a_footnote():
    assert demo._values(True, 0.0, 1e-7).startswith("values match")
    assert demo._values(False, 0.0, 1e-2).startswith("VALUES DIFFER")


EXPLAIN = ["explain", f"{SAMPLES}:make_loss", "--inputs", f"{SAMPLES}:make_inputs"]


@pytest.mark.parametrize("argv, says", [
    (["--calls", "0"], "argument --calls: must be at least 1, got 0"),
    (["--calls", "two"], "argument --calls: 'two' is not an integer"),
    (["--specialization", "-1"], "argument --specialization: must be at least 0, got -1")])
def test_explain_counts_below_their_least_are_argparse_usage_errors(argv, says, capsys):
    assert main([*EXPLAIN, *argv]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and says in err and "Traceback" not in err


def test_a_specialization_out_of_range_is_a_usage_error_before_the_report(capsys):
    assert main([*EXPLAIN, "--passes", f"{SAMPLES}:DropTimesOne", "--calls", "1",
                 "--specialization", "1", "--brief"]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--specialization 1: the report has 1 specialization(s), 0 to 0" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_explain_on_cuda_without_cuda_answers_as_the_demo_does(capsys):
    assert main([*EXPLAIN, "--device", "cuda"]) == EXIT_USAGE
    explain_err = capsys.readouterr().err
    assert main(["demo", "--device", "cuda"]) == EXIT_USAGE
    assert capsys.readouterr().err == explain_err  # one line, "sees no CUDA device", no traceback
    assert explain_err.count("\n") == 1 and "sees no CUDA device" in explain_err


def test_explain_without_passes_says_it_ran_none(capsys):
    assert main([*EXPLAIN, "--calls", "1", "--brief"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "no --passes given: the loss is traced and run with none" in err
    assert "pipeline: (no passes)" in out
    assert main([*EXPLAIN, "--calls", "1", "--brief", "--passes",
                 f"{SAMPLES}:DropTimesOne"]) == EXIT_OK
    assert "no --passes" not in capsys.readouterr().err
