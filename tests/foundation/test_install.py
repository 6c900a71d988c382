"""What an install gives a user: numpy among the dependencies, and no warning on import.

torch imports without numpy but warns ("Failed to initialize NumPy") on every clean install, and
fxpasses imports torch; so fxpasses depends on numpy rather than silencing torch's warning.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_numpy_is_a_dependency_and_installed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("numpy") for dep in project["dependencies"])
    assert importlib.util.find_spec("numpy") is not None


def test_importing_fxpasses_warns_nothing():
    modules = "fxpasses, fxpasses.cli, fxpasses.passes, fxpasses.testing, fxpasses.workloads.pose"
    done = subprocess.run([sys.executable, "-W", "error", "-c", f"import {modules}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
