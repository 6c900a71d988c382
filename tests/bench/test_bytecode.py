"""bench/bytecode.py: whether the first call's lazy imports have compiled bytecode, asked
without importing them (their import time stays in what a benchmark times next)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import json, sys; sys.path.insert(0, 'bench'); from bytecode import bytecode_cache; "
         "c = bytecode_cache(); print(json.dumps({**c, 'imported': sorted(m for m in sys.modules "
         "if m.split('.')[0] in ('torch', 'sympy'))}))")


def probe(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_empty_cache_folder_reads_from_source_and_nothing_is_imported(tmp_path):
    empty = probe(PYTHONPYCACHEPREFIX=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    assert empty["cached"] == 0 and empty["of"] == 5 and not empty["writes"]
    assert empty["prefix"] == str(tmp_path) and empty["imported"] == []


def test_compiled_files_in_the_cache_folder_are_found(tmp_path):
    torch_dir = Path(importlib.util.find_spec("torch").submodule_search_locations[0])
    subprocess.run([sys.executable, "-c", f"import compileall; compileall.compile_file("
                    f"{str(torch_dir / '_subclasses' / 'fake_tensor.py')!r}, quiet=1)"],
                   env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)}, check=True, timeout=120)
    assert probe(PYTHONPYCACHEPREFIX=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")["cached"] == 1
