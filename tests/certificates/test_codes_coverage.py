"""The session collects the codes that actually occur (see tests/conftest.py); this checks the
collector itself: codes in certificates, checks, run-time counters and errors are all noted."""

from __future__ import annotations

from fxpasses.certificates import Certificate, Check, Site
from fxpasses.certificates.codes import REGISTRY, note, observe
from fxpasses.ir.runtime_op import RuntimeOp


def test_codes_that_occur_are_observed(codes_not_counted):
    seen = observe()
    seen.discard("pair-single-call")
    seen.discard("hook-added")
    Check("x", False, {}, "pair-single-call")
    assert "pair-single-call" in seen
    op = RuntimeOp("probe")
    op.count("hook-added")
    op.count("replayed")  # an event, not a code: not noted
    assert "hook-added" in seen and "replayed" not in seen
    Certificate("p", Site(()), "refused", codes=("pair-single-call",))
    note("not-a-code")
    assert "not-a-code" not in seen and seen <= set(REGISTRY)
