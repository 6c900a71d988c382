"""The report of an OptimizedLoss: one JSON document, and its readable rendering.

``build_report(opt)`` gathers what a user asks after ``optimize()``: the pipeline, the versions,
every specialization (its certificates, per-pass counters, graph snapshots with fingerprint and
code, the before/after diff) and the run-time counters (optimized vs native calls by reason code,
per-site counters such as paired calls, replays and recordings), sealed by a digest of its content
(:mod:`fxpasses.certificates.digest`). It is exactly what
``OptimizedLoss.save_certificates`` writes (:mod:`fxpasses.certificates.io`). ``render_report``
turns that data into the text that ``explain()`` and ``fxpasses explain`` print, so a saved report
and a live loss explain themselves identically.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import torch

from .certificates import Certificate, SCHEMA_VERSION, pass_counters, render_certificate
from .certificates.digest import content_digest
from .certificates.io import REPORT_SCHEMA
from .certificates.model import as_evidence, to_json_data
from .locations import shown
from .stats import abandoned_lines, rerecorded_lines
from .version import __version__

if TYPE_CHECKING:
    from .optimize import OptimizedLoss, Specialization


def _specialization(special: "Specialization", disabled: str | None) -> dict[str, Any]:
    run = special.run
    return {
        "index": special.index,
        "inputs": list(special.signature.placeholder_names) if special.signature else [],
        "disabled": disabled,
        "pipeline_running": special.pending is not None,
        "seconds": {k: round(v, 6) for k, v in special.seconds.items()},
        "snapshots": [{"step": s.step, "fingerprint": s.fingerprint, "modified": s.modified,
                       "seconds": round(s.seconds, 6), "code": s.code}
                      for s in run.snapshots] if run else [],
        "counters": pass_counters(special.certificates),
        "certificates": [c.to_dict() for c in special.certificates],
        "diff": run.diff() if run else "",
    }


def build_report(opt: "OptimizedLoss") -> dict[str, Any]:
    """The JSON data of ``opt``'s report (schema ``REPORT_SCHEMA``); see the module docstring."""
    report = {
        "report_schema": REPORT_SCHEMA,
        "certificate_schema": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"fxpasses": __version__, "torch": str(torch.__version__),
                     "python": platform.python_version()},
        "loss": type(opt._loss).__name__,
        "pipeline": [p.name for p in opt.passes],
        "guards": [to_json_data(as_evidence(g)) for g in opt.guards()],
        "specializations": [_specialization(s, opt.disabled(s)) for s in opt.specializations],
        "stats": opt.stats.as_dict(),
        "background_failures": list(opt._background_failures),
    }
    report["digest"] = content_digest(report)
    return report


def _render_summary(report: dict[str, Any]) -> list[str]:
    """What was optimized, in a few lines: per pass over every specialization, the sites
    applied and the most frequent refusal codes; the calls by path."""
    stats, lines = report["stats"], []
    native = sum(stats["native"].values())
    specials = report["specializations"]
    rate = f" ({100 * len(specials) / stats['calls']:.1f} per 100 calls)" if stats["calls"] else ""
    lines.append(f"summary: {stats['calls']} calls, {stats['optimized']} optimized, {native} native, "
                 f"{len(specials)} specialization{'s' * (len(specials) != 1)}{rate}")
    running = sum(s.get("pipeline_running", False) for s in specials)
    if running:
        lines.append(f"  background: the passes' pipeline of {running} trace(s) running in another "
                     "process (their calls run natively until it ends)")
    for failure in report.get("background_failures", ()):
        lines.append(f"  background: a pipeline in another process gave no result, so it ran in "
                     f"this one: {failure}")
    totals: dict[str, dict[str, Any]] = {}
    for special in specials:
        for name, c in special["counters"].items():
            entry = totals.setdefault(name, {"seen": 0, "applied": 0, "codes": {}})
            entry["seen"] += c["seen"]
            entry["applied"] += c["applied"]
            for code, n in {**c["refused"], **c["failed"]}.items():
                entry["codes"][code] = entry["codes"].get(code, 0) + n
    for name, entry in totals.items():
        top = sorted(entry["codes"].items(), key=lambda kv: -kv[1])
        codes = ", ".join(f"{k} {v}" for k, v in top[:3]) + (", ..." if len(top) > 3 else "")
        if name == "store":  # not a pass: the lookup of each trace's pipeline result
            lines.append(f"  store: the passes' result read back for {entry['applied']} of "
                         f"{entry['seen']} traces" + (f"; otherwise: {codes}" if codes else ""))
            continue
        lines.append(f"  {name}: applied at {entry['applied']} of {entry['seen']} sites"
                     + (f"; refused: {codes}" if codes else ""))
    return lines


def _render_runtime(report: dict[str, Any]) -> list[str]:
    stats = report["stats"]
    native = ", ".join(f"{k}: {v}" for k, v in stats["native"].items()) or "none"
    lines = [f"calls: {stats['calls']}  optimized: {stats['optimized']}  "
             f"native: {sum(stats['native'].values())} ({native})"]
    lines += abandoned_lines((shown(where), n) for where, n in stats.get("abandoned", {}).items())
    for what, n in stats.get("retraced", {}).items():
        lines.append(f"  traced again, an assumption changed: {shown(what)}: {n}")
    for site, counters in stats["sites"].items():
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(counters.items()))
        lines.append(f"  site {site}: {counts}")
    lines += rerecorded_lines(stats["rerecorded"])
    for exc in stats["exceptions"]:
        lines.append(f"  exception at node {exc['node']}: {exc['type']}: {exc['message']}")
        if exc.get("statement"):
            lines.append(f"    while executing {exc['statement']} ({exc.get('location') or 'no source line'})")
    lines.append("whole-loss guards (else native): " + ", ".join(
        f"{g['id']} [{g['code']}]" for g in report["guards"]))
    return lines


def _render_specialization(special: dict[str, Any], verbose: bool, diff: bool) -> list[str]:
    timing = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in special["seconds"].items())
    lines = ["", f"== specialization {special['index']}: inputs "
             f"{', '.join(special['inputs']) or '-'}" + (f" ({timing})" if timing else "")]
    if special["disabled"]:
        lines.append(f"   runs natively: {special['disabled']}")
    for name, c in special["counters"].items():
        refused = ", ".join(f"{k}: {v}" for k, v in c["refused"].items()) or "-"
        failed = ", ".join(f"{k}: {v}" for k, v in c["failed"].items())
        lines.append(f"   {name}: sites {c['seen']}, applied {c['applied']}, refused {refused}"
                     + (f", failed {failed}" if failed else ""))
    if special["snapshots"]:
        lines.append("   graph: " + " -> ".join(
            f"{s['step']} {s['fingerprint'][:8]}{'*' if s['modified'] else ''}"
            for s in special["snapshots"]))
    for data in special["certificates"]:
        text = render_certificate(Certificate.from_dict(data), verbose)
        lines.extend("   " + line for line in text.splitlines())
    if diff and special["diff"]:
        lines.append("   graph diff:")
        lines.extend("   " + line for line in special["diff"].splitlines())
    return lines


def render_report(report: dict[str, Any], verbose: bool = True, diff: bool = True) -> str:
    """Readable text of ``report``: ``verbose`` adds every check's evidence, ``diff`` the diff."""
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    lines = [f"fxpasses report: loss {report['loss']}, pipeline: "
             f"{' -> '.join(report['pipeline']) or '(no passes)'}",
             f"({versions}; {report['created']})"]
    lines += _render_summary(report)
    lines += _render_runtime(report)
    if not report["specializations"]:
        lines.append("not traced yet: the first call traces and optimizes the loss")
    for special in report["specializations"]:
        lines += _render_specialization(special, verbose, diff)
    return "\n".join(lines)
