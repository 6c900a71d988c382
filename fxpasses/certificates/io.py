"""Certificate files: one JSON document per optimized loss, schema-versioned.

The document is the report of :func:`fxpasses.report.build_report` (pipeline, versions, every
specialization's certificates, graph snapshots with fingerprints and code, run-time counters),
written as strict JSON (no NaN; non-finite floats in evidence are tagged by the certificate model).
``save(report, path)`` writes it; ``load(path)`` reads it back, checks ``report_schema`` and parses
every certificate, so a file that loads is one that ``render_report`` and the verifier accept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..log import logger
from .model import Certificate

REPORT_SCHEMA = 1  # bump when the report's structure changes (tests/report/test_schema.py)


def dumps(report: dict[str, Any]) -> str:
    """``report`` as the text of a certificate file: strict, indented JSON, keys in the report's
    own order (so a loaded report renders exactly as the live one)."""
    return json.dumps(report, indent=1, allow_nan=False) + "\n"


def save(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``report`` to ``path`` (see :func:`dumps`); returns the path."""
    path = Path(path)
    path.write_text(dumps(report), encoding="utf-8")
    logger.info("wrote %s: %d certificates", path,
                sum(len(s["certificates"]) for s in report["specializations"]))
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    """The report saved at ``path``. ValueError if it is not a report this fxpasses reads."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(report, dict) or "report_schema" not in report:
        raise ValueError(f"{path} is not an fxpasses report (no report_schema)")
    if report["report_schema"] != REPORT_SCHEMA:
        raise ValueError(f"{path} has report schema {report['report_schema']!r}; this fxpasses "
                         f"reads schema {REPORT_SCHEMA}")
    try:
        certificates_of(report)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} holds an invalid certificate: "
                         f"{type(exc).__name__}: {exc}") from None
    return report


def certificates_of(report: dict[str, Any]) -> list[Certificate]:
    """Every certificate of every specialization of ``report``, in order."""
    return [Certificate.from_dict(c) for s in report["specializations"] for c in s["certificates"]]
