"""Certificate files: one JSON document per optimized loss, schema-versioned, with digests.

The document is the report of :func:`fxpasses.report.build_report` (pipeline, versions, every
specialization's certificates, graph snapshots with fingerprints and code, run-time counters, and
the report's digest), written as strict JSON (no NaN; non-finite floats in evidence are tagged by
the certificate model). ``save(report, path)`` writes it. ``load(path)`` reads it back and refuses,
with a ValueError that names every problem, a file that is not JSON, has another schema version,
does not follow the structure of :mod:`fxpasses.certificates.schema`, or fails an integrity check
of :mod:`fxpasses.certificates.integrity` (an edited digest, decision, code, counter, fingerprint
or graph step). A file that loads is one that ``render_report`` and the verifier accept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..log import logger
from .integrity import report_problems
from .model import SCHEMA_VERSION, Certificate, decode_floats
from .schema import REPORT, mismatches

REPORT_SCHEMA = 5  # bump when the report's structure changes (tests/report/test_schema.py)
SHOWN = 5  # problems named in one error message


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


def _listed(what: str, problems: list[Any]) -> str:
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return f"{what} ({len(problems)}): " + "; ".join(map(str, problems[:SHOWN])) + more


def validate(report: Any) -> None:
    """ValueError unless ``report`` is a report of this schema: its versions, its structure and
    field types, and every certificate parses (codes known, decision well-formed)."""
    if not isinstance(report, dict) or "report_schema" not in report:
        raise ValueError("not an fxpasses report (no report_schema)")
    if report["report_schema"] != REPORT_SCHEMA:
        raise ValueError(f"report schema {report['report_schema']!r}; this fxpasses reads "
                         f"schema {REPORT_SCHEMA}")
    if report.get("certificate_schema") != SCHEMA_VERSION:
        raise ValueError(f"certificate schema {report.get('certificate_schema')!r}; this "
                         f"fxpasses reads schema {SCHEMA_VERSION}")
    try:
        wrong = mismatches(decode_floats(report), REPORT)
    except (TypeError, ValueError) as exc:
        wrong = [f"a tagged float is not a float: {exc}"]
    if wrong:
        raise ValueError(_listed("does not follow the report schema", wrong))
    for special in report["specializations"]:
        for number, data in enumerate(special["certificates"]):
            try:
                Certificate.from_dict(data, check_digest=False)
            except ValueError as exc:
                raise ValueError(f"specialization {special['index']}, certificate {number} is "
                                 f"invalid: {exc}") from None


def load(path: str | os.PathLike, *, check_integrity: bool = True) -> dict[str, Any]:
    """The report saved at ``path``; ValueError naming what is wrong (see the module docstring).

    ``check_integrity=False`` reads a file that fails only integrity checks, to inspect it;
    :func:`fxpasses.certificates.integrity.report_problems` then lists what is wrong.
    """
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    try:
        validate(report)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    problems = report_problems(report) if check_integrity else []
    if problems:
        raise ValueError(f"{path}: " + _listed("fails its integrity checks", problems))
    return report


def certificates_of(report: dict[str, Any]) -> list[Certificate]:
    """Every certificate of every specialization of ``report``, in order."""
    return [Certificate.from_dict(c) for s in report["specializations"] for c in s["certificates"]]
