"""Counting certificates: per pass, sites seen, applied, refused and failed by code."""

from __future__ import annotations

from typing import Any, Iterable

from .model import Certificate


def pass_counters(certs: Iterable[Certificate]) -> dict[str, dict[str, Any]]:
    """Per pass: sites seen, applied, and refused / failed counts by code."""
    out: dict[str, dict[str, Any]] = {}
    for cert in certs:
        entry = out.setdefault(cert.pass_name,
                               {"seen": 0, "applied": 0, "refused": {}, "failed": {}})
        entry["seen"] += 1
        if cert.applied:
            entry["applied"] += 1
        else:
            for code in cert.codes:
                entry[cert.decision][code] = entry[cert.decision].get(code, 0) + 1
    return out
