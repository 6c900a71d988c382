"""Re-verifying certificates against a graph: does the decision still describe this graph?

A certificate records the fingerprint of the graph its pass decided on and the names of the site's
nodes; a report records each pipeline step's generated code. Re-verification compares them with a
``GraphModule`` (e.g. the loss traced again after its source changed) and names every difference:

  fingerprint-changed  the graph is not the one the decision was taken on
  no-fingerprint       the certificate records no graph (it was made outside a pipeline)
  node-missing         a site node is not in the graph
  node-changed         a site node computes something else: another op, target or inputs

``verify_report`` also reports every integrity problem of the report
(:mod:`fxpasses.certificates.integrity`: digests, decisions recomputed from the checks, counters,
recorded steps), and checks every certificate: those decided on the given step against the graph,
the others against the code recorded for the step they name. None is skipped.

Nodes are compared through the code torch.fx generated for them (``gm.code``, one statement per
node), read with :mod:`ast`: the graph itself is not saved, its code is, so a saved report can be
checked without the objects it was made from. (torch.fx has no parser back from code to a Graph;
:func:`statements` is the small reader this needs.)
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from .digest import fingerprint
from .integrity import PROBLEM_KINDS, Problem, decision_problems, label, report_problems
from .io import validate
from .model import Certificate


@dataclass(frozen=True)
class Statement:
    """What one node computes, as torch.fx printed it, and the nodes it reads."""

    expr: str
    inputs: tuple[str, ...] = ()


def statements(code: str) -> dict[str, Statement]:
    """Node name -> :class:`Statement` for a GraphModule's generated ``code``, in graph order.

    Placeholders are ``Statement("input")``; the output node is ``"output"``. The ``x = None``
    statements torch.fx emits to free values early are not nodes and are skipped.
    """
    tree = ast.parse(code)
    forward = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    args = forward.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    nodes = {a.arg: Statement("input") for a in params if a is not None and a.arg != "self"}
    for stmt in forward.body:
        if isinstance(stmt, ast.Return):
            name, value = "output", stmt.value
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _node_target(stmt) is not None:
            name, value = _node_target(stmt), stmt.value
        else:
            continue
        reads = (n.id for n in ast.walk(value) if isinstance(n, ast.Name) and n.id in nodes)
        nodes[name] = Statement(ast.unparse(value), tuple(dict.fromkeys(reads)))
    return nodes


def _node_target(stmt: ast.Assign | ast.AnnAssign) -> str | None:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    value = stmt.value
    if len(targets) != 1 or not isinstance(targets[0], ast.Name) or value is None:
        return None
    if isinstance(value, ast.Constant) and value.value is None:  # freeing a value, not a node
        return None
    return targets[0].id


@dataclass(frozen=True)
class Verification:
    """The outcome: ``ok`` when no problem was found; ``checked`` certificates were examined,
    ``compared`` of them against the given graph."""

    problems: tuple[Problem, ...]
    checked: int
    compared: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def render(self) -> str:
        head = (f"{self.checked} certificate(s) checked, {self.compared} against the graph: "
                + ("ok" if self.ok else f"{len(self.problems)} problem(s)"))
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def _fingerprint_problem(expected: str, gm: fx.GraphModule, label: str = "") -> list[Problem]:
    if not expected:
        return [Problem("no-fingerprint", label)]
    actual = fingerprint(gm)
    if actual == expected:
        return []
    return [Problem("fingerprint-changed", label, "", expected, actual)]


def _site_problems(cert: Certificate, now: dict[str, Statement],
                   recorded: dict[str, Statement] | None) -> list[Problem]:
    problems = []
    for node in cert.site.nodes:
        if node not in now:
            problems.append(Problem("node-missing", label(cert), node))
        elif recorded is not None and node in recorded and recorded[node] != now[node]:
            problems.append(Problem("node-changed", label(cert), node, recorded[node].expr,
                                    now[node].expr))
    return problems


def verify_certificate(cert: Certificate, gm: fx.GraphModule,
                       recorded_code: str | None = None) -> Verification:
    """Check ``cert`` against ``gm``: its decision against its checks, the fingerprint, site nodes
    present and, when the code of the graph the certificate was decided on is given, each site
    node unchanged."""
    recorded = statements(recorded_code) if recorded_code is not None else None
    problems = decision_problems(cert)
    problems += _fingerprint_problem(cert.graph_fingerprint, gm, label(cert))
    problems += _site_problems(cert, statements(gm.code), recorded)
    return Verification(tuple(problems), 1, 1)


def _snapshot(special: dict[str, Any], step: str) -> dict[str, Any]:
    steps = [s["step"] for s in special["snapshots"]]
    if step not in steps:
        raise ValueError(f"specialization {special['index']} has no graph step {step!r}; it has "
                         f"{steps or 'none (its trace failed)'}")
    return special["snapshots"][steps.index(step)]


def verify_report(report: dict[str, Any], gm: fx.GraphModule, *, step: str = "traced",
                  specialization: int = 0) -> Verification:
    """Check a report (every integrity problem) and its certificates against ``gm``, the graph of
    pipeline ``step`` of specialization ``specialization``.

    By default ``gm`` stands for the traced graph: ``fxpasses.trace`` of the same loss on inputs of
    the same structure. Its fingerprint is compared with the step's (one problem for the graph).
    Every certificate of the specialization is checked: one decided on that step's graph has its
    site nodes checked against ``gm`` and the recorded code; one decided on another step's graph
    against that step's recorded code; one with no fingerprint is a ``no-fingerprint`` problem.
    ValueError if ``report`` is not a valid report or has no such step.
    """
    validate(report)
    problems = report_problems(report)
    special = report["specializations"][specialization]
    snapshot = _snapshot(special, step)
    codes = {s["fingerprint"]: statements(s["code"]) for s in special["snapshots"]}
    now = statements(gm.code)
    problems += _fingerprint_problem(snapshot["fingerprint"], gm)
    certs = [Certificate.from_dict(c, check_digest=False) for c in special["certificates"]]
    compared = 0
    for cert in certs:
        if cert.graph_fingerprint == snapshot["fingerprint"]:
            compared += 1
            problems += _site_problems(cert, now, codes[snapshot["fingerprint"]])
        elif not cert.graph_fingerprint:
            problems.append(Problem("no-fingerprint", label(cert)))
        elif cert.graph_fingerprint in codes:  # decided on another step: against its own code
            problems += _site_problems(cert, codes[cert.graph_fingerprint], None)
        # else: fingerprint-unknown, already among report_problems
    return Verification(tuple(problems), len(certs), compared)


__all__ = ["PROBLEM_KINDS", "Problem", "Statement", "Verification", "statements",
           "verify_certificate", "verify_report"]
