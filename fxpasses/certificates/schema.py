"""The structure of certificate files, as data, and the check that a value follows it.

Notation: a type name (``"str"``, ``"int"``, ``"bool"``, ``"NoneType"``; ``"number"`` is an int or
a float; ``"json"`` is any JSON value); ``[item]`` a list of ``item``; ``{key: schema}`` an object
with exactly these keys; ``{"*": schema}`` an object with any keys; a tuple, any one of its
alternatives. (A JSON Schema validator would do the same; fxpasses depends on none, and the
structure is small.) A change of these structures is a change of ``SCHEMA_VERSION`` /
``REPORT_SCHEMA`` (tests/report/test_schema.py keeps a frozen copy of each).
"""

from __future__ import annotations

from typing import Any

EVIDENCE = {"*": "json"}
NUMBER = "number"
CERTIFICATE = {
    "pass_name": "str",
    "site": {"nodes": ["str"], "locations": ["str"], "description": "str"},
    "decision": "str",
    "checks": [{"id": "str", "ok": "bool", "evidence": EVIDENCE, "code": ("str", "NoneType")}],
    "codes": ["str"],
    "effect": EVIDENCE,
    "guards": [{"id": "str", "description": "str", "code": "str", "evidence": EVIDENCE}],
    "witness": ("NoneType", {"seed": "int", "dtype": "str", "shapes": EVIDENCE,
                             "max_abs_value_diff": NUMBER, "max_abs_grad_diff": NUMBER,
                             "compared": ["str"]}),
    "message": "str",
    "graph_fingerprint": "str",
    "schema_version": "int",
    "digest": "str",
}
COUNTS = {"*": "int"}
SPECIALIZATION = {
    "index": "int", "inputs": ["str"], "disabled": ("str", "NoneType"), "pipeline_running": "bool",
    "seconds": {"*": NUMBER},
    "snapshots": [{"step": "str", "fingerprint": "str", "modified": "bool", "seconds": NUMBER,
                   "code": "str"}],
    "counters": {"*": {"seen": "int", "applied": "int", "refused": COUNTS, "failed": COUNTS}},
    "certificates": [CERTIFICATE],
    "diff": "str",
}
REPORT = {
    "report_schema": "int", "certificate_schema": "int", "created": "str",
    "versions": {"fxpasses": "str", "torch": "str", "python": "str"},
    "loss": "str", "pipeline": ["str"],
    "guards": [{"id": "str", "description": "str", "code": "str", "evidence": EVIDENCE}],
    "specializations": [SPECIALIZATION],
    "stats": {"calls": "int", "optimized": "int", "native": COUNTS,
              "abandoned": COUNTS, "retraced": COUNTS,
              "exceptions": [{"type": "str", "message": "str", "node": "str",
                              "specialization": "int", "statement": "str", "location": "str"}],
              "sites": {"*": COUNTS}, "rerecorded": {"*": COUNTS}},
    "background_failures": ["str"],
    "digest": "str",
}

_JSON_TYPES = (type(None), bool, int, float, str, list, dict)


def _type_ok(value: Any, name: str) -> bool:
    if name == "json":
        return _is_json(value)
    if name == "number":
        return type(value) in (int, float)
    return type(value).__name__ == name


def _is_json(value: Any) -> bool:
    if isinstance(value, list):
        return all(map(_is_json, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return type(value) in _JSON_TYPES


def _describe(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, tuple):
        return " or ".join(map(_describe, schema))
    return "a list" if isinstance(schema, list) else "an object"


def mismatches(value: Any, schema: Any, path: str = "$") -> list[str]:
    """Every place where ``value`` (decoded JSON) does not follow ``schema``; empty if it does.

    Each entry is ``"<path>: <what is wrong>"``, the path written as ``$.key[index]``.
    """
    if isinstance(schema, tuple):
        if any(not mismatches(value, alternative, path) for alternative in schema):
            return []
        return [f"{path}: {type(value).__name__}, expected {_describe(schema)}"]
    if isinstance(schema, str):
        return [] if _type_ok(value, schema) else [
            f"{path}: {type(value).__name__}, expected {schema}"]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__}, expected a list"]
        return [m for i, item in enumerate(value)
                for m in mismatches(item, schema[0], f"{path}[{i}]")]
    if not isinstance(value, dict):
        return [f"{path}: {type(value).__name__}, expected an object"]
    if set(schema) == {"*"}:
        return [m for k, v in value.items() for m in mismatches(v, schema["*"], f"{path}.{k}")]
    out = [f"{path}: missing {key!r}" for key in schema if key not in value]
    out += [f"{path}: unexpected {key!r}" for key in value if key not in schema]
    return out + [m for k in schema if k in value
                  for m in mismatches(value[k], schema[k], f"{path}.{k}")]


__all__ = ["CERTIFICATE", "REPORT", "SPECIALIZATION", "mismatches"]
