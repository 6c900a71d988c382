"""Pictures of a specialization's graph before and after the pipeline, with its sites marked.

``dot_text(report)`` writes Graphviz DOT text for the first and the last graph snapshot of a
report, side by side: nodes that the pipeline rewrote (new or changed nodes after, applied sites
before) are green, refused sites red. ``render(text, path)`` runs Graphviz's ``dot`` on it to make
an SVG or PNG; without ``dot`` on PATH it raises :class:`RendererMissing`, whose message says what
to install.

The DOT text is written here rather than by torch.fx's ``FxGraphDrawer`` (or networkx's writers):
those need pydot and a live GraphModule, while a saved report holds each graph's code only, read
back by :func:`fxpasses.certificates.verify.statements`. DOT for boxes and arrows is a few lines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .certificates import Certificate
from .certificates.verify import Statement, statements
from .log import logger

COLORS = {"rewritten": "palegreen", "refused": "lightpink", "input": "aliceblue",
          "output": "powderblue"}
INSTALL_HINT = ("install Graphviz (apt-get install graphviz, brew install graphviz or conda "
                "install graphviz), or write the DOT text with --dot PATH")


class RendererMissing(RuntimeError):
    """Graphviz's ``dot`` program is not on PATH."""


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _marks(certs: list[Certificate], before: dict[str, Statement],
           after: dict[str, Statement]) -> tuple[dict[str, str], dict[str, str]]:
    """Node name -> "rewritten" / "refused", for the first and for the last graph."""
    marks_before: dict[str, str] = {}
    for cert in sorted(certs, key=lambda c: c.applied):  # applied last: a rewrite wins
        for node in cert.site.nodes:
            marks_before[node] = "rewritten" if cert.applied else "refused"
    marks_after = {name: mark for name, mark in marks_before.items()
                   if mark == "refused" and name in after}
    marks_after.update({name: "rewritten" for name, stmt in after.items()
                        if before.get(name) != stmt})
    return marks_before, marks_after


def _cluster(key: str, title: str, nodes: dict[str, Statement], marks: dict[str, str]) -> list[str]:
    lines = [f"  subgraph cluster_{key} {{", f"    label={_quote(title)};"]
    for name, stmt in nodes.items():
        expr = stmt.expr if len(stmt.expr) <= 48 else stmt.expr[:45] + "..."
        kind = marks.get(name) or ("input" if stmt.expr == "input" else
                                   "output" if name == "output" else "")
        color = f", fillcolor={COLORS[kind]}" if kind else ""
        label = _quote(f"{name}\n{expr}")
        lines.append(f"    {_quote(key + ':' + name)} [label={label}{color}];")
    for name, stmt in nodes.items():
        lines += [f"    {_quote(key + ':' + src)} -> {_quote(key + ':' + name)};"
                  for src in stmt.inputs]
    return lines + ["  }"]


def dot_text(report: dict[str, Any], specialization: int = 0) -> str:
    """DOT text of one specialization's first and last graph (see the module docstring)."""
    special = report["specializations"][specialization]
    if not special["snapshots"]:
        raise ValueError(f"specialization {specialization} has no graph to draw "
                         f"(runs natively: {special['disabled']})")
    first, last = special["snapshots"][0], special["snapshots"][-1]
    before, after = statements(first["code"]), statements(last["code"])
    certs = [Certificate.from_dict(c) for c in special["certificates"]]
    marks_before, marks_after = _marks(certs, before, after)
    title = (f"{report['loss']} specialization {specialization}: "
             f"{' -> '.join(report['pipeline']) or 'no passes'}\n"
             "green: rewritten   red: refused")
    lines = ["digraph fxpasses {", f"  label={_quote(title)}; labelloc=t; rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=monospace, '
             "fontsize=10];"]
    lines += _cluster("before", f"before ({first['step']} {first['fingerprint'][:8]})",
                      before, marks_before)
    lines += _cluster("after", f"after ({last['step']} {last['fingerprint'][:8]})",
                      after, marks_after)
    return "\n".join(lines + ["}"]) + "\n"


def find_dot() -> str:
    """The path of Graphviz's ``dot``; RendererMissing says what to install when there is none."""
    dot = shutil.which("dot")
    if dot is None:
        raise RendererMissing(f"drawing needs Graphviz's `dot` program, not found on PATH: "
                              f"{INSTALL_HINT}")
    return dot


def render(text: str, path: str | os.PathLike, fmt: str | None = None) -> Path:
    """Render DOT ``text`` to ``path`` with ``dot``; ``fmt`` defaults to the path's suffix."""
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".") or "svg"
    command = [find_dot(), f"-T{fmt}", "-o", str(path)]
    logger.info("rendering %s with %s", path, " ".join(command))
    result = subprocess.run(command, input=text, text=True, capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"dot failed ({result.returncode}): {result.stderr.strip()}")
    return path
