"""Running passes over a traced loss: the Pass protocol, results, verification, snapshots.

A pass is a small stateless object with a ``name`` and ``run(gm) -> PassResult``. The pipeline
hands each pass its own copy of the graph (sharing the submodules, so nothing is copied but the
node list), and after the pass:

1. ``graph.lint()`` and ``recompile()``;
2. metadata propagated again (``meta['val']``) when example inputs are given;
3. a fingerprint of the graph (a hash of its generated code), which must differ from the one before
   exactly when the pass says ``modified`` — a mismatch is an internal error, reported;
4. a :class:`Snapshot` of the code, for the before/after diff.

A pass that raises, fails lint or lies about ``modified`` gets a "failed" certificate and its graph
is discarded: the pipeline continues from the graph before it.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module  # recompile when run

from .analysis.meta import annotate, annotate_new
from .certificates import Certificate, Check, Site, pass_counters
from .certificates.digest import code_fingerprint
from .locations import node_location
from .log import logger


@runtime_checkable
class Pass(Protocol):
    """A graph rewrite: one certificate per candidate site it considered, refusals included.

    ``name`` names the pass in certificates and counters (unique within a pipeline).
    """

    name: str

    def run(self, gm: fx.GraphModule) -> "PassResult":
        """Rewrite ``gm``.

        Args:
            gm (fx.GraphModule): the pass's own copy of the graph (its submodules shared).

        Returns:
            PassResult: the graph (``gm``, changed in place, or a new one), whether it was
            modified, and the certificates.
        """


@dataclass
class PassResult:
    """What a pass returns: the graph after it, whether the pass modified it (the pipeline
    checks this against the graph's fingerprint), one certificate per candidate site."""

    graph_module: fx.GraphModule
    modified: bool
    certificates: list[Certificate] = field(default_factory=list)


@dataclass(frozen=True)
class Snapshot:
    """The graph's generated code after a pipeline step."""

    step: str
    fingerprint: str
    code: str
    modified: bool
    seconds: float = 0.0


@dataclass
class PipelineRun:
    """What running the pipeline produced: the final graph, certificates, snapshots, counters."""

    graph_module: fx.GraphModule
    certificates: list[Certificate]
    snapshots: list[Snapshot]

    def counters(self) -> dict[str, dict[str, object]]:
        """Per pass: sites seen, applied, refused (by code) and failed."""
        return pass_counters(self.certificates)

    def diff(self) -> str:
        """Unified diff of the generated code, first snapshot to last."""
        first, last = self.snapshots[0], self.snapshots[-1]
        return "".join(difflib.unified_diff(
            first.code.splitlines(keepends=True), last.code.splitlines(keepends=True),
            fromfile=f"before ({first.step})", tofile=f"after ({last.step})"))


EXAMPLE_INPUTS = "fxpasses.example_inputs"  # gm.meta key, while the pipeline runs


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of the graph; submodules and parameters are shared. Inside
    :func:`run_pipeline` it is torch.fx's lazy kind: its code is generated when it runs."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out, type_expr=old_output.type)
    new = _make_graph_module(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(gm.meta)
    return new


def _snapshot(step: str, code: str, modified: bool, seconds: float = 0.0) -> Snapshot:
    """A step's snapshot from the graph's generated code: what the fingerprint hashes, so one
    checks the other (:func:`~.certificates.digest.fingerprint`)."""
    return Snapshot(step, code_fingerprint(code), code, modified, seconds)


def _failure(pass_name: str, code: str, exc: BaseException | None, detail: dict,
             fingerprint: str) -> Certificate:
    logger.warning("pass %s failed (%s): %s", pass_name, code, exc or detail.get("message", ""))
    evidence = dict(detail)
    if exc is not None:
        evidence.update(exception=type(exc).__name__, message=str(exc)[:500],
                        traceback="".join(traceback.format_exception(exc))[-2000:])
    check = Check("pass-completed", False, evidence, code)
    return Certificate(pass_name, Site((), (), "whole graph"), "failed", (check,), (code,),
                       message=f"{pass_name}: {code}: {evidence.get('message', '')}",
                       graph_fingerprint=fingerprint)


def _metadata_failure(failures: list[tuple[fx.Node, Exception]], fingerprint: str) -> Certificate:
    node, exc = failures[0]
    check = Check("fake-tensor-propagation", False, {
        "node": node.name, "statement": node.format_node(), "location": node_location(node),
        "exception": type(exc).__name__, "message": str(exc)[:500], "failed_nodes": len(failures),
        "tool": "FakeTensorProp"}, "metadata-failed")
    return Certificate("annotate", Site((node.name,), (node_location(node),), "shape propagation"),
                       "failed", (check,), ("metadata-failed",),
                       message=f"no shapes from node {node.name} on: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:200] if str(exc) else ''}",
                       graph_fingerprint=fingerprint)


def _no_site(pass_name: str) -> Certificate:
    """What a pass that left the graph alone and reported no site is certified with."""
    return Certificate.from_checks(pass_name, Site((), (), "the whole graph"), [
        Check("sites-found", False, {"sites": 0}, "no-site")])


def _unannotated(gm: fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if "val" not in n.meta and n.op != "output"}


def run_pipeline(gm: fx.GraphModule, passes: Sequence[Pass],
                 example_tensors: Sequence[torch.Tensor] | None = None) -> PipelineRun:
    """Run ``passes`` in order over ``gm`` (see the module docstring).

    With ``example_tensors``, the pipeline owns node metadata: it annotates the traced graph first
    (nodes it cannot propagate get an ``annotate`` certificate, ``metadata-failed``; passes treat
    them conservatively) and again after each modifying pass, so the next pass sees shapes for the
    nodes the previous one created; a pass after which propagation fails at new nodes fails with
    ``metadata-failed`` and its graph is discarded.

    Args:
        gm (fx.GraphModule): a traced loss (:func:`fxpasses.trace`).
        passes (Sequence[Pass]): run in this order.
        example_tensors (Sequence[torch.Tensor], optional): the graph's inputs for shape
            propagation (``signature.inputs(leaves)`` of a call).

    Returns:
        PipelineRun: the final graph, every certificate (a pass that raised, failed lint or
        misreported ``modified`` has a "failed" one), the snapshots for the diff.
    """
    snapshots = [_snapshot("traced", gm.graph.python_code("self").src, False)]
    certificates: list[Certificate] = []
    current = gm
    if example_tensors is not None:
        failures = annotate(gm, example_tensors)
        if failures:
            certificates.append(_metadata_failure(failures, snapshots[0].fingerprint))
        gm.meta[EXAMPLE_INPUTS] = tuple(example_tensors)
    try:
        with _use_lazy_graph_module(True):
            current = _run_passes(gm, passes, example_tensors, snapshots, certificates)
    finally:  # the call's tensors are not kept with the graph
        for module in (gm, current):
            module.meta.pop(EXAMPLE_INPUTS, None)
    return PipelineRun(current, certificates, snapshots)


def example_inputs(gm: fx.GraphModule) -> tuple[Any, ...] | None:
    """The real inputs of the call being specialized (while its pipeline runs), for witnesses
    that run the loss itself; None when the pipeline was given none."""
    return gm.meta.get(EXAMPLE_INPUTS)


def _run_passes(gm: fx.GraphModule, passes: Sequence[Pass], example_tensors: Sequence[torch.Tensor] | None,
                snapshots: list[Snapshot], certificates: list[Certificate]) -> fx.GraphModule:
    current = gm
    for p in passes:
        before = snapshots[-1].fingerprint
        start = time.perf_counter()
        try:
            result = p.run(copy_graph_module(current))
        except Exception as exc:  # a broken pass must not break the loss
            certificates.append(_failure(p.name, "pass-raised", exc, {}, before))
            continue
        try:
            result.graph_module.graph.lint()
            result.graph_module.recompile()
        except Exception as exc:
            certificates.append(_failure(p.name, "lint-failed", exc, {}, before))
            continue
        if example_tensors is not None and result.modified:
            failures = annotate_new(result.graph_module)
            new = [(n, e) for n, e in failures if n.name not in _unannotated(current)]
            if new:
                node, exc = new[0]
                certificates.append(_failure(p.name, "metadata-failed", exc, {
                    "node": node.name, "statement": node.format_node(), "failed_nodes": len(new),
                    "location": node_location(node)}, before))
                continue
        code = result.graph_module.graph.python_code("self").src  # once: fingerprint and snapshot
        after = code_fingerprint(code)
        if (after != before) != bool(result.modified):
            certificates.append(_failure(p.name, "fingerprint-mismatch", None, {
                "claimed_modified": bool(result.modified), "fingerprint_before": before,
                "fingerprint_after": after,
                "message": f"pass said modified={result.modified}, fingerprint "
                           f"{'changed' if after != before else 'unchanged'}"}, before))
            continue
        found = list(result.certificates) or ([] if result.modified else [_no_site(p.name)])
        certificates.extend(dataclasses.replace(c, graph_fingerprint=before) for c in found)
        logger.debug("pass %s: modified=%s, %d certificate(s), %.3f s", p.name, result.modified,
                     len(result.certificates), time.perf_counter() - start)
        current = result.graph_module
        snapshots.append(_snapshot(p.name, code, result.modified, time.perf_counter() - start))
    return current
