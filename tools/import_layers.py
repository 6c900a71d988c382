"""The package-level import graph of fxpasses, and the imports that go up its layer order.

    python tools/import_layers.py            # the graph, then every upward import with file:line
    python tools/import_layers.py --check    # the same; exit status 1 if an import goes up

A *unit* is a subpackage (``fxpasses.tracing``) or a top-level module (``fxpasses.guards``); the
package itself (``fxpasses``, its ``__init__``) is the public facade. Every import statement
counts, including those inside functions and under ``if TYPE_CHECKING:`` (both are dependencies a
reader has to follow). The layer order is read from the ``layers`` block of ``docs/layers.md``:
one layer a line, lowest first, ``name: unit unit ...`` (units without the ``fxpasses.`` prefix;
``.`` is the facade). An import is *upward* when it goes from a unit to one of a higher layer;
imports within a layer are allowed, and a unit no layer names is an error.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fxpasses"


@dataclass(frozen=True)
class Import:
    """One import statement of a module: ``importer`` imports ``imported`` (module names)."""

    importer: str
    imported: str
    file: str
    line: int


def module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package_dir: Path, modules: set[str]) -> list[Import]:
    """The imports of package modules that the file at ``path`` makes, anywhere in it: of a
    module (``import a.b``, ``from a import b`` where ``a.b`` is a module) or from it (``from a
    import name``)."""
    module = module_name(path, package_dir)
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = _resolve(base, node.module, node.level)
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append(Import(module, target, str(path.relative_to(package_dir.parent)), node.lineno))
    return found


def _resolve(base: str, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    parts = base.split(".")
    anchor = ".".join(parts[:len(parts) - (level - 1)])
    return f"{anchor}.{name}" if name else anchor


def unit_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_graph(package_dir: Path) -> nx.MultiDiGraph:
    """The units as nodes and one edge per import statement between two units (a statement
    that names a module and a name in it counts once)."""
    files = sorted(package_dir.rglob("*.py"))
    modules = {module_name(f, package_dir) for f in files}
    graph = nx.MultiDiGraph()
    graph.add_nodes_from({unit_of(m) for m in modules})
    seen = set()
    for f in files:
        for imp in imports_of(f, package_dir, modules):
            source, target = unit_of(imp.importer), unit_of(imp.imported)
            key = (source, target, imp.file, imp.line)
            if source == target or key in seen:
                continue
            seen.add(key)
            graph.add_edge(source, target, where=f"{imp.file}:{imp.line}")
    return graph


def read_layers(path: Path) -> list[tuple[str, list[str]]]:
    """The layer order of the ``layers`` block of ``path``, lowest first."""
    block = re.search(r"```layers\n(.*?)```", path.read_text(), re.S)
    if block is None:
        raise SystemExit(f"{path}: no ```layers block")
    layers = []
    for line in block.group(1).splitlines():
        if line.strip():
            name, _, units = line.partition(":")
            layers.append((name.strip(), [PACKAGE if u == "." else f"{PACKAGE}.{u}" for u in units.split()]))
    return layers


def upward_edges(graph: nx.MultiDiGraph, layers: list[tuple[str, list[str]]]) -> list[tuple[str, str, str]]:
    """``(importer, imported, file:line)`` of each import into a higher layer."""
    rank = {unit: i for i, (_, units) in enumerate(layers) for unit in units}
    unplaced = sorted(set(graph) - set(rank))
    if unplaced:
        raise SystemExit(f"units in no layer: {', '.join(unplaced)}")
    return sorted((a, b, data["where"]) for a, b, data in graph.edges(data=True) if rank[b] > rank[a])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=Path, default=ROOT / "docs" / "layers.md")
    parser.add_argument("--package", type=Path, default=ROOT / PACKAGE)
    parser.add_argument("--check", action="store_true", help="exit 1 if an import goes up")
    args = parser.parse_args(argv)
    graph = import_graph(args.package)
    layers = read_layers(args.layers)
    rank = {unit: i for i, (_, units) in enumerate(layers) for unit in units}
    short = lambda unit: unit.removeprefix(PACKAGE + ".") if unit != PACKAGE else "."  # noqa: E731
    print("import graph (importer -> imported: statements), by layer from the top")
    for name, units in reversed(layers):
        for unit in units:
            counts = Counter(b for _, b in graph.out_edges(unit)) if unit in graph else Counter()
            targets = ", ".join(f"{short(b)} {n}" for b, n in sorted(counts.items(), key=lambda t: (-rank.get(t[0], -1), t[0])))
            print(f"  [{name}] {short(unit)} -> {targets or '-'}")
    cycles = [sorted(map(short, c)) for c in nx.strongly_connected_components(nx.DiGraph(graph)) if len(c) > 1]
    print(f"cycles between units: {len(cycles)}", *(f"  {' <-> '.join(c)}" for c in cycles), sep="\n")
    up = upward_edges(graph, layers)
    print(f"upward imports: {len(up)} statements, {len({(a, b) for a, b, _ in up})} unit pairs")
    for a, b, where in up:
        print(f"  {short(a)} -> {short(b)}  {where}")
    return 1 if args.check and up else 0


if __name__ == "__main__":
    sys.exit(main())
