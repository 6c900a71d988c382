"""The report of an OptimizedLoss: one JSON document, and its readable rendering.

``build_report(opt)`` gathers the pipeline, every specialization (its certificates, snapshots'
fingerprints, per-pass counters and before/after diff) and the run-time counters into JSON data.
``render_report`` turns that data into the text that ``explain()`` and ``fxpasses explain`` print,
so a saved report and a live loss explain themselves identically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .certificates import Certificate, SCHEMA_VERSION, render_certificate
from .certificates.model import _as_evidence, _to_json_data

if TYPE_CHECKING:
    from .optimize import OptimizedLoss

REPORT_SCHEMA = 1


def _counters(certs: list[Certificate]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cert in certs:
        entry = out.setdefault(cert.pass_name, {"seen": 0, "applied": 0, "refused": {}, "failed": {}})
        entry["seen"] += 1
        if cert.applied:
            entry["applied"] += 1
        else:
            for code in cert.codes:
                entry[cert.decision][code] = entry[cert.decision].get(code, 0) + 1
    return out


def build_report(opt: "OptimizedLoss") -> dict[str, Any]:
    stats = opt.stats
    specializations = []
    for special in opt.specializations:
        run = special.run
        specializations.append({
            "index": special.index,
            "inputs": list(special.signature.placeholder_names) if special.signature else [],
            "disabled": special.disabled,
            "seconds": {k: round(v, 6) for k, v in special.seconds.items()},
            "snapshots": [{"step": s.step, "fingerprint": s.fingerprint, "modified": s.modified,
                           "seconds": round(s.seconds, 6)} for s in run.snapshots] if run else [],
            "counters": _counters(special.certificates),
            "certificates": [c.to_dict() for c in special.certificates],
            "diff": run.diff() if run else "",
            "code": run.snapshots[-1].code if run else "",
        })
    return {
        "report_schema": REPORT_SCHEMA,
        "certificate_schema": SCHEMA_VERSION,
        "loss": type(opt._loss).__name__,
        "pipeline": [p.name for p in opt.passes],
        "guards": [_to_json_data(_as_evidence(g)) for g in opt.guards()],
        "specializations": specializations,
        "stats": stats.as_dict(),
    }


def certificates_of(report: dict[str, Any]) -> list[Certificate]:
    return [Certificate.from_dict(c) for s in report["specializations"] for c in s["certificates"]]


def render_report(report: dict[str, Any], verbose: bool = True, diff: bool = True) -> str:
    lines = [f"fxpasses report: loss {report['loss']}, pipeline: "
             f"{' -> '.join(report['pipeline']) or '(no passes)'}"]
    stats = report["stats"]
    native = ", ".join(f"{k}: {v}" for k, v in stats["native"].items()) or "none"
    lines.append(f"calls: {stats['calls']}  optimized: {stats['optimized']}  "
                 f"native: {sum(stats['native'].values())} ({native})")
    for site, counters in stats["sites"].items():
        lines.append(f"  site {site}: " + ", ".join(f"{k}: {v}" for k, v in sorted(counters.items())))
    for exc in stats["exceptions"]:
        lines.append(f"  exception at node {exc['node']}: {exc['type']}: {exc['message']}")
    lines.append("whole-loss guards (else native): " + ", ".join(
        f"{g['id']} [{g['code']}]" for g in report["guards"]))
    if not report["specializations"]:
        lines.append("not traced yet: the first call traces and optimizes the loss")
    for special in report["specializations"]:
        timing = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in special["seconds"].items())
        lines.append("")
        lines.append(f"== specialization {special['index']}: inputs "
                     f"{', '.join(special['inputs']) or '-'}" + (f" ({timing})" if timing else ""))
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
    return "\n".join(lines)
