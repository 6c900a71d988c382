"""``fxpasses explain``: end to end in a subprocess, and each exit code in process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpasses.certificates.io import load
from fxpasses.cli import (EXIT_LOAD, EXIT_NOT_APPLIED, EXIT_OK, EXIT_USAGE, import_file, main,
                          make_inputs, make_loss)

SAMPLES = Path(__file__).resolve().parents[1] / "report" / "samples.py"
samples = import_file(SAMPLES)
LOSS = [f"{SAMPLES}:make_loss", "--inputs", f"{SAMPLES}:make_inputs",
        "--passes", f"{SAMPLES}:DropTimesOne,{SAMPLES}:RefuseMethods"]


def fxpasses_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxpasses.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_explain_a_loss_then_its_saved_file(tmp_path):
    saved, dot = tmp_path / "report.json", tmp_path / "graphs.dot"
    live = fxpasses_cli("explain", *LOSS, "--save", str(saved), "--dot", str(dot))
    assert live.returncode == EXIT_OK, live.stderr
    assert "RefuseMethods: sites 4, applied 0, refused op-unknown: 4" in live.stdout
    assert "calls: 2  optimized: 2" in live.stdout and "graph diff:" in live.stdout
    assert dot.read_text().startswith("digraph")
    again = fxpasses_cli("explain", str(saved), "--json", "--require-applied", "RefuseMethods")
    assert again.returncode == EXIT_NOT_APPLIED
    assert json.loads(again.stdout) == load(saved)
    ours = [line for line in again.stderr.splitlines() if line.startswith("fxpasses")]
    assert ours == ["fxpasses: RefuseMethods did not apply: op-unknown: 4"]  # torch may warn too


def test_drawing_without_graphviz_exits_3_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    assert main(["explain", *LOSS, "--svg", str(tmp_path / "g.svg")]) == EXIT_LOAD
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "graphviz" in err.lower()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.json"
    samples.optimized().save_certificates(path)
    return str(path)


@pytest.mark.parametrize("required, code", [
    ([], EXIT_OK), (["DropTimesOne"], EXIT_OK), (["drop_times_one"], EXIT_OK),
    (["DropTimesOne,RefuseMethods"], EXIT_NOT_APPLIED), (["NotInPipeline"], EXIT_NOT_APPLIED)])
def test_require_applied(saved, required, code, capsys):
    flags = [arg for name in required for arg in ("--require-applied", name)]
    assert main(["explain", saved, "--brief", *flags]) == code
    assert "fxpasses report" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code", [
    (["--help"], EXIT_OK),
    (["explain", "--help"], EXIT_OK),
    ([], EXIT_USAGE),
    (["explain", "no-colon-here"], EXIT_USAGE),
    (["explain", f"{SAMPLES}:make_loss"], EXIT_USAGE),  # no --inputs
    (["explain", *LOSS[:3], "--passes", "NoSuchPass"], EXIT_USAGE),
    (["explain", "missing.json"], EXIT_LOAD),
    (["explain", "no_such_module_xyz:loss", "--inputs", f"{SAMPLES}:make_inputs"], EXIT_LOAD),
    (["explain", f"{SAMPLES}:make_loss", "--inputs", f"{SAMPLES}:broken_inputs"], EXIT_LOAD),
    (["explain", *LOSS, "--calls", "1", "--dot", "/no/such/dir/g.dot"], EXIT_LOAD),
])
def test_exit_codes(argv, code, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert (err == "") == (code == EXIT_OK)


def test_help_documents_the_exit_codes(capsys):
    main(["explain", "--help"])
    out = capsys.readouterr().out
    assert all(f"  {code}  " in out for code in (EXIT_OK, EXIT_NOT_APPLIED, EXIT_USAGE, EXIT_LOAD))


def plain_loss(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def loss_factory(scale: float = 2.0) -> nn.Module:
    return nn.Linear(2, 1)


@pytest.mark.parametrize("obj, kind", [
    (nn.Linear(2, 1), nn.Linear), (nn.Linear, None), (loss_factory, nn.Linear),
    (plain_loss, type(plain_loss))])
def test_make_loss_calls_factories_only(obj, kind):
    if kind is None:  # a class needing arguments is a factory that cannot be called
        with pytest.raises(TypeError):
            make_loss(obj)
    else:
        assert isinstance(make_loss(obj), kind)


def test_make_inputs_accepts_each_documented_form():
    x = torch.ones(2)
    batch = torch.return_types.max((x, x))  # a structseq: one argument, not an args tuple
    assert make_inputs(lambda: ((x,), {"y": x})) == ((x,), {"y": x})
    assert make_inputs(lambda: (x, x)) == ((x, x), {})
    assert make_inputs(lambda: batch) == ((batch,), {})
    assert make_inputs((x,)) == ((x,), {})
