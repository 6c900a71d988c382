"""Certificates: the frozen record of one decision a pass took about one site.

A certificate says which pass looked at which site (node names, source lines), every check it ran
with its evidence (all checks run; none short-circuits), the decision ("applied", "refused" or
"failed"), the reason codes of a refusal (from :mod:`fxpasses.certificates.codes`), the effect of
an applied rewrite, the run-time guards that keep it valid, and a witness where one was computed.

Evidence is JSON data: ``None``, ``bool``, ``int``, ``float``, ``str``, tuples of these and
string-keyed dicts of these. :func:`jsonable` normalises common torch values (dtypes, devices,
sizes) into that form when a certificate is built, so ``Certificate.from_json(c.to_json()) == c``.

The JSON form (schema ``SCHEMA_VERSION``, structure in :mod:`fxpasses.certificates.schema`) adds a
``digest``, the SHA-256 of the rest (:mod:`fxpasses.certificates.digest`); ``from_dict`` refuses
a certificate whose digest or structure is wrong. Whether the decision follows from the checks is
:func:`decide`'s answer, which :mod:`fxpasses.certificates.integrity` compares with the recorded one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from .codes import REGISTRY, lookup, occurs
from .digest import DIGEST_KEY, content_digest
from .schema import CERTIFICATE, mismatches

SCHEMA_VERSION = 2  # 2: a content digest
DECISIONS = ("applied", "refused", "failed")


def jsonable(value: Any) -> Any:
    """``value`` as certificate evidence: JSON scalars, tuples and str-keyed dicts, recursively.

    torch dtypes, devices and sizes become strings and tuples; lists become tuples. Anything else
    raises TypeError, so evidence can never hold an object that does not survive JSON.
    """
    if value is None or isinstance(value, bool):
        return value
    for plain in (int, float, str):  # subclasses (torch.__version__, IntEnum) as the plain type
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"evidence keys must be str, got {key!r}")
            out[key] = jsonable(item)
        return out
    if isinstance(value, (list, tuple)):  # torch.Size is a tuple
        return tuple(jsonable(item) for item in value)
    type_name = type(value).__module__ + "." + type(value).__qualname__
    if type_name in ("torch.dtype", "torch.device"):
        return str(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / 0-d scalars
        return jsonable(value.item())
    raise TypeError(f"cannot record {type_name} as certificate evidence: {value!r}")


def _from_json_data(value: Any) -> Any:
    """JSON-decoded data back into evidence form (lists become tuples)."""
    if isinstance(value, list):
        return tuple(_from_json_data(item) for item in value)
    if isinstance(value, dict):
        return {key: _from_json_data(item) for key, item in value.items()}
    return value


def to_json_data(value: Any) -> Any:
    """Evidence into plain JSON data; non-finite floats become tagged dicts (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, tuple):
        return [to_json_data(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json_data(item) for key, item in value.items()}
    return value


def decode_floats(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {key: decode_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_floats(item) for item in value]
    return value


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class Check:
    """One named precondition: whether it holds, the evidence read, the code raised if not."""

    id: str
    ok: bool
    evidence: Mapping[str, Any] = field(default_factory=dict)
    code: str | None = None

    def __post_init__(self) -> None:
        _set(self, "evidence", jsonable(dict(self.evidence)))
        if self.code is not None:
            occurs(self.code)
        if not self.ok and self.code is None:
            raise ValueError(f"failed check {self.id!r} needs a code")


@dataclass(frozen=True)
class Site:
    """Where a decision applies: graph node names and their source locations ("file:line")."""

    nodes: tuple[str, ...]
    locations: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        _set(self, "nodes", tuple(self.nodes))
        _set(self, "locations", tuple(self.locations))


@dataclass(frozen=True)
class Guard:
    """A run-time condition that keeps an applied rewrite valid; ``code`` is counted on failure."""

    id: str
    description: str
    code: str
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _set(self, "evidence", jsonable(dict(self.evidence)))
        lookup(self.code)


@dataclass(frozen=True)
class Witness:
    """A float64 comparison of the rewritten and the native computation on sample inputs."""

    seed: int
    dtype: str
    shapes: Mapping[str, Any]
    max_abs_value_diff: float
    max_abs_grad_diff: float
    compared: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "shapes", jsonable(dict(self.shapes)))
        _set(self, "compared", tuple(self.compared))


@dataclass(frozen=True)
class Certificate:
    """The record of one pass's decision about one site. See the module docstring."""

    pass_name: str
    site: Site
    decision: str
    checks: tuple[Check, ...] = ()
    codes: tuple[str, ...] = ()
    effect: Mapping[str, Any] = field(default_factory=dict)
    guards: tuple[Guard, ...] = ()
    witness: Witness | None = None
    message: str = ""
    graph_fingerprint: str = ""  # of the graph the decision was taken on (set by the pipeline)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _set(self, "checks", tuple(self.checks))
        _set(self, "codes", tuple(self.codes))
        _set(self, "guards", tuple(self.guards))
        _set(self, "effect", jsonable(dict(self.effect)))
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {self.decision!r}")
        for code in self.codes:
            occurs(code)
        if self.decision == "applied" and self.codes:
            raise ValueError("an applied certificate carries no refusal codes")
        if self.decision != "applied" and not self.codes:
            raise ValueError(f"a {self.decision} certificate needs at least one code")

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_checks(cls, pass_name: str, site: Site, checks: list[Check] | tuple[Check, ...],
                    **kwargs: Any) -> "Certificate":
        """The certificate whose decision and codes are :func:`decide`'s for ``checks``."""
        decision, codes = decide(checks)
        return cls(pass_name, site, decision, tuple(checks), codes, **kwargs)

    @property
    def applied(self) -> bool:
        return self.decision == "applied"

    @property
    def id(self) -> str:
        """``pass@nodes``: unique within one pipeline run (a pass decides once per site)."""
        return f"{self.pass_name}@{'+'.join(self.site.nodes) or '-'}"

    # -- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON data of this certificate, its ``digest`` last."""
        data = to_json_data(as_evidence(self))
        data[DIGEST_KEY] = content_digest(data)
        return data

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check_digest: bool = True) -> "Certificate":
        """The certificate ``to_dict`` gave ``data``. ValueError, naming what is wrong, for another
        schema version, a structure or field type that is not the schema's, an unknown code, or
        (``check_digest``) a digest that is not the content's: an edit after writing."""
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"certificate schema {version!r} is not {SCHEMA_VERSION}")
        try:
            decoded = decode_floats(dict(data))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a tagged float is not a float: {exc}") from None
        wrong = mismatches(decoded, CERTIFICATE, "certificate")
        if wrong:
            more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
            raise ValueError("; ".join(wrong[:5]) + more)
        if check_digest and data[DIGEST_KEY] != content_digest(data):
            where = f"{data['pass_name']} @ {', '.join(data['site']['nodes']) or '-'}"
            raise ValueError(f"certificate {where} was edited after it was written: its digest "
                             f"is {data[DIGEST_KEY]}, "
                             f"its content's {content_digest(data)}")
        data = _from_json_data(decoded)
        witness = data["witness"]
        try:
            return cls(
                pass_name=data["pass_name"],
                site=Site(**data["site"]),
                decision=data["decision"],
                checks=tuple(Check(**c) for c in data["checks"]),
                codes=data["codes"],
                effect=data["effect"],
                guards=tuple(Guard(**g) for g in data["guards"]),
                witness=None if witness is None else Witness(**witness),
                message=data["message"],
                graph_fingerprint=data["graph_fingerprint"],
                schema_version=version,
            )
        except KeyError as exc:  # lookup() of an unknown code; its message lists every code
            raise ValueError(str(exc.args[0]).split(";")[0]) from None

    @classmethod
    def from_json(cls, text: str) -> "Certificate":
        return cls.from_dict(json.loads(text))


def decide(checks: Iterable[Check]) -> tuple[str, tuple[str, ...]]:
    """The decision and codes that ``checks`` give.

    Applied when every check holds. Otherwise the codes are the failed checks' codes (in order,
    each once), and the decision is "failed" when one of them is a failure code (fxpasses broke,
    see :mod:`fxpasses.certificates.codes`), else "refused".
    """
    codes = tuple(dict.fromkeys(c.code for c in checks if not c.ok))
    if not codes:
        return "applied", ()
    failure = any(lookup(code).kind == "failure" for code in codes)
    return ("failed" if failure else "refused"), codes


def as_evidence(obj: Any) -> Any:
    """A certificate part as nested evidence data (dataclasses become dicts)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: as_evidence(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return tuple(as_evidence(item) for item in obj)
    return obj


__all__ = ["Certificate", "Check", "Guard", "Site", "Witness", "decide", "jsonable",
           "SCHEMA_VERSION", "DECISIONS", "REGISTRY"]
