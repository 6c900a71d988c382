"""Pictures: DOT text with rewritten and refused sites marked, and rendering through Graphviz."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from fxpasses.cli import import_file
from fxpasses.draw import COLORS, RendererMissing, dot_text, find_dot, render
from fxpasses.report import build_report

samples = import_file(Path(__file__).with_name("samples.py"))
NODE = re.compile(r'^\s*"(\w+):(\w+)" \[label="[^"]*"(?:, fillcolor=(\w+))?\];$', re.M)
EDGE = re.compile(r'^\s*"(\w+):(\w+)" -> "(\w+):(\w+)";$', re.M)


@pytest.fixture(scope="module")
def text():
    return dot_text(build_report(samples.optimized()))


def colors(text: str) -> dict[tuple[str, str], str]:
    return {(graph, node): color for graph, node, color in NODE.findall(text)}


def test_rewritten_sites_are_green_and_refused_sites_red(text):
    color = colors(text)
    green, red = COLORS["rewritten"], COLORS["refused"]
    assert color[("before", "mul")] == color[("before", "mul_1")] == green  # applied sites
    assert color[("after", "linear")] == color[("after", "tanh")] == green  # nodes that changed
    for graph in ("before", "after"):
        assert {color[(graph, n)] for n in ("pow_1", "mean", "sum_1", "mean_1")} == {red}
        assert color[(graph, "sub")] == "" and color[(graph, "x")] == COLORS["input"]
    assert ("after", "mul") not in color


def test_edges_follow_the_data(text):
    edges = {(a, b) for graph, a, graph2, b in EDGE.findall(text) if graph == graph2 == "after"}
    assert ("x", "linear") in edges and ("linear", "sub") in edges and ("y", "sub") in edges
    assert ("read_lin_weight", "linear") in edges
    assert not any(graph != graph2 for graph, _, graph2, _ in EDGE.findall(text))


def test_every_node_line_parses(text):
    node_lines = [line for line in text.splitlines() if "[label=" in line]
    assert len(node_lines) == len(NODE.findall(text)) == 15 + 13


def test_missing_dot_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RendererMissing):
        find_dot()
    with pytest.raises(RendererMissing):
        render("digraph {}", tmp_path / "x.svg")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot not installed")
@pytest.mark.parametrize("suffix, magic", [(".svg", b"<svg"), (".png", b"\x89PNG")])
def test_dot_renders_the_picture(text, tmp_path, suffix, magic):
    path = render(text, tmp_path / f"graphs{suffix}")
    assert magic in path.read_bytes()[:400]


def test_a_specialization_without_graph_cannot_be_drawn():
    fast = samples.optimized(calls=0)
    report = build_report(fast)
    report["specializations"] = [{"index": 0, "snapshots": [], "disabled": "trace-failed"}]
    with pytest.raises(ValueError):
        dot_text(report)
