"""Tampered certificate files: each edit is named on load, in verification and by the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fxpasses import trace
from fxpasses.certificates import Certificate, Check, Site
from fxpasses.certificates.digest import content_digest
from fxpasses.certificates.integrity import decision_problems, report_problems
from fxpasses.certificates.io import load
from fxpasses.certificates.verify import verify_certificate, verify_report
from fxpasses.cli import EXIT_LOAD, EXIT_NOT_APPLIED, EXIT_OK, import_file, main, not_applied
from fxpasses.report import build_report

# certificates here are built by hand or drawn at random: their codes do not count as exercised
pytestmark = pytest.mark.usefixtures("codes_not_counted")

samples = import_file(Path(__file__).with_name("samples.py"))


@pytest.fixture(scope="module")
def pristine():
    return build_report(samples.optimized())


@pytest.fixture
def report(pristine):
    return copy.deepcopy(pristine)


def resealed(report: dict) -> dict:
    """``report`` with every digest recomputed, as a forger (or a careless tool) would."""
    for special in report["specializations"]:
        for data in special["certificates"]:
            data["digest"] = content_digest(data)
    report["digest"] = content_digest(report)
    return report


def saved(report: dict, tmp_path: Path) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report))
    return path


def kinds(problems) -> set[str]:
    return {p.kind for p in problems}


def traced_graph():
    args, kwargs = samples.make_inputs()
    return trace(samples.make_loss(), args, kwargs)


def refused(report: dict) -> dict:
    return next(c for c in report["specializations"][0]["certificates"]
                if c["pass_name"] == "RefuseMethods")


def test_an_untouched_report_has_no_problem_and_loads(pristine, tmp_path):
    assert report_problems(pristine) == []
    assert load(saved(pristine, tmp_path)) == pristine
    result = verify_report(pristine, traced_graph())
    assert result.ok and (result.checked, result.compared) == (7, 3)  # every certificate


def test_applied_with_a_failed_check_is_a_decision_and_codes_mismatch(report, tmp_path):
    data = refused(report)
    data["decision"], data["codes"] = "applied", []
    with pytest.raises(ValueError, match="digest-mismatch.*decision-mismatch"):
        load(saved(report, tmp_path))
    resealed(report)  # digests recomputed: the decision still does not follow from the checks
    problems = report_problems(report)  # the pass counters, untouched, disagree too
    assert kinds(problems) == {"decision-mismatch", "codes-mismatch", "counters-mismatch"}
    assert (problems[0].expected, problems[0].actual) == ("refused", "applied")
    with pytest.raises(ValueError, match="decision-mismatch"):
        load(saved(report, tmp_path))
    assert not verify_report(report, traced_graph()).ok


def test_refused_with_every_check_holding_is_a_decision_mismatch(report):
    data = refused(report)
    data["checks"][0]["ok"] = True
    assert kinds(report_problems(resealed(report))) == {"decision-mismatch", "codes-mismatch"}


def test_codes_other_than_the_failed_checks_are_a_codes_mismatch(report):
    refused(report)["codes"] = ["hooks-present"]
    assert kinds(report_problems(resealed(report))) == {"codes-mismatch", "counters-mismatch"}


def test_an_edited_graph_fingerprint_is_never_skipped(report):
    refused(report)["graph_fingerprint"] = "0123456789abcdef"
    result = verify_report(resealed(report), traced_graph())
    assert not result.ok and "ok" not in result.render().splitlines()[0].split(": ")[-1]
    assert kinds(result.problems) == {"fingerprint-unknown"}
    assert result.checked == 7


def test_an_emptied_graph_fingerprint_is_named(report):
    refused(report)["graph_fingerprint"] = ""
    result = verify_report(resealed(report), traced_graph())
    assert [p.kind for p in result.problems] == ["no-fingerprint"]


def test_an_edited_step_code_is_a_changed_snapshot(report):
    snapshot = report["specializations"][0]["snapshots"][0]
    snapshot["code"] = snapshot["code"].replace("x * 1", "x * 2")
    assert kinds(report_problems(resealed(report))) == {"snapshot-changed"}


@pytest.mark.parametrize("edit", [
    lambda r: r["specializations"][0]["counters"]["RefuseMethods"].__setitem__("applied", 3),
    lambda r: r["stats"].__setitem__("calls", 7)])
def test_edited_counters_are_a_counters_mismatch(report, edit):
    edit(report)
    assert kinds(report_problems(resealed(report))) == {"counters-mismatch"}


def test_any_edit_outside_a_certificate_breaks_the_file_digest(report, tmp_path):
    report["loss"] = "SomethingElse"
    assert [(p.kind, p.certificate) for p in report_problems(report)] == [
        ("digest-mismatch", "the report")]
    with pytest.raises(ValueError, match="the report: digest-mismatch"):
        load(saved(report, tmp_path))


def test_an_edited_certificate_breaks_its_own_digest_and_the_files(report):
    refused(report)["message"] = "all fine"
    problems = report_problems(report)
    assert [p.kind for p in problems] == ["digest-mismatch", "digest-mismatch"]
    assert "certificate 3 (RefuseMethods @" in problems[1].certificate
    with pytest.raises(ValueError, match="edited after it was written"):
        Certificate.from_dict(refused(report))


def test_require_applied_reads_the_certificates_not_the_counters(report, tmp_path, capsys):
    counters = report["specializations"][0]["counters"]["RefuseMethods"]
    counters["applied"], counters["refused"] = 3, {}
    assert not_applied(report, ["RefuseMethods"]) == {"RefuseMethods": "op-unknown: 4"}
    path = saved(report, tmp_path)
    assert main(["explain", str(path), "--require-applied", "RefuseMethods"]) == EXIT_LOAD
    assert main(["explain", str(saved(resealed(report), tmp_path)), "--require-applied",
                 "RefuseMethods"]) == EXIT_LOAD  # counters-mismatch even when resealed
    err = capsys.readouterr().err
    assert "counters-mismatch" in err and "Traceback" not in err


def test_a_tampered_file_exits_3_with_one_line(report, tmp_path, capsys):
    refused(report)["decision"], refused(report)["codes"] = "applied", []
    assert main(["explain", str(saved(report, tmp_path))]) == EXIT_LOAD
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "decision-mismatch" in err


def test_an_untouched_file_still_passes_require_applied(pristine, tmp_path, capsys):
    path = saved(pristine, tmp_path)
    assert main(["explain", str(path), "--brief", "--require-applied", "DropTimesOne"]) == EXIT_OK
    assert main(["explain", str(path), "--brief", "--require-applied", "RefuseMethods"]) == \
        EXIT_NOT_APPLIED


def test_one_certificate_is_checked_against_its_checks():
    site = Site(("n",))
    lying = Certificate("p", site, "applied", (Check("a", False, {}, "hooks-present"),))
    assert kinds(decision_problems(lying)) == {"decision-mismatch", "codes-mismatch"}
    assert "decision-mismatch" in verify_certificate(lying, traced_graph()).kinds()
    failed = Certificate("p", site, "failed", (Check("a", False, {}, "pass-raised"),),
                         ("pass-raised",))
    assert decision_problems(failed) == []
    assert kinds(decision_problems(Certificate("p", site, "failed", (), ("pass-raised",)))) == {
        "decision-mismatch", "codes-mismatch"}
