"""The report's JSON structure: a frozen copy per schema version, and what loading refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fxpasses import PassResult
from fxpasses.certificates import SCHEMA_VERSION, Certificate, Site
from fxpasses.certificates import schema
from fxpasses.certificates.io import REPORT_SCHEMA, dumps, load
from fxpasses.cli import EXIT_LOAD, import_file, main
from fxpasses.report import build_report
from fxpasses.ir.runtime_op import RuntimeOp

samples = import_file(Path(__file__).with_name("samples.py"))

# Frozen copies of the structures of report schema 5 / certificate schema 2. A change of
# fxpasses.certificates.schema must bump the versions and update these.
EVIDENCE = {"*": "json"}
CERTIFICATE_2 = {
    "pass_name": "str",
    "site": {"nodes": ["str"], "locations": ["str"], "description": "str"},
    "decision": "str",
    "checks": [{"id": "str", "ok": "bool", "evidence": EVIDENCE, "code": ("str", "NoneType")}],
    "codes": ["str"], "effect": EVIDENCE,
    "guards": [{"id": "str", "description": "str", "code": "str", "evidence": EVIDENCE}],
    "witness": ("NoneType", {"seed": "int", "dtype": "str", "shapes": EVIDENCE,
                             "max_abs_value_diff": "number", "max_abs_grad_diff": "number",
                             "compared": ["str"]}),
    "message": "str", "graph_fingerprint": "str", "schema_version": "int", "digest": "str",
}
COUNTS = {"*": "int"}
REPORT_5 = {
    "report_schema": "int", "certificate_schema": "int", "created": "str",
    "versions": {"fxpasses": "str", "torch": "str", "python": "str"},
    "loss": "str", "pipeline": ["str"],
    "guards": [{"id": "str", "description": "str", "code": "str", "evidence": EVIDENCE}],
    "specializations": [{
        "index": "int", "inputs": ["str"], "disabled": ("str", "NoneType"),
        "pipeline_running": "bool", "seconds": {"*": "number"},
        "snapshots": [{"step": "str", "fingerprint": "str", "modified": "bool",
                       "seconds": "number", "code": "str"}],
        "counters": {"*": {"seen": "int", "applied": "int", "refused": COUNTS, "failed": COUNTS}},
        "certificates": [CERTIFICATE_2], "diff": "str"}],
    "stats": {"calls": "int", "optimized": "int", "native": COUNTS,
              "abandoned": COUNTS, "retraced": COUNTS,
              "exceptions": [{"type": "str", "message": "str", "node": "str",
                              "specialization": "int", "statement": "str", "location": "str"}],
              "sites": {"*": COUNTS}, "rerecorded": {"*": COUNTS}},
    "background_failures": ["str"],
    "digest": "str",
}


def test_the_schema_is_the_frozen_one_of_its_version():
    assert (REPORT_SCHEMA, SCHEMA_VERSION) == (5, 2), "freeze the new structures above"
    assert schema.REPORT == REPORT_5 and schema.CERTIFICATE == CERTIFICATE_2


class _Raise(RuntimeOp):
    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("raised at run time")

    def propagate(self, value: torch.Tensor) -> torch.Tensor:
        return value


class RaiseAtRunTime:
    """Route the output through an op that raises: the call runs natively, the exception kept."""

    name = "RaiseAtRunTime"

    def run(self, gm: fx.GraphModule) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        (value,) = output.args[0]
        with gm.graph.inserting_before(output):
            raised = gm.graph.call_function(_Raise("raise"), (value,))
        output.args = ((raised,),)
        return PassResult(gm, True, [Certificate.from_checks(self.name, Site((value.name,)), [])])


def test_a_report_follows_the_schema():
    fast = samples.optimized(passes=(samples.DropTimesOne(), samples.RefuseMethods(),
                                     samples.CountOutput()))
    args, kwargs = samples.make_inputs()
    with torch.no_grad():  # a native call, counted by reason
        fast(*args, **kwargs)
    report = json.loads(dumps(build_report(fast)))
    assert report["stats"]["sites"] and report["stats"]["native"]  # the maps are not empty
    assert schema.mismatches(report, schema.REPORT) == []
    raising = samples.optimized(passes=(RaiseAtRunTime(),), calls=1)
    report = json.loads(dumps(build_report(raising)))
    assert report["stats"]["exceptions"]  # the list is not empty
    assert schema.mismatches(report, schema.REPORT) == []


def test_each_kind_of_mismatch_is_named_with_its_path():
    report = json.loads(dumps(build_report(samples.optimized())))
    report["specializations"][0]["extra"] = 1
    del report["stats"]["sites"]
    report["pipeline"] = "DropTimesOne"
    report["specializations"][0]["certificates"][0]["checks"][0]["ok"] = "yes"
    assert set(schema.mismatches(report, schema.REPORT)) == {
        "$.pipeline: str, expected a list",
        "$.specializations[0]: unexpected 'extra'",
        "$.specializations[0].certificates[0].checks[0].ok: str, expected bool",
        "$.stats: missing 'sites'"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "report.json"
    samples.optimized().save_certificates(path)
    return path


def _edited(saved: Path, tmp_path: Path, edit) -> Path:
    report = json.loads(saved.read_text())
    edit(report)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("part", ["stats", "versions", "guards", "pipeline", "specializations",
                                  "loss", "digest"])
def test_a_file_missing_a_part_is_refused_by_name_with_exit_3(saved, tmp_path, part, capsys):
    path = _edited(saved, tmp_path, lambda r: r.pop(part))
    with pytest.raises(ValueError, match=f"missing '{part}'"):
        load(path)
    assert main(["explain", str(path)]) == EXIT_LOAD
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"missing '{part}'" in err and "Traceback" not in err


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["stats"].__setitem__("calls", "2"), r"\$\.stats\.calls: str, expected int"),
    (lambda r: r["versions"].__setitem__("torch", 2), r"\$\.versions\.torch: int, expected str"),
    (lambda r: r["specializations"][0]["certificates"][0].__setitem__("codes", "x"),
     r"certificates\[0\]\.codes: str, expected a list"),
    (lambda r: r["specializations"][0]["certificates"][0]["checks"][0].__setitem__(
        "evidence", {"x": {"__float__": "many"}}), "tagged float"),
    (lambda r: r.__setitem__("report_schema", 1), "report schema 1"),
    (lambda r: r.__setitem__("certificate_schema", 1), "certificate schema 1"),
    (lambda r: r["specializations"][0]["certificates"][0].__setitem__("decision", "maybe"),
     "decision must be one of"),
    (lambda r: r["specializations"][0]["certificates"][2].__setitem__("codes", ["no-such"]),
     "unknown fxpasses code 'no-such'"),
])
def test_a_wrong_field_type_or_value_is_refused_by_name(saved, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load(_edited(saved, tmp_path, edit))


def test_a_file_that_is_not_a_report_is_refused(tmp_path):
    for text, message in (("[1, 2]", "no report_schema"), ("{", "not JSON")):
        path = tmp_path / "x.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load(path)
