"""Readable text for certificates (what ``explain()`` prints)."""

from __future__ import annotations

from typing import Any, Iterable

from ..locations import shown
from .codes import lookup
from .model import Certificate

_LOCATIONS_SHOWN = 3  # a site's source lines listed before "and N more"
_GUARDS_SHOWN = 6  # without verbose, a certificate's guards listed before the rest are folded
_NODES_SHOWN = 8  # without verbose, a site's nodes named before the rest are folded (a region has hundreds)


def _value(value: Any, limit: int = 120) -> str:
    if isinstance(value, float):
        text = f"{value:.3g}"
    elif isinstance(value, tuple):
        text = "(" + ", ".join(_value(v, limit) for v in value) + ("," if len(value) == 1 else "") + ")"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_value(v, limit)}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _evidence(evidence: dict) -> str:
    return "  ".join(f"{key}={_value(val)}" for key, val in evidence.items())


def render_certificate(cert: Certificate, verbose: bool = True) -> str:
    """Several lines: header, checks (✓/✗ with evidence), effect, guards, witness; without
    ``verbose`` the checks are left out and long lists of the site's nodes and of guards are
    folded."""
    locations = list(dict.fromkeys(shown(loc) for loc in cert.site.locations if loc))
    where = ", ".join(locations[:_LOCATIONS_SHOWN]) or "no source location"
    if len(locations) > _LOCATIONS_SHOWN:
        where += f" and {len(locations) - _LOCATIONS_SHOWN} more"
    nodes = cert.site.nodes if verbose else cert.site.nodes[:_NODES_SHOWN]
    named = ", ".join(nodes) or "-"
    if len(nodes) < len(cert.site.nodes):
        named += f" and {len(cert.site.nodes) - len(nodes)} more nodes"
    head = f"[{cert.decision}] {cert.pass_name} @ {named}  ({where})"
    lines = [head]
    if cert.site.description:
        lines.append(f"    {cert.site.description}")
    if cert.message:
        lines.append(f"    {shown(cert.message)}")
    for code in cert.codes:
        info = lookup(code)
        lines.append(f"    code {code}: {info.explanation}")
        lines.append(f"      hint: {info.hint}")
    if verbose:
        for check in cert.checks:
            mark = "ok  " if check.ok else "FAIL"
            suffix = "" if check.ok else f"  [{check.code}]"
            lines.append(f"    {mark} {check.id}{suffix}: {_evidence(check.evidence)}")
    if cert.effect:
        lines.append(f"    effect: {_evidence(cert.effect)}")
    guards = cert.guards if verbose else cert.guards[:_GUARDS_SHOWN]
    for guard in guards:
        lines.append(f"    guard {guard.id} (else {guard.code}): {shown(guard.description)}")
    if len(guards) < len(cert.guards):
        lines.append(f"    ... and {len(cert.guards) - len(guards)} more guards (explain(verbose=True) "
                     "lists them)")
    if cert.witness is not None:
        w = cert.witness
        lines.append(f"    witness: {w.dtype} max|dvalue|={w.max_abs_value_diff:.3g} "
                     f"max|dgrad|={w.max_abs_grad_diff:.3g} seed={w.seed} shapes={_value(w.shapes)}")
    return "\n".join(lines)


def render_certificates(certs: Iterable[Certificate], verbose: bool = True) -> str:
    return "\n".join(render_certificate(c, verbose) for c in certs)
