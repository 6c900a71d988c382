"""Certificates: validation, lossless JSON round trip (property-tested), readable text."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, strategies as st

from fxpasses.certificates import (DECISIONS, REGISTRY, Certificate, Check, Guard, Site, Witness,
                                   jsonable, render_certificate)
from fxpasses.certificates.integrity import decision_problems
from fxpasses.certificates.model import decide

# certificates here are built by hand or drawn at random: their codes do not count as exercised
pytestmark = pytest.mark.usefixtures("codes_not_counted")

_codes = st.sampled_from(sorted(REGISTRY))
_names = st.text(min_size=1, max_size=12)
_scalars = st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False) | st.text(max_size=20)
_evidence_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_evidence = st.dictionaries(st.text(max_size=10), _evidence_values, max_size=5)


@st.composite
def checks(draw):
    ok = draw(st.booleans())
    return Check(draw(_names), ok, draw(_evidence), None if ok and draw(st.booleans()) else draw(_codes))


@st.composite
def certificates(draw):
    site = Site(tuple(draw(st.lists(_names, max_size=3))), tuple(draw(st.lists(_names, max_size=3))),
                draw(st.text(max_size=20)))
    the_checks = draw(st.lists(checks(), max_size=5))
    witness = draw(st.none() | st.builds(
        Witness, st.integers(0, 2**31), st.just("torch.float64"), _evidence,
        st.floats(allow_nan=False), st.floats(allow_nan=False), st.lists(_names, max_size=3).map(tuple)))
    guards = draw(st.lists(st.builds(Guard, _names, st.text(max_size=20), _codes, _evidence), max_size=3))
    decision = draw(st.sampled_from(["applied", "refused", "failed"]))
    codes = () if decision == "applied" else tuple(draw(st.lists(_codes, min_size=1, max_size=3)))
    return Certificate(draw(_names), site, decision, tuple(the_checks), codes, draw(_evidence),
                       tuple(guards), witness, draw(st.text(max_size=30)), draw(st.text(max_size=16)))


@given(certificates())
def test_json_round_trip_is_lossless(cert):
    text = cert.to_json()
    assert Certificate.from_json(text) == cert
    assert Certificate.from_json(text).to_json() == text


def test_non_finite_floats_survive_as_strict_json():
    cert = Certificate("p", Site(("n",)), "applied", effect={"inf": math.inf, "nan": math.nan})
    text = cert.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = Certificate.from_json(text)
    assert back.effect["inf"] == math.inf and math.isnan(back.effect["nan"])


def test_torch_values_are_normalised_into_evidence():
    check = Check("meta", True, {"dtype": torch.float32, "device": torch.device("cpu"),
                                 "shape": torch.Size([2, 3]), "rows": [1, 2]})
    assert check.evidence == {"dtype": "torch.float32", "device": "cpu", "shape": (2, 3), "rows": (1, 2)}
    assert type(jsonable(torch.__version__)) is str  # a str subclass becomes a plain str
    with pytest.raises(TypeError, match="cannot record"):
        jsonable(object())


def test_decisions_and_codes_are_validated():
    site = Site(("n",))
    with pytest.raises(ValueError, match="decision"):
        Certificate("p", site, "maybe")
    with pytest.raises(ValueError, match="no refusal codes"):
        Certificate("p", site, "applied", codes=("not-training",))
    with pytest.raises(ValueError, match="at least one code"):
        Certificate("p", site, "refused")
    with pytest.raises(KeyError, match="unknown fxpasses code"):
        Certificate("p", site, "refused", codes=("no-such-code",))
    with pytest.raises(ValueError, match="needs a code"):
        Check("c", False)


def test_from_checks_runs_no_short_circuit_and_collects_every_code():
    cert = Certificate.from_checks("p", Site(("n",)), [
        Check("a", False, {}, "hooks-present"), Check("b", True), Check("c", False, {}, "not-training")])
    assert cert.decision == "refused" and cert.codes == ("hooks-present", "not-training")
    assert len(cert.checks) == 3
    text = render_certificate(cert)
    assert "FAIL a  [hooks-present]" in text and "ok   b" in text and "hint:" in text


@given(st.lists(checks(), max_size=5))
def test_the_decision_follows_from_the_checks_and_any_other_is_named(the_checks):
    cert = Certificate.from_checks("p", Site(("n",)), the_checks)
    failed = [c.code for c in the_checks if not c.ok]
    assert cert.applied == (not failed) and set(cert.codes) == set(failed)
    assert decision_problems(cert) == []
    for other in set(DECISIONS) - {cert.decision}:
        codes = () if other == "applied" else (cert.codes or ("hooks-present",))
        lying = dataclasses.replace(cert, decision=other, codes=codes)
        assert "decision-mismatch" in {p.kind for p in decision_problems(lying)}


def test_a_failure_code_among_the_failed_checks_makes_the_decision_failed():
    checks_ = [Check("a", False, {}, "hooks-present"), Check("b", False, {}, "pass-raised")]
    assert decide(checks_) == ("failed", ("hooks-present", "pass-raised"))
    assert decide(checks_[:1]) == ("refused", ("hooks-present",))
    assert decide([Check("a", True)]) == ("applied", ())
