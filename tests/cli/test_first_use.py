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
from fxpasses.cli import EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[2]

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
