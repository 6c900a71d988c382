"""Snapshot of the report's JSON structure: a change here must bump REPORT_SCHEMA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fxpasses.certificates import Certificate
from fxpasses.certificates.io import REPORT_SCHEMA, dumps
from fxpasses.cli import import_file
from fxpasses.report import build_report

samples = import_file(Path(__file__).with_name("samples.py"))

# Schema notation: a type name; [item]; {key: schema} with exactly these keys; {"*": schema} a map
# with any keys; "certificate" a Certificate's dict (versioned by certificate_schema).
COUNTS = {"*": "int"}
SPECIALIZATION = {
    "index": "int", "inputs": ["str"], "disabled": ("str", "NoneType"), "seconds": {"*": "float"},
    "snapshots": [{"step": "str", "fingerprint": "str", "modified": "bool", "seconds": "float",
                   "code": "str"}],
    "counters": {"*": {"seen": "int", "applied": "int", "refused": COUNTS, "failed": COUNTS}},
    "certificates": ["certificate"],
    "diff": "str",
}
REPORT = {
    "report_schema": "int", "certificate_schema": "int", "created": "str",
    "versions": {"fxpasses": "str", "torch": "str", "python": "str"},
    "loss": "str", "pipeline": ["str"],
    "guards": [{"id": "str", "description": "str", "code": "str", "evidence": {"*": "int"}}],
    "specializations": [SPECIALIZATION],
    "stats": {"calls": "int", "optimized": "int", "native": COUNTS,
              "exceptions": [{"type": "str", "message": "str", "node": "str",
                              "specialization": "int"}],
              "sites": {"*": COUNTS}},
}


def mismatches(value: Any, schema: Any, path: str = "$") -> list[str]:
    """Where ``value`` does not follow ``schema`` (empty when it does)."""
    if schema == "certificate":
        return [] if Certificate.from_dict(value) else [path]
    if isinstance(schema, (str, tuple)):
        names = (schema,) if isinstance(schema, str) else schema
        return [] if type(value).__name__ in names else [f"{path}: {type(value).__name__}"]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: not a list"]
        return [m for i, item in enumerate(value)
                for m in mismatches(item, schema[0], f"{path}[{i}]")]
    if not isinstance(value, dict):
        return [f"{path}: not an object"]
    if set(schema) == {"*"}:
        return [m for k, v in value.items() for m in mismatches(v, schema["*"], f"{path}.{k}")]
    if set(value) != set(schema):
        return [f"{path}: keys {sorted(set(value) ^ set(schema))} differ"]
    return [m for k in schema for m in mismatches(value[k], schema[k], f"{path}.{k}")]


def test_report_structure_matches_the_snapshot_of_schema_1():
    assert REPORT_SCHEMA == 1, "update REPORT above with the new structure"
    fast = samples.optimized(passes=(samples.DropTimesOne(), samples.RefuseMethods(),
                                     samples.CountOutput()))
    args, kwargs = samples.make_inputs()
    with torch.no_grad():  # a native call, counted by reason
        fast(*args, **kwargs)
    report = json.loads(dumps(build_report(fast)))
    assert report["stats"]["sites"] and report["stats"]["native"]  # the maps are not empty
    assert mismatches(report, REPORT) == []


def test_a_changed_structure_is_caught():
    report = json.loads(dumps(build_report(samples.optimized())))
    report["specializations"][0]["extra"] = 1
    del report["stats"]["sites"]
    report["pipeline"] = "DropTimesOne"
    assert len(mismatches(report, REPORT)) == 3
