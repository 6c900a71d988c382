"""The package reads top-down: no module imports from a layer above its own (docs/layers.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("import_layers", ROOT / "tools" / "import_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_from_a_layer_above_its_own():
    tool = _tool()
    graph = tool.import_graph(ROOT / "fxpasses")
    assert tool.upward_edges(graph, tool.read_layers(ROOT / "docs" / "layers.md")) == []


def test_an_import_from_a_higher_layer_is_reported_with_its_line(tmp_path):
    tool = _tool()
    package = tmp_path / "fxpasses"
    (package / "ir").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ir" / "__init__.py").write_text("from ..passes import thing\n")
    (package / "passes.py").write_text("from .ir import nothing\nthing = 1\n")
    layers = tmp_path / "layers.md"
    layers.write_text("```layers\nir: ir\npasses: passes\nfacade: .\n```\n")
    up = tool.upward_edges(tool.import_graph(package), tool.read_layers(layers))
    assert [(a, b) for a, b, _ in up] == [("fxpasses.ir", "fxpasses.passes")]
    assert up[0][2].endswith("ir/__init__.py:1")
