"""The commands the README and the example scripts show a reader run, in order, and succeed.

A command is a code-block line (README: indented or fenced; an example: its docstring's indented
lines) that starts with ``fxpasses`` or ``python examples/``; ``a && b`` is two commands, and
``pip install`` steps are left out (the test runs in the installed environment). ``fxpasses`` runs
as ``python -m fxpasses`` with this checkout first on the path, in a scratch folder that sees
``examples/``.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
RUNNABLE = re.compile(r"^(fxpasses|python examples/)\S*")


def code_lines(text: str) -> list[str]:
    """Lines of indented or fenced code blocks of a Markdown or docstring text."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            lines.append(line.strip())
    return lines


def commands(text: str) -> list[str]:
    """The runnable commands of ``text``, a trailing ``# comment`` removed, ``&&`` split."""
    found = []
    for line in code_lines(text):
        for part in line.split("#")[0].split("&&"):
            part = part.strip()
            if RUNNABLE.match(part):
                found.append(part)
    return found


SOURCES = {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")}
SOURCES.update({f"examples/{p.name}": ast.get_docstring(ast.parse(p.read_text()), clean=False) or ""
                for p in EXAMPLES})


def test_the_readme_and_every_example_show_a_command():
    assert all(commands(text) for text in SOURCES.values()), {
        name: commands(text) for name, text in SOURCES.items()}
    shown = {c.split()[1] for text in SOURCES.values() for c in commands(text)
             if c.startswith("python examples/")}
    assert shown == {f"examples/{p.name}" for p in EXAMPLES}  # every example is run


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    if argv[0] == "fxpasses":
        argv = [sys.executable, "-m", "fxpasses", *argv[1:]]
    else:
        argv = [sys.executable, *argv[1:]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_documented_commands_run(source, tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for command in commands(SOURCES[source]):
        done = run(command, tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        assert "Traceback" not in done.stderr, done.stderr
