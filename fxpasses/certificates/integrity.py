"""Whether a report agrees with itself: digests, decisions, counters, recorded graph steps.

Every check here reads only the report (no loss, no graph). A problem is one of:

  digest-mismatch      a certificate's or the report's content is not the one its digest was
                       computed from: it was edited after it was written
  decision-mismatch    the decision is not the one its checks give (:func:`~.model.decide`):
                       applied with a failed check, refused or failed with every check holding
  codes-mismatch       the codes are not exactly the failed checks' codes
  fingerprint-unknown  the certificate names a graph that no step of its specialization recorded
  snapshot-changed     a recorded step's code does not hash to the fingerprint recorded with it
  counters-mismatch    a pass's counters are not the counts of its certificates, or the calls
                       are not the optimized calls plus the native ones

:func:`report_problems` lists every problem of every certificate (it never stops at the first);
:func:`fxpasses.certificates.io.load` refuses a file that has any, and
:func:`fxpasses.certificates.verify.verify_report` reports them with the graph's problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .digest import DIGEST_KEY, code_fingerprint, content_digest
from .model import Certificate, decide
from .summary import pass_counters

INTEGRITY_KINDS = ("digest-mismatch", "decision-mismatch", "codes-mismatch",
                   "fingerprint-unknown", "snapshot-changed", "counters-mismatch")
GRAPH_KINDS = ("fingerprint-changed", "no-fingerprint", "node-missing", "node-changed")
PROBLEM_KINDS = INTEGRITY_KINDS + GRAPH_KINDS


@dataclass(frozen=True)
class Problem:
    """One thing that is not as a certificate or report says (kinds: see the module docstring
    and :mod:`fxpasses.certificates.verify`)."""

    kind: str  # one of PROBLEM_KINDS
    certificate: str = ""  # which certificate or part of the report; empty for the graph
    node: str = ""
    expected: str = ""
    actual: str = ""

    def __post_init__(self) -> None:
        if self.kind not in PROBLEM_KINDS:
            raise ValueError(f"unknown problem kind {self.kind!r}; known: {PROBLEM_KINDS}")

    def __str__(self) -> str:
        where = f"{self.certificate}: " if self.certificate else ""
        node = f" {self.node}" if self.node else ""
        change = (f": expected {self.expected!r}, found {self.actual!r}"
                  if self.expected or self.actual else "")
        return f"{where}{self.kind}{node}{change}"


def label(cert: Certificate) -> str:
    """``"pass @ node, node"``: how problems name a certificate."""
    return f"{cert.pass_name} @ {', '.join(cert.site.nodes) or '-'}"


def _codes(codes: tuple[str, ...]) -> str:
    return ", ".join(codes) or "(none)"


def decision_problems(cert: Certificate, where: str | None = None) -> list[Problem]:
    """The certificate's decision and codes against those its checks give (:func:`decide`)."""
    where = where or label(cert)
    decision, codes = decide(cert.checks)
    problems = []
    if decision != cert.decision:
        problems.append(Problem("decision-mismatch", where, "", decision, cert.decision))
    if codes != cert.codes:
        problems.append(Problem("codes-mismatch", where, "", _codes(codes), _codes(cert.codes)))
    return problems


def _digest_problem(data: dict[str, Any], where: str) -> list[Problem]:
    actual = content_digest(data)
    stored = data.get(DIGEST_KEY, "")
    return [] if stored == actual else [Problem("digest-mismatch", where, "", stored, actual)]


def _specialization_problems(special: dict[str, Any]) -> list[Problem]:
    index = special["index"]
    problems, recorded = [], []
    for snapshot in special["snapshots"]:
        actual = code_fingerprint(snapshot["code"])
        if actual != snapshot["fingerprint"]:
            problems.append(Problem("snapshot-changed", f"specialization {index}, step "
                                    f"{snapshot['step']}", "", snapshot["fingerprint"], actual))
        recorded.append(snapshot["fingerprint"])
    certs = []
    for number, data in enumerate(special["certificates"]):
        cert = Certificate.from_dict(data, check_digest=False)
        certs.append(cert)
        where = f"specialization {index}, certificate {number} ({label(cert)})"
        problems += _digest_problem(data, where)
        problems += decision_problems(cert, where)
        if cert.graph_fingerprint and cert.graph_fingerprint not in recorded:
            problems.append(Problem("fingerprint-unknown", where, "", " or ".join(
                dict.fromkeys(recorded)) or "(no step recorded)", cert.graph_fingerprint))
    counted = pass_counters(certs)
    if special["counters"] != counted:
        problems.append(Problem("counters-mismatch", f"specialization {index}, pass counters", "",
                                str(counted), str(special["counters"])))
    return problems


def report_problems(report: dict[str, Any]) -> list[Problem]:
    """Every integrity problem of ``report`` (structure already valid; see the module docstring)."""
    problems = _digest_problem(report, "the report")
    stats = report["stats"]
    calls = stats["optimized"] + sum(stats["native"].values())
    if stats["calls"] != calls:
        problems.append(Problem("counters-mismatch", "run-time counters", "",
                                f"calls {calls}", f"calls {stats['calls']}"))
    for special in report["specializations"]:
        problems += _specialization_problems(special)
    return problems


__all__ = ["GRAPH_KINDS", "INTEGRITY_KINDS", "PROBLEM_KINDS", "Problem", "decision_problems",
           "label", "report_problems"]
